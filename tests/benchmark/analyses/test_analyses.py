"""Every analysis on a tiny store, run once through the CLI (``stage=analyze analysis=all``), its
numbers checked against independent computations: the toy's vectorised training against torch
training each network alone and its symmetry removal against plain forward passes, min-mass
against cvxpy, pairwise MI against the MI of each pair's predictions, Kendall's tau against
scipy on independently sorted snapshots, KS against scipy on the store's values; then the bad
input: missing store inputs name what to run first, an unknown analysis lists the valid ones."""
from __future__ import annotations

import math
import typing

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.colors import LogNorm
from matplotlib.image import imread
from scipy import stats
from torch import nn

from benchmark.analyses import OWN, MissingInputsError, NotApplicableError, found, min_mass, permutation_frequency, toy
from benchmark.core.figures import COLUMN_WIDTH, DPI, style
from benchmark.cli import check_command_line, run
from benchmark.config import ConfigError
from benchmark.loader import analysis_names, load, schema
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.core.store import (
    load_checkpoints_as_sample_set, load_sample_set, save_checkpoint, save_sample_set, stack_state_dicts,
)
from benchmark.core.training import seeded, train_network
from benchmark.core.training.vectorised import train_networks
from metrics.predictive import mutual_information
from metrics.symmetries import canonicalize, sort_units, spec_for_model
from bench.minmass_cvxpy import min_mass_cvxpy
from tests.conftest import compose_config
from tests.benchmark.units import write_initial_checkpoints

ANALYSES = found()
"""Every analysis by name: the package's, then the references' hooks."""

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast

REFERENCE = list(range(8))
TINY = ["seeds.reference=[0,8]", "seeds.heldout=[100000,100004]", "sample.repetitions=1", "threads=1",
        "analyze.toy.networks=400", "analyze.collapse.max_pairs=20", "analyze.permutation_frequency.runs=2",
        "analyze.permutation_frequency.log_every=2", "train.epochs=2", "train.milestones=[1]",
        "train.fail_rule.epoch=null", "evaluate.reference_resamples=0", "evaluate.test_permutations=0"]


def _overrides(root, *extra):
    return [f"store={root / 'store'}", f"results={root / 'results'}", *TINY, *extra]


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    """A store with a reference zoo of seeded initialisations (evaluation does not care whether
    they were trained), one 'ensemble' sample set of held-out initialisations, and every analysis
    run on it through the CLI."""
    root = tmp_path_factory.mktemp("analyze")
    exp = Experiment(compose_config(_overrides(root)))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, [*REFERENCE, *range(100000, 100004)])
    members = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(100000, 100004)))
    meta = {"experiment": exp.name, "method": "ensemble", "mode": "multi", "repetition": 0}
    save_sample_set(exp.store.samples_path(exp.store.sample_unit("ensemble", "multi")), members, meta)
    save_sample_set(exp.store.preds_path(exp.store.sample_unit("ensemble", "multi")), {"id": torch.full((4, 2, 10), 0.1),
                                                                "ood": torch.full((4, 2, 10), 0.1)}, meta)
    torch.set_num_threads(1)
    run(compose_config(_overrides(root, "stage=analyze", "analysis=all")))
    return exp, root


def _csv(exp, name):
    return pd.read_csv(exp.results_dir / "figures" / f"{name}.csv")


def test_every_analysis_writes_png_pdf_and_csv_at_column_width(analyzed):
    exp, _ = analyzed
    figures = exp.results_dir / "figures"
    for name in [*(a for a in ANALYSES if a != "hmc"), "marginals_ks"]:  # hmc: only with reference=hmc
        for suffix in ("png", "pdf", "csv"):
            assert (figures / f"{name}.{suffix}").stat().st_size > 0, f"{name}.{suffix}"
        assert imread(figures / f"{name}.png").shape[1] == round(COLUMN_WIDTH * DPI), name
    index = (figures / "index.md").read_text()
    assert all(module.TITLE in index for module in ANALYSES.values())
    assert "Not applicable: drawn with reference=hmc" in index and not (figures / "hmc.png").exists()
    assert "from an earlier run" not in index and " s)" not in index  # no run times: a function of the inputs
    choice = typing.get_type_hints(schema().root)["analysis"]  # analysis=: the package's, the hooks', all
    assert [a.value for a in choice] == [*ANALYSES, "all"] == [*analysis_names(), "all"] == [*load().analyses, "all"]
    assert [*ANALYSES][len(OWN):] == ["hmc"] and ANALYSES["hmc"].__name__ == "benchmark.analyses.hmc"
    assert all(module.NAME == name for name, module in ANALYSES.items())


# --- toy ---------------------------------------------------------------------------------------------
def test_vectorised_toy_training_is_torch_training_each_network_alone():
    generator = torch.Generator().manual_seed(0)
    x, y = toy.blobs(generator)
    init = toy.default_init(3, generator, dtype=torch.float64)
    orders = toy.batch_orders(3, len(x), generator)
    trained, losses = toy.train_perceptrons(init, x, y, orders)
    for m in range(3):
        net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)).double()
        net.load_state_dict({f"{i}.{p}": init[f"fc{1 + i // 2}.{p}"][m] for i in (0, 2) for p in ("weight", "bias")})
        optimizer = torch.optim.SGD(net.parameters(), lr=toy.LR)
        for epoch in range(toy.EPOCHS):
            total = 0.0
            for step in range(len(x) // toy.BATCH_SIZE):
                index = orders[epoch, m, step * toy.BATCH_SIZE : (step + 1) * toy.BATCH_SIZE]
                loss = nn.BCEWithLogitsLoss()(net(x[index].double())[:, 0], y[index].double())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += float(loss.detach())
        for i in (0, 2):
            for p in ("weight", "bias"):
                torch.testing.assert_close(trained[f"fc{1 + i // 2}.{p}"][m], getattr(net[i], p).detach(), rtol=1e-9, atol=1e-9)
        assert float(losses[m]) == pytest.approx(total / (len(x) // toy.BATCH_SIZE), rel=1e-9)


def test_toy_removals_keep_every_function_and_sort_the_output_weights(analyzed):
    exp, _ = analyzed
    result, _ = toy.simulate(300, seed=1)
    inputs = torch.randn(50, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def outputs(form, m):
        net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)).double()
        net.load_state_dict({f"{i}.{p}": form[f"fc{1 + i // 2}.{p}"][m].double() for i in (0, 2) for p in ("weight", "bias")})
        return net(inputs).detach()

    for m in range(0, result.kept, 37):
        torch.testing.assert_close(outputs(result.sorted, m), outputs(result.raw, m), rtol=1e-5, atol=1e-5)
        assert float(result.scaled["fc1.weight"][m].norm(dim=1).sub(toy.NORM).abs().max()) < 1e-5
    numbers, summary = _csv(exp, "toy"), _csv(exp, "toy_summary").iloc[0]
    assert (numbers["sorted_w1"] <= numbers["sorted_w2"]).all()
    assert summary.networks_trained == 400 and len(numbers) == summary.networks_kept
    assert summary.dropped_fraction < 0.05 and summary.max_relative_change_scaling_permutation < 1e-4


def test_toy_check_catches_a_removal_that_changes_the_function(monkeypatch):
    params = {k: v[:20] for k, v in toy.default_init(20, torch.Generator().manual_seed(0)).items()}
    broken = lambda sample_set, spec, perms: {**sample_set, "fc1.bias": sample_set["fc1.bias"].flip(1)}  # noqa: E731
    monkeypatch.setattr(toy, "permute", broken)
    with pytest.raises(RuntimeError, match="removing scaling\\+permutation changed the function of"):
        toy.remove_symmetries(params, torch.Generator().manual_seed(0))


def test_toy_panels_share_one_log_colour_scale():
    result, _ = toy.simulate(300, seed=1)
    points = toy.output_weights(result)
    with style():
        figure = toy.draw(points, result.kept)
    meshes = [ax.collections[0] for ax in figure.axes[:3]]
    counts = [float(mesh.get_array().max()) for mesh in meshes]
    assert len(set(counts)) > 1, "the panels' largest bins differ, so one scale per panel would differ too"
    norm = meshes[0].norm
    assert isinstance(norm, LogNorm) and (norm.vmin, norm.vmax) == (1, max(counts))
    assert all(mesh.norm is norm for mesh in meshes)
    assert figure.axes[3].get_ylim() == pytest.approx((1, max(counts))), "the colorbar spans the shared scale"


def test_toy_warns_and_flags_when_more_than_one_percent_is_dropped(analyzed, tmp_path, monkeypatch, caplog):
    _, losses = toy.simulate(200, seed=0)
    monkeypatch.setattr(toy, "KEEP_LOSS", float(losses.median()))  # drops about half
    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}",
                                     "analyze.toy.networks=200", "analyze.toy.seed=0"]))
    with caplog.at_level("WARNING", logger=toy.__name__):
        toy.run(exp)
    summary = _csv(exp, "toy_summary").iloc[0]
    assert summary.networks_kept == int((losses <= losses.median()).sum()) and summary.dropped_above_paper
    assert "more than the paper's <1%" in caplog.text
    fixture = _csv(analyzed[0], "toy_summary").iloc[0]
    dropped = fixture.networks_trained - fixture.networks_kept
    assert fixture.dropped_above_paper == (100 * dropped > fixture.networks_trained)
    second = float(losses.sort().values[1])
    monkeypatch.setattr(toy, "KEEP_LOSS", (float(losses.min()) + second) / 2)  # exactly one network kept
    with pytest.raises(RuntimeError, match="toy: only 1 of 200 networks reached a last-epoch loss"):
        toy.simulate(200, seed=0)
    assert "early stopping is not implemented" in toy.CAPTION


# --- min_mass --------------------------------------------------------------------------------------
def test_min_mass_numbers_against_cvxpy_and_the_direct_mass(analyzed):
    exp, _ = analyzed
    numbers = _csv(exp, "min_mass").set_index("seed")
    zoo = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(REFERENCE[:3]))
    spec = spec_for_model(exp.model())
    _, exact = min_mass_cvxpy(zoo, spec)
    for i, seed in enumerate(REFERENCE[:3]):
        direct = sum(float(zoo[k][i].double().square().sum()) for k in ("conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight"))
        assert numbers.loc[seed, "mass_before"] == pytest.approx(direct, rel=1e-6)
        assert numbers.loc[seed, "mass_after"] == pytest.approx(float(exact["mass_after"][i]), rel=1e-5)
        assert numbers.loc[seed, "max_abs_fc2_before"] == pytest.approx(float(zoo["fc2.weight"][i].abs().max()), rel=1e-6)
    assert (numbers["max_prob_change"] < 1e-4).all()


# --- collapse --------------------------------------------------------------------------------------
def test_pairwise_mi_against_each_pairs_predictions_and_pearson_against_scipy(analyzed):
    exp, _ = analyzed
    numbers, summary = _csv(exp, "collapse"), _csv(exp, "collapse_summary").iloc[0]
    assert len(numbers) == summary.pairs == 20 and summary.all_pairs == 28 and summary.members == 8
    assert len({(i, j) for i, j in zip(numbers.seed_i, numbers.seed_j)}) == 20
    model = exp.model()
    for row in numbers.head(4).itertuples():
        pair = load_checkpoints_as_sample_set(exp.store.checkpoint_paths([row.seed_i, row.seed_j]))
        assert row.id_mi == pytest.approx(mutual_information(predict_with_weights(model, pair, exp.test_tensors[0])), rel=1e-5)
        assert row.ood_mi == pytest.approx(mutual_information(predict_with_weights(model, pair, exp.ood_tensors[0])), rel=1e-5)
    expected = stats.pearsonr(numbers.id_mi, numbers.ood_mi)
    assert summary.pearson_r == pytest.approx(expected.statistic, rel=1e-6)
    assert summary.pearson_p == pytest.approx(expected.pvalue, rel=1e-4)


# --- permutation_frequency ---------------------------------------------------------------------------
def _every_step(exp, seed):
    """The weights at initialisation and after every step of seed ``seed``'s training, collected
    independently of ``trace`` (same recipe and seeds: ``train_network`` is deterministic)."""
    with seeded(seed):
        model = exp.model()
    snapshots = [{k: v.clone() for k, v in model.state_dict().items()}]
    train_network(model, exp.train_set, exp.validation_tensors, exp.recipe, seed,
                  on_step=lambda epoch, step, net: snapshots.append({k: v.clone() for k, v in net.state_dict().items()}))
    return stack_state_dicts(snapshots)


def test_kendall_tau_of_successive_sorting_permutations_against_scipy(analyzed):
    exp, _ = analyzed
    runs = _csv(exp, "permutation_frequency_runs")
    assert sorted(runs.seed.unique()) == [900000, 900001]
    spec = spec_for_model(exp.model())
    scaled = canonicalize(_every_step(exp, 900000), spec, ("scale",))[0]
    every = sort_units(scaled, spec, "first")[1]  # {group: [1 + steps, n]}
    steps_total = 2 * math.ceil(len(exp.train_set) / exp.recipe.batch_size)
    assert steps_total % 5 != 0, "the last step is logged on its own"
    logged = [*range(0, steps_total + 1, 5), steps_total]
    # trace keeps only the permutations; a buffer of one state sorts every logged network on its own
    one_state = permutation_frequency.state_bytes(exp.model().state_dict())
    traced, steps, failure = permutation_frequency.trace(exp, 900000, log_every=5, buffer_bytes=one_state)
    assert failure is None and steps["step"].tolist() == logged and set(traced) == set(every)
    for group, perm in every.items():
        assert traced[group].dtype == torch.int64 and torch.equal(traced[group], perm[logged]), group
    mine = runs[runs.seed == 900000]  # the analysis: every 2 steps
    for group, perm in every.items():
        if perm.shape[1] < 2:
            continue
        perm = perm[::2].numpy()
        expected = [stats.kendalltau(a, b).statistic for a, b in zip(perm[:-1], perm[1:])]
        np.testing.assert_allclose(mine[mine.group == group].tau.to_numpy(), expected, rtol=1e-5)  # CSV: 6 digits
    means = _csv(exp, "permutation_frequency")
    by_step = runs.groupby(["seed", "step"]).tau.mean().groupby("step").mean()
    np.testing.assert_allclose(means.set_index("step").mean_tau.loc[by_step.index], by_step.to_numpy(), rtol=1e-5)
    assert set(means.lr) == {exp.recipe.lr, exp.recipe.lr * exp.recipe.gamma}


def test_permutation_buffer_too_small_for_one_network_is_refused_naming_the_setting(analyzed):
    exp, _ = analyzed
    one_state = permutation_frequency.state_bytes(exp.model().state_dict())
    with pytest.raises(ConfigError, match=r"analyze\.permutation_frequency\.buffer_bytes=1419: .*use "
                                          r"analyze\.permutation_frequency\.buffer_bytes=1420"):
        permutation_frequency.trace(exp, 900000, log_every=5, buffer_bytes=one_state - 1)
    with pytest.raises(ConfigError, match=r"analyze\.permutation_frequency\.buffer_bytes=2839: 2 network"):
        permutation_frequency.trace_stacked(exp, [900000, 900001], log_every=5, buffer_bytes=2 * one_state - 1)
    with pytest.raises(ConfigError, match=r"analyze\.permutation_frequency\.buffer_bytes"):
        permutation_frequency.check_buffer(exp, buffer_bytes=2**60)  # canonicalising it would not fit either


def test_stacked_traces_do_not_depend_on_the_stack_and_end_at_the_zoos_stacked_weights(analyzed):
    """A stacked run's permutations are its own to the bit whatever trains beside it (a buffer
    that flushes at other steps gives the same rows), and its last row sorts the network the
    zoo's stacked trainer (``train_networks``) trains from the same seed."""
    exp, _ = analyzed
    seeds = [900000, 900001]
    one_state = permutation_frequency.state_bytes(exp.model().state_dict())
    together = permutation_frequency.trace_stacked(exp, seeds, log_every=3, buffer_bytes=2 * 7 * one_state)
    alone = permutation_frequency.trace_stacked(exp, seeds[1:], log_every=3)
    steps_total = 2 * math.ceil(len(exp.train_set) / exp.recipe.batch_size)
    for (perms, steps, failure), (mine, my_steps, my_failure) in zip(together[1:], alone):
        assert failure == my_failure and steps.equals(my_steps)
        assert steps["step"].tolist() == sorted({*range(0, steps_total + 1, 3), steps_total})
        assert set(perms) == set(mine) and all(torch.equal(perms[g], mine[g]) for g in perms)
    models = []
    for seed in seeds:
        with seeded(seed):
            models.append(exp.model())
    zoo = train_networks(models, exp.training_data, exp.recipe, seeds, [str(s) for s in seeds])
    spec = spec_for_model(exp.model())
    for (perms, _, failure), outcome in zip(together, zoo):
        assert failure == outcome.failure
        final = canonicalize(stack_state_dicts([outcome.state_dict]), spec, permutation_frequency.sort_steps(exp))[1]
        assert all(torch.equal(perms[g][-1], final["sort"][g][0].long()) for g in perms)


@pytest.mark.parametrize("experiment", ["cifar100_resnet18", "tinyimagenet_resnet18"])
def test_resnet_permutation_traces_fit_in_memory(experiment, tmp_path):
    """The ResNet experiments log sparsely enough that a run's permutations ([T, units] int64)
    stay small, and train few runs (each is a full ResNet-18 training)."""
    exp = Experiment(compose_config([f"store={tmp_path}", f"experiment={experiment}"]))
    settings = exp.config.analyze.permutation_frequency
    steps = exp.recipe.epochs * math.ceil({"cifar100_resnet18": 50000, "tinyimagenet_resnet18": 100000}[experiment]
                                          / exp.recipe.batch_size)
    units = sum(g.size for g in spec_for_model(exp.model()).groups)
    assert settings.runs <= 3 and 100 <= steps // settings.log_every <= 1000
    assert settings.runs * (1 + steps // settings.log_every) * units * 8 < 64 * 2**20


# --- marginals -------------------------------------------------------------------------------------
def test_marginal_ks_against_scipy_on_the_store_values(analyzed):
    exp, _ = analyzed
    numbers = _csv(exp, "marginals_ks").set_index(["method", "mode", "layer", "form"])
    zoo = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(REFERENCE))
    samples = load_sample_set(exp.store.samples_path(exp.store.sample_unit("ensemble", "multi")))
    spec = spec_for_model(exp.model())
    forms = {"raw": (zoo, samples), "NS": (canonicalize(zoo, spec, ("scale", "sort"))[0],
                                         canonicalize(samples, spec, ("scale", "sort"))[0])}
    for form, (a, b) in forms.items():
        for key in ("conv1.weight", "fc1.weight"):
            expected = stats.ks_2samp(a[key].flatten().double().numpy(), b[key].flatten().double().numpy())
            row = numbers.loc[("ensemble", "multi", key, form)]
            assert row.ks_statistic == pytest.approx(expected.statistic) and row.ks_pvalue == pytest.approx(expected.pvalue)
    histograms = _csv(exp, "marginals")
    for source, values in (("zoo", zoo), ("Deep Ensembles [multi]", samples)):
        mine = histograms[(histograms.layer == "fc1.weight") & (histograms.form == "raw") & (histograms.source == source)]
        edges = np.append(mine.bin_left.to_numpy(), mine.bin_right.iloc[-1])
        expected = np.histogram(values["fc1.weight"].flatten().double().numpy(), bins=edges, density=True)[0]
        np.testing.assert_allclose(mine.density.to_numpy(), expected, rtol=1e-4)  # edges: 6 digits in the CSV
    units = _csv(exp, "marginals_ks_units")
    raw = units[(units.layer == "fc1.weight") & (units.form == "raw") & (units.unit_b == 2)].iloc[0]
    expected = stats.ks_2samp(zoo["fc1.weight"][:, 0].flatten().numpy(), zoo["fc1.weight"][:, 2].flatten().numpy())
    assert raw.ks_statistic == pytest.approx(expected.statistic)
    modes = _csv(exp, "marginals_ks_modes").set_index(["group", "block_moves"])
    total = modes.loc[("total", True)]
    assert total.log10_modes_median == pytest.approx(math.log10(2 * math.factorial(5) ** 2 * 6))
    assert modes.loc[("conv1", False)].log10_modes_median == 0.0


def test_marginals_subsample_large_layers_show_a_few_and_stream_to_the_same_numbers(analyzed, tmp_path):
    exp, root = analyzed
    small = ["analyze.marginals.max_values=300", "analyze.marginals.max_layers_shown=2", "analyze.marginals.max_units=1"]
    results = {}
    for name, extra in (("memory", []), ("streamed", ["evaluate.max_in_memory_gb=1e-6"])):
        cfg = compose_config([f"store={root / 'store'}", f"results={tmp_path / name}", *TINY, "stage=analyze",
                              "analysis=marginals", *small, *extra])
        run(cfg)
        results[name] = Experiment(cfg)
    numbers = _csv(results["memory"], "marginals_ks").set_index(["method", "mode", "layer", "form"])
    spec = spec_for_model(exp.model())
    zoo = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(REFERENCE))
    samples = load_sample_set(exp.store.samples_path(exp.store.sample_unit("ensemble", "multi")))
    forms = {"raw": (zoo, samples), "NS": (canonicalize(zoo, spec, ("scale", "sort"))[0],
                                         canonicalize(samples, spec, ("scale", "sort"))[0])}

    def subsample(tensor, position):  # 300 of the entries, column-major positions drawn from (seed 0, layer position)
        flat = tensor.reshape(len(tensor), -1).T.reshape(-1).double().numpy()
        return flat[np.sort(np.random.default_rng((0, position)).choice(flat.size, 300, replace=False))]

    position = list(spec.mass_keys).index("conv2.weight")
    for form, (a, b) in forms.items():
        row = numbers.loc[("ensemble", "multi", "conv2.weight", form)]
        assert (row.n_zoo, row.zoo_entries, row.n_method, row.method_entries) == (300, 8 * 250, 300, 4 * 250)
        expected = stats.ks_2samp(subsample(a["conv2.weight"], position), subsample(b["conv2.weight"], position))
        assert row.ks_statistic == pytest.approx(expected.statistic, rel=1e-5)  # CSV: 6 digits
        assert row.ks_pvalue == pytest.approx(expected.pvalue, rel=1e-5)
        whole = numbers.loc[("ensemble", "multi", "fc2.weight", form)]
        assert (whole.n_zoo, whole.zoo_entries) == (8 * 30, 8 * 30), "a layer within max_values is used whole"
    assert set(numbers.index.get_level_values("layer")) == set(spec.mass_keys), "the CSV keeps every layer"
    assert sorted(numbers[numbers["shown"]].index.get_level_values("layer").unique()) == ["conv1.weight", "fc2.weight"]
    assert (numbers["max_values"] == 300).all() and (numbers["subsample_seed"] == 0).all()
    figures = results["memory"].results_dir / "figures"
    legend_rows = 1  # the zoo and one method, two columns
    height = 1.05 * 2 + 0.35 + 0.12 * legend_rows
    assert imread(figures / "marginals.png").shape[0] == round(height * DPI), "two layers shown"
    assert set(_csv(results["memory"], "marginals_ks_units").unit_b) == {1}
    for name in ("marginals", "marginals_ks", "marginals_ks_units"):
        pd.testing.assert_frame_equal(_csv(results["streamed"], name), _csv(results["memory"], name), obj=name)


# --- bad input -------------------------------------------------------------------------------------
def test_an_unknown_analysis_is_refused_with_the_valid_ones():
    problem = check_command_line(["stage=analyze", "analysis=histogram"])
    assert problem.startswith("analysis: Invalid value 'histogram', expected one of [toy, min_mass, collapse, "
                              "permutation_frequency, marginals, hmc, all]")


def test_missing_store_inputs_name_what_to_run_first(tmp_path):
    empty = _overrides(tmp_path, "stage=analyze")
    with pytest.raises(MissingInputsError, match="analysis=collapse needs the reference zoo.*run python -m benchmark "
                                                 "stage=zoo experiment=digits_optunet zoo.range=reference first"):
        run(compose_config([*empty, "analysis=collapse"]))
    with pytest.raises(MissingInputsError, match="analysis=min_mass needs the reference zoo.*\\| analysis=collapse.*"
                                                 "\\| analysis=marginals needs the reference zoo"):
        run(compose_config([*empty, "analysis=all"]))
    assert not (tmp_path / "results").exists(), "nothing is written before the inputs are checked"


def test_marginals_without_samples_names_the_sample_stage(analyzed, tmp_path):
    exp, root = analyzed
    cfg = compose_config([f"store={root / 'store'}", f"results={tmp_path}", *TINY, "stage=analyze",
                          "analysis=marginals", "experiment_name=digits_optunet"])
    empty = Experiment(cfg)
    samples = exp.store.samples_dir
    moved = samples.with_name("samples_away")
    samples.rename(moved)
    try:
        with pytest.raises(MissingInputsError, match="holds none; run python -m benchmark stage=sample experiment=digits_optunet"):
            ANALYSES["marginals"].check(empty)
    finally:
        moved.rename(samples)


def test_min_mass_does_not_apply_to_batchnorm_networks(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path}", "model=resnet18"]))
    with pytest.raises(NotApplicableError, match="min-mass is degenerate.*absorbed by BatchNorm"):
        min_mass.applies(exp)
