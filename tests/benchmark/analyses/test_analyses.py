"""Every analysis on a tiny store, run once through the CLI (``stage=analyze analysis=all``), its
numbers checked against independent computations: the toy's vectorised training against torch
training each network alone and its symmetry removal against plain forward passes, min-mass
against cvxpy, pairwise MI against the MI of each pair's predictions, Kendall's tau against
scipy on independently sorted snapshots, KS against scipy on the store's values; then the bad
input: missing store inputs name what to run first, an unknown analysis lists the valid ones."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.image import imread
from scipy import stats
from torch import nn

from benchmark.analyses import ANALYSES, MissingInputsError, NotApplicableError, min_mass, permutation_frequency, toy
from benchmark.analyses.figures import COLUMN_WIDTH, DPI
from benchmark.cli import check_command_line, run
from benchmark.config import Analysis
from benchmark.experiment import Experiment
from benchmark.models import predict_with_weights
from benchmark.store import load_checkpoints_as_sample_set, load_sample_set, save_checkpoint, save_sample_set
from benchmark.training import seeded
from metrics.predictive import mutual_information
from metrics.symmetries import canonicalize, min_mass_cvxpy, sort_units, spec_for_model
from tests.conftest import compose_config

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
    for seed in [*REFERENCE, *range(100000, 100004)]:
        with seeded(seed):
            state = exp.model().state_dict()
        save_checkpoint(exp.store.checkpoint_path(seed), state, {"seed": seed, "experiment": exp.name})
    members = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(100000, 100004)))
    meta = {"experiment": exp.name, "method": "ensemble", "mode": "multi", "repetition": 0}
    save_sample_set(exp.store.samples_path("ensemble", "multi"), members, meta)
    save_sample_set(exp.store.preds_path("ensemble", "multi"), {"id": torch.full((4, 2, 10), 0.1),
                                                                "ood": torch.full((4, 2, 10), 0.1)}, meta)
    torch.set_num_threads(1)
    run(compose_config(_overrides(root, "stage=analyze", "analysis=all")))
    return exp, root


def _csv(exp, name):
    return pd.read_csv(exp.results_dir / "figures" / f"{name}.csv")


def test_every_analysis_writes_png_pdf_and_csv_at_column_width(analyzed):
    exp, _ = analyzed
    figures = exp.results_dir / "figures"
    for name in [*ANALYSES, "marginals_ks"]:
        for suffix in ("png", "pdf", "csv"):
            assert (figures / f"{name}.{suffix}").stat().st_size > 0, f"{name}.{suffix}"
        assert imread(figures / f"{name}.png").shape[1] == round(COLUMN_WIDTH * DPI), name
    index = (figures / "index.md").read_text()
    assert all(module.TITLE in index for module in ANALYSES.values())
    assert [a.value for a in Analysis] == [*ANALYSES, "all"], "the config's Analysis enum lists the analyses table"


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
def test_kendall_tau_of_successive_sorting_permutations_against_scipy(analyzed):
    exp, _ = analyzed
    runs = _csv(exp, "permutation_frequency_runs")
    assert sorted(runs.seed.unique()) == [900000, 900001]
    snapshots, steps, failure = permutation_frequency.trace(exp, 900000, log_every=2)
    steps_per_epoch = math.ceil(len(exp.train_set) / exp.recipe.batch_size)
    assert failure is None and len(steps) == 1 + (2 * steps_per_epoch) // 2
    spec = spec_for_model(exp.model())
    scaled = canonicalize(snapshots, spec, ("scale",))[0]
    perms = sort_units(scaled, spec, "first")[1]
    mine = runs[runs.seed == 900000]
    for group, perm in perms.items():
        if perm.shape[1] < 2:
            continue
        expected = [stats.kendalltau(a, b).statistic for a, b in zip(perm[:-1].numpy(), perm[1:].numpy())]
        np.testing.assert_allclose(mine[mine.group == group].tau.to_numpy(), expected, rtol=1e-5)  # CSV: 6 digits
    means = _csv(exp, "permutation_frequency")
    by_step = runs.groupby(["seed", "step"]).tau.mean().groupby("step").mean()
    np.testing.assert_allclose(means.set_index("step").mean_tau.loc[by_step.index], by_step.to_numpy(), rtol=1e-5)
    assert set(means.lr) == {exp.recipe.lr, exp.recipe.lr * exp.recipe.gamma}


# --- marginals -------------------------------------------------------------------------------------
def test_marginal_ks_against_scipy_on_the_store_values(analyzed):
    exp, _ = analyzed
    numbers = _csv(exp, "marginals_ks").set_index(["method", "mode", "layer", "form"])
    zoo = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(REFERENCE))
    samples = load_sample_set(exp.store.samples_path("ensemble", "multi"))
    spec = spec_for_model(exp.model())
    forms = {"raw": (zoo, samples), "NS": (canonicalize(zoo, spec, ("scale", "sort"))[0],
                                         canonicalize(samples, spec, ("scale", "sort"))[0])}
    for form, (a, b) in forms.items():
        for key in ("conv1.weight", "fc1.weight"):
            expected = stats.ks_2samp(a[key].flatten().double().numpy(), b[key].flatten().double().numpy())
            row = numbers.loc[("ensemble", "multi", key, form)]
            assert row.ks_statistic == pytest.approx(expected.statistic) and row.ks_pvalue == pytest.approx(expected.pvalue)
    units = _csv(exp, "marginals_ks_units")
    raw = units[(units.layer == "fc1.weight") & (units.form == "raw") & (units.unit_b == 2)].iloc[0]
    expected = stats.ks_2samp(zoo["fc1.weight"][:, 0].flatten().numpy(), zoo["fc1.weight"][:, 2].flatten().numpy())
    assert raw.ks_statistic == pytest.approx(expected.statistic)
    modes = _csv(exp, "marginals_ks_modes").set_index(["group", "block_moves"])
    total = modes.loc[("total", True)]
    assert total.log10_modes_median == pytest.approx(math.log10(2 * math.factorial(5) ** 2 * 6))
    assert modes.loc[("conv1", False)].log10_modes_median == 0.0


# --- bad input -------------------------------------------------------------------------------------
def test_an_unknown_analysis_is_refused_with_the_valid_ones():
    problem = check_command_line(["stage=analyze", "analysis=histogram"])
    assert problem.startswith("analysis: Invalid value 'histogram', expected one of [toy, min_mass, collapse, "
                              "permutation_frequency, marginals, all]")


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
        min_mass.check(exp)
