"""The reference rows (issue 31): each baseline draws what it says, and the evaluate stage scores it
exactly as an independent computation of the same draws would, over the repetitions; the zoo's
training potential is the summed cross-entropy plus the L2 term, recomputed here by hand."""
from __future__ import annotations

import math
import typing

import pandas as pd
import pytest
import torch

from benchmark.baselines import BASELINES, baseline_class
from benchmark.results import BASELINE_MODE
from benchmark.baselines.gaussian import gaussian_samples, reference_moments
from benchmark.baselines.init import INIT_SEED_START, init_samples
from benchmark.baselines.prior import prior_samples
from benchmark.baselines.second_zoo import second_zoo_seeds
from benchmark.config import ConfigError
from benchmark.core.models import fit_with_weights, predict_with_weights
from benchmark.core.store import load_checkpoints_as_sample_set
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.loader import load, schema
from benchmark.design import Design
from benchmark.references import ZooReference
from benchmark.report.tables import table1, table3
from benchmark.results import read_metrics, read_repetitions
from benchmark.stages.evaluate import run as run_evaluate
from benchmark.stages.report import run as run_report
from metrics.mmd import mmd
from metrics.predictive import predictive_metrics
from metrics.symmetries import canonicalize, spec_for_model
from tests.benchmark.units import write_unit, write_initial_checkpoints
from tests.conftest import ALL_BASELINES, compose_config

pytestmark = pytest.mark.slow  # builds a store and runs the evaluate stage: make test, not make test-fast


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Ten seeded initialisations as the reference zoo and eight as held-out networks (evaluation
    does not care whether they were trained); 2 repetitions of 4 samples."""
    root = tmp_path_factory.mktemp("baselines")
    exp = Experiment(compose_config([
        f"store={root / 'store'}", f"results={root / 'results'}", "seeds.reference=[0,10]",
        "seeds.heldout=[100000,100008]", "sample.repetitions=2", "sample.per_method=4", "sample.modes_multi=2",
        "evaluate.reference_resamples=4", "evaluate.test_permutations=100", "evaluate.weight_matching=false",
        "evaluate.baseline_repetitions=3", ALL_BASELINES]))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, [*range(10), *range(100000, 100008)])
    stride = Design(2, 4, 2).stride
    for r in range(2):  # one method row, as the evaluate stage needs: Deep Ensembles of the held-out networks
        seeds = list(range(100000 + r * stride, 100000 + r * stride + 4))
        members = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(seeds))
        preds = {"id": predict_with_weights(exp.model(), members, exp.test_tensors[0]),
                 "ood": predict_with_weights(exp.model(), members, exp.ood_tensors[0])}
        write_unit(exp, "ensemble", "multi", r, members, preds, base_seeds=seeds)
    return exp


def test_the_registry_holds_every_baseline_in_table_order_and_refuses_others():
    assert list(BASELINES) == ["prior", "init", "gaussian", "gaussian_ns", "second_zoo", "copies", "copies_multi"]
    with pytest.raises(ValueError, match=r"'nope' is not a registered baseline; expected some of \['prior', 'init', "):
        baseline_class("nope")


def test_an_unregistered_baseline_is_refused_when_the_config_is_resolved(tmp_path):
    assert load().baselines == BASELINES  # the schema is built from the registry
    assert typing.get_type_hints(schema().root)["evaluate"].known_baselines == tuple(BASELINES)
    with pytest.raises(ConfigError, match=r"evaluate.baselines='nope': expected registered baselines: some of prior, "
                                          r"init, gaussian, gaussian_ns, second_zoo, copies, copies_multi \(benchmark/baselines/\)"):
        Experiment(compose_config([f"store={tmp_path}", "evaluate.baselines=[prior,nope]"]))
    assert Experiment(compose_config([f"store={tmp_path}", "evaluate.baselines=[second_zoo]"])).config.evaluate.baselines \
        == ["second_zoo"]


def test_the_prior_draws_have_the_recipes_prior_variance(store):
    n_train, weight_decay = len(store.train_set), store.recipe.weight_decay
    draws = prior_samples(store, 200, torch.Generator().manual_seed(0))
    pooled = torch.cat([v.flatten() for v in draws.values()])
    assert set(draws) == set(store.model().state_dict())
    assert pooled.std().item() == pytest.approx((n_train * weight_decay) ** -0.5, rel=0.01)
    assert abs(pooled.mean().item()) < 0.02 * pooled.std().item()


def test_untrained_networks_are_the_models_initialisation_under_their_seeds(store):
    draws = init_samples(store, 3, repetition=1)
    for i in range(3):
        with seeded(INIT_SEED_START + 1000 + i):
            expected = store.model().state_dict()
        assert all(torch.equal(draws[k][i], v) for k, v in expected.items())


def test_the_gaussians_are_fitted_to_the_raw_and_the_symmetry_free_zoo(store):
    ref = ZooReference(store)
    zoo = load_checkpoints_as_sample_set(store.store.checkpoint_paths(range(10)))
    canonical = canonicalize(zoo, spec_for_model(store.model()), ["scale", "sort"])[0]
    for symmetry_free, fitted in ((False, zoo), (True, canonical)):
        moments = reference_moments(ref, symmetry_free)
        for key, values in fitted.items():
            mean, sd = moments[key]
            torch.testing.assert_close(mean.float(), values.double().mean(0).float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(sd.float(), values.double().std(0).float(), rtol=1e-4, atol=1e-6)
    moments = {"w": (torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([0.5, 3.0], dtype=torch.float64))}
    draws = gaussian_samples(moments, 20000, torch.Generator().manual_seed(1))["w"]
    torch.testing.assert_close(draws.mean(0), torch.tensor([1.0, -2.0]), atol=0.05, rtol=0)
    torch.testing.assert_close(draws.std(0), torch.tensor([0.5, 3.0]), rtol=0.02, atol=0)


def test_a_streamed_zoo_gives_the_same_moments(store, tmp_path):
    streamed = Experiment(compose_config([f"store={store.store.root}", "seeds.reference=[0,10]",
                                          "seeds.heldout=[100000,100008]", "evaluate.max_in_memory_gb=1e-7"]))
    ref = ZooReference(streamed)
    assert not ref.in_memory
    in_memory = reference_moments(ZooReference(store), True)
    for key, (mean, sd) in reference_moments(ref, True).items():
        torch.testing.assert_close(mean, in_memory[key][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sd, in_memory[key][1], rtol=1e-6, atol=1e-7)


def test_the_second_zoo_is_each_repetitions_block_of_held_out_networks(store):
    stride = Design(2, 4, 2).stride
    heldout = list(range(100000, 100008))
    assert second_zoo_seeds(store, 0, 4) == heldout[:4]
    assert second_zoo_seeds(store, 1, 4) == heldout[stride : stride + 4]
    with pytest.raises(ValueError, match=r"second_zoo.*repetition 2 needs 4 converged held-out.*evaluate.baselines"):
        second_zoo_seeds(store, 2, 4)


def test_the_copies_are_each_repetitions_bases_repeated(store):
    stride, heldout = Design(2, 4, 2).stride, list(range(100000, 100008))
    ref = ZooReference(store)
    for k in range(2):
        one, seeds = BASELINES["copies"].draw(store, ref, 4, k)
        assert seeds == [heldout[k * stride]]
        base = load_checkpoints_as_sample_set(store.store.checkpoint_paths(seeds))
        assert all(torch.equal(one[key], base[key].expand_as(one[key])) for key in base)
        multi, seeds = BASELINES["copies_multi"].draw(store, ref, 4, k)
        assert seeds == heldout[k * stride : k * stride + 2]  # sample.modes_multi=2 bases, 2 copies each
        bases = load_checkpoints_as_sample_set(store.store.checkpoint_paths(seeds))
        assert all(torch.equal(multi[key], bases[key][[0, 0, 1, 1]]) for key in bases)
    with pytest.raises(ValueError, match=r"per_method=3 does not split into 2 bases"):
        BASELINES["copies_multi"].draw(store, ref, 3, 0)


def test_fit_with_weights_is_the_summed_cross_entropy(store):
    zoo = load_checkpoints_as_sample_set(store.store.checkpoint_paths(range(3)))
    images, labels = store.train_tensors
    nll, correct = fit_with_weights(store.model(), zoo, images, labels, batch_size=100)
    for i in range(3):
        model = store.model()
        model.load_state_dict({k: v[i] for k, v in zoo.items()})
        model.eval()
        with torch.no_grad():
            logits = model(images).double()
        assert nll[i].item() == pytest.approx(torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item(),
                                              rel=1e-6)
        assert correct[i].item() == int((logits.argmax(-1) == labels).sum())


def test_evaluate_scores_each_baseline_as_its_draws_score_and_the_report_groups_them(store):
    frame = run_evaluate(store)
    rows = frame.set_index(["method", "mode"])
    assert [m for m, mode in rows.index if mode == BASELINE_MODE] == list(BASELINES)
    ref = ZooReference(store)
    zoo = load_checkpoints_as_sample_set(store.store.checkpoint_paths(range(10)))
    images, labels = store.test_tensors
    per_rep = read_repetitions(store.results_dir / "repetitions.csv").set_index(["method", "mode", "repetition"])
    assert rows.loc[("prior", BASELINE_MODE), "n_repetitions"] == 3  # evaluate.baseline_repetitions
    assert rows.loc[("second_zoo", BASELINE_MODE), "n_repetitions"] == 2  # one held-out block per method repetition
    for name in BASELINES:
        for k in range(2):
            samples, _ = BASELINES[name].draw(store, ref, 4, k)
            got = per_rep.loc[(name, BASELINE_MODE, k)]
            expected_mmd = mmd(zoo, samples).aggregate
            assert got["mmd_median"] == pytest.approx(expected_mmd["median"], rel=1e-6), (name, k)
            assert got["energy"] == pytest.approx(expected_mmd["energy"], rel=1e-6, abs=1e-12), (name, k)
            probs = predict_with_weights(store.model(), samples, images)
            ood = predict_with_weights(store.model(), samples, store.ood_tensors[0])
            expected = predictive_metrics(probs, labels, ood, reference_id=ref.predictive())
            assert got["acc"] == pytest.approx(expected["acc"], rel=1e-6) and got["tv"] == pytest.approx(expected["tv"], rel=1e-6)
    assert per_rep.loc[("second_zoo", BASELINE_MODE, 1), "base_seeds"] == " ".join(
        map(str, second_zoo_seeds(store, 1, 4)))
    # the zoo's training potential, by hand: summed cross-entropy + (N weight_decay / 2) |w|^2 over the parameters
    images, labels = store.train_tensors
    parameters = {name for name, _ in store.model().named_parameters()}
    nll, _ = fit_with_weights(store.model(), zoo, images, labels)
    square = sum(zoo[k].double().flatten(1).pow(2).sum(1) for k in zoo if k in parameters)
    potential = nll + 0.5 * len(labels) * store.recipe.weight_decay * square
    row = read_metrics(store.results_dir / "metrics.csv").iloc[0]
    assert row["reference_potential_median"] == pytest.approx(float(potential.median()), rel=1e-6) \
        or row["reference_potential_median"] == pytest.approx(float(torch.quantile(potential, 0.5)), rel=1e-6)
    assert row["reference_potential_p05"] == pytest.approx(float(torch.quantile(potential, 0.05)), rel=1e-6)
    assert row["reference_potential_n"] == 10
    # a second run scores nothing again: the cached numbers give the same frame
    again = run_evaluate(store)
    pd.testing.assert_frame_equal(again, frame)
    # the report: a Baselines group after the methods, never ranked
    table = table1(frame)
    assert list(table.index.get_level_values("Group")[-7:]) == ["Baselines"] * 7
    ranks = table3(frame).xs("Baselines", level="Group")
    assert set(ranks["NS rank"]) == {"n/a"}
    assert not math.isnan(rows.loc[("prior", BASELINE_MODE), "mmd_median"])
    # findings: the paper's claims see no baseline; the methods-against-baselines section sees each
    run_report(store)
    text = (store.results_dir / "findings.md").read_text()
    section = text[text.index("## Methods against baselines"):]
    assert all(BASELINES[name].label in section for name in BASELINES)
    assert "Deep Ensembles" in section
