"""``reference=hmc``: every row scored against HMC's pooled draws with the zoo's machinery (numbers
checked against metrics.mmd and metrics.predictive called directly), HMC's own repetitions against
the others only, the zoo's row from blocks of reference checkpoints, all in the one metrics.csv
(``reference`` column: ``hmc``) with an older run's metrics_hmc.csv removed by verify's migration; the report's
table_hmc.md and the HMC claims of findings.md; refusals that name the command."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from benchmark.core.models import predict_with_weights
from benchmark.core.store import load_checkpoints_as_sample_set
from benchmark.experiment import Experiment
from benchmark.inventory import MissingInputsError
from benchmark.references.hmc import HMCReference
from benchmark.results import read_metrics, read_repetitions, rows_against, write_metrics
from benchmark.config import Repair
from benchmark.stages import evaluate, report, verify
from metrics.mcmc import predictive_convergence
from metrics.mmd import mmd
from metrics.predictive import predictive_metrics
from tests.benchmark.hmc_store import OVERRIDES, draws_near, fill, write_unit
from tests.conftest import compose_config
from tests.benchmark.units import write_initial_checkpoints

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return fill(tmp_path_factory.mktemp("hmc_eval"))


def _pool(units, repetitions):
    parts = [units[("hmc", r)] for r in repetitions]
    weights = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
    predictive = torch.cat([p[1]["id"] for p in parts]).double().mean(0)
    return weights, predictive


def test_rows_against_hmc_match_the_metrics_called_directly(store):
    exp, units = store
    exp.results_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics_hmc.csv", "repetitions_hmc.csv"):  # an older run's files: removed by verify's migration
        (exp.results_dir / stale).write_text("method,mode\nswag,one\n")
    users = ("metrics_zoo.csv", "metrics_other_zoo.csv", "repetitions_zoo.csv")  # no version wrote these: kept
    for name in users:
        (exp.results_dir / name).write_text("a user's file\n")
    health = verify.ExperimentHealth(exp.name, "this test")
    verify.migrate(None, exp.store, exp.results_dir, health, Repair.corrupt)  # results/ only: the units are the test's
    assert sorted(m.path.name for m, action in health.migrations if action == "migrated") == ["metrics_hmc.csv",
                                                                                               "repetitions_hmc.csv"]
    evaluate.run(exp)
    assert not (exp.results_dir / "metrics_hmc.csv").exists() and not (exp.results_dir / "repetitions_hmc.csv").exists()
    assert all((exp.results_dir / name).read_text() == "a user's file\n" for name in users)
    every = read_metrics(exp.results_dir / "metrics.csv")
    assert sorted(set(every["reference"])) == ["hmc", "zoo"]
    reps = rows_against(read_repetitions(exp.results_dir / "repetitions.csv"), "hmc").set_index(["method", "mode", "repetition"])
    frame = rows_against(every, "hmc").set_index(["method", "mode"])
    pool, predictive = _pool(units, [0, 1])
    labels, model = exp.test_tensors[1], exp.model()
    for method, mode in (("ensemble", "multi"), ("swag", "one")):
        for r in range(2):
            samples, preds = units[(method, r)]
            assert reps.loc[(method, mode, r), "mmd_median"] == pytest.approx(mmd(pool, samples).aggregate["median"], rel=1e-6)
            expected = predictive_metrics(preds["id"], labels, preds["ood"], reference_id=predictive)
            assert reps.loc[(method, mode, r), "agreement"] == pytest.approx(expected["agreement"], abs=1e-9)
            assert reps.loc[(method, mode, r), "tv"] == pytest.approx(expected["tv"], rel=1e-6)
        assert frame.loc[(method, mode), "n_reference"] == 8
    for r in range(2):  # an HMC repetition is scored against the other repetition's chains only
        others, others_predictive = _pool(units, [1 - r])
        samples, preds = units[("hmc", r)]
        assert reps.loc[("hmc", "multi", r), "mmd_median"] == pytest.approx(mmd(others, samples).aggregate["median"], rel=1e-6)
        expected = predictive_metrics(preds["id"], labels, preds["ood"], reference_id=others_predictive)
        assert reps.loc[("hmc", "multi", r), "tv"] == pytest.approx(expected["tv"], rel=1e-6)
    assert frame.loc[("hmc", "multi"), "n_reference"] == 4
    for r in range(2):  # the zoo's row: block r of 4 reference checkpoints in seed order
        block = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(4 * r, 4 * r + 4)))
        assert reps.loc[("zoo", "multi", r), "mmd_median"] == pytest.approx(mmd(pool, block).aggregate["median"], rel=1e-6)
        assert reps.loc[("zoo", "multi", r), "base_seeds"] == " ".join(map(str, range(4 * r, 4 * r + 4)))
        probs = predict_with_weights(model, block, exp.test_tensors[0])
        expected = predictive_metrics(probs, labels, predict_with_weights(model, block, exp.ood_tensors[0]),
                                      reference_id=predictive)
        assert reps.loc[("zoo", "multi", r), "agreement"] == pytest.approx(expected["agreement"], abs=1e-9)
    assert frame.loc[("zoo", "multi"), "method_label"] == "Zoo (reference)"
    zoo_frame = rows_against(every, "zoo").set_index(["method", "mode"])
    assert "zoo" not in zoo_frame.index.get_level_values(0) and zoo_frame.loc[("hmc", "multi"), "n_reference"] == 12


def test_the_pooled_convergence_is_arviz_on_the_chains(store):
    exp, units = store
    probs = torch.cat([units[("hmc", r)][1]["id"].reshape(2, 2, *units[("hmc", r)][1]["id"].shape[1:]) for r in range(2)])
    got = HMCReference(exp).convergence()
    expected = predictive_convergence(probs, exp.test_tensors[1])
    assert got["chains"] == 4 and got["draws_per_chain"] == 2
    assert got["rhat_loglik"] == pytest.approx(expected["rhat_loglik"], nan_ok=True)
    assert got["rhat_softmax_median"] == pytest.approx(expected["rhat_softmax_median"], nan_ok=True)


def test_report_writes_table_hmc_and_the_hmc_claims(store):
    exp, _ = store
    evaluate.run(exp)
    report.run(exp)
    text = (exp.results_dir / "table_hmc.md").read_text()
    assert "Zoo (reference)" in text and " ref. |" in text and "Chain group" in text
    assert "R-hat log-lik. within a start" in text and "across starts (spread between modes)" in text
    first = text.split(". ")[0]  # the reference's convergence comes first (2 draws per chain here: no R-hat)
    assert first == "Table HMC: The HMC reference's convergence within its starts was not measured (no R-hat of the test log-likelihood within a start)", first
    table = pd.read_csv(exp.results_dir / "table_hmc.csv")
    zoo_row = table[table["Method"] == "Zoo (reference)"].iloc[0]
    hmc = rows_against(read_metrics(exp.results_dir / "metrics.csv"), "hmc").set_index(["method", "mode"])
    assert float(zoo_row["MMD to HMC"]) == pytest.approx(round(100 * hmc.loc[("zoo", "multi"), "mmd_median"], 1))
    assert zoo_row["MMD to zoo"] == "ref."
    # ranks among the approximate methods only (swag, ensemble): the references are not ranked
    ranked = table[table["MMD rank zoo / HMC"].notna()]
    assert sorted(ranked["Method"]) == ["Deep Ensembles", "SWAG"]
    findings = (exp.results_dir / "findings.md").read_text()
    assert "Against full-batch HMC" in findings and "the zoo is closer to HMC than every one-mode method" in findings
    assert "Kendall's tau" in findings
    assert "HMC (multi)" not in findings.split("## Against full-batch HMC")[0]  # HMC is not in the paper's claims


def test_reference_hmc_without_hmc_draws_is_refused_with_the_command(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path / 's'}", f"results={tmp_path / 'r'}", "reference=hmc", *OVERRIDES]))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, range(12))
    write_unit(exp, "swag", "one", 0, draws_near(1, 4, exp), [100000])
    with pytest.raises(MissingInputsError, match="method=hmc mode=multi"):
        evaluate.check(exp)
    write_metrics([{"experiment": exp.name, "method": "swag", "mode": "one", "reference": "zoo", "status": "ok"}],
                  exp.results_dir / "metrics.csv")  # against the zoo only
    with pytest.raises(MissingInputsError, match="metrics.csv with reference=hmc.*stage=evaluate experiment=digits_optunet "
                                                 "reference=hmc"):
        report.check(exp, frozenset())
