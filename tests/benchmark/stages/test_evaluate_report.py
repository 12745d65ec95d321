import dataclasses
import math

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from benchmark.experiment import Experiment
from benchmark.models import predict_with_weights
from benchmark.results import COLUMNS
from benchmark.stages.evaluate import run as run_evaluate
from benchmark.stages.report import run as run_report
from benchmark.store import StoreError, load_checkpoints_as_sample_set, save_checkpoint, save_sample_set
from benchmark.training import seeded
from metrics.mmd import mmd
from metrics.predictive import predictive_metrics
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A zoo of seeded initialisations (reference seeds 0-7), an 'ensemble' of held-out seeds,
    and a 'dropout' row with broken predictions. Evaluation does not care whether the networks
    were trained, and untrained ones keep this fixture fast."""
    root = tmp_path_factory.mktemp("eval")
    cfg = compose_config([f"store={root / 'store'}", f"results={root / 'results'}", "seeds.reference=[0,8]",
                          "seeds.heldout=[100000,100006]"])
    exp = Experiment(cfg)
    store = exp.store
    store.ensure_writable()
    for seed in [*range(8), *range(100000, 100006)]:
        with seeded(seed):
            state = exp.model().state_dict()
        save_checkpoint(store.checkpoint_path(seed), state, {"seed": seed, "experiment": exp.name, "test_accuracy": 0.1})
    members = [s for s in store.completed_seeds() if s >= 100000]
    ensemble = load_checkpoints_as_sample_set(store.checkpoint_paths(members))
    meta = {"experiment": exp.name, "method": "ensemble", "mode": "multi"}
    save_sample_set(store.samples_path("ensemble", "multi"), ensemble, meta)
    model = exp.model()
    preds = {"id": predict_with_weights(model, ensemble, exp.test_tensors[0]),
             "ood": predict_with_weights(model, ensemble, exp.ood_tensors[0])}
    save_sample_set(store.preds_path("ensemble", "multi"), preds, meta)
    bad = {k: v.clone() for k, v in preds.items()}
    save_sample_set(store.samples_path("dropout", "one"), ensemble, {**meta, "method": "dropout", "mode": "one"})
    # The store refuses to write NaN; a predictions file damaged by another tool is written
    # directly with safetensors.
    bad["id"][0, 5] = float("nan")
    save_file(bad, str(store.preds_path("dropout", "one")), metadata={**meta, "method": "dropout", "mode": "one"})
    return exp, ensemble, preds, members


def test_metrics_csv_matches_independent_computation(filled):
    exp, ensemble, preds, members = filled
    df = run_evaluate(exp)
    assert list(df.columns) == COLUMNS
    row = df.set_index(["method", "mode"]).loc[("ensemble", "multi")]
    assert row.status == "ok" and row.n_samples == len(members)
    ref = load_checkpoints_as_sample_set(exp.store.checkpoint_paths([s for s in exp.store.completed_seeds() if s < 8]))
    expected = mmd(ref, ensemble).aggregate
    assert row.mmd_median == pytest.approx(expected["median"], rel=1e-6, abs=1e-12)
    assert row.mmd_max == pytest.approx(expected["max"], rel=1e-6, abs=1e-12)
    ref_pred = predict_with_weights(exp.model(), ref, exp.test_tensors[0]).double().mean(0)
    m = predictive_metrics(preds["id"], exp.test_tensors[1], preds["ood"], reference_id=ref_pred)
    for key in ("acc", "ece", "brier", "aupr", "fpr95", "id_mi", "ood_mi", "agreement", "tv"):
        assert row[key] == pytest.approx(m[key], rel=1e-6, abs=1e-9), key
    assert not math.isnan(row.ns_mmd_median)
    failed = df.set_index(["method", "mode"]).loc[("dropout", "one")]
    assert failed.status == "failed" and "probs_id" in failed.reason and "NaN" in failed.reason
    on_disk = pd.read_csv(exp.results_dir / "metrics.csv")
    assert len(on_disk) == 2


def test_second_run_reuses_cached_rows_and_gives_identical_tables(filled):
    exp = filled[0]
    first = run_evaluate(exp)
    tables = run_report(exp)
    contents = {p: p.read_text() for p in tables}
    second = run_evaluate(exp)
    pd.testing.assert_frame_equal(first, second)
    run_report(exp)
    assert {p: p.read_text() for p in tables} == contents
    names = sorted(p.name for p in tables)
    assert names == ["table1.csv", "table1.md", "table1.tex", "table2.csv", "table2.md", "table2.tex", "zoo.md"]
    assert "Deep Ensembles" in (tables[0].parent / "table1.md").read_text()


def test_evaluate_refuses_an_empty_store_and_foreign_samples(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path / 's'}", f"results={tmp_path / 'r'}"]))
    exp.store.ensure_writable()
    with pytest.raises(StoreError, match="nothing to evaluate for digits_optunet.*0 zoo checkpoints"):
        run_evaluate(exp)


def test_foreign_experiment_samples_are_refused(filled, tmp_path):
    exp = filled[0]
    store = exp.store
    path = store.samples_path("swag", "one")
    save_sample_set(path, {k: v[:2] for k, v in filled[1].items()}, {"experiment": "mnist_optunet"})
    save_sample_set(store.preds_path("swag", "one"), {k: v[:2] for k, v in filled[2].items()}, {"experiment": "mnist_optunet"})
    try:
        with pytest.raises(StoreError, match="experiment 'mnist_optunet', expected 'digits_optunet'.*the store holds"):
            run_evaluate(exp)
    finally:
        path.unlink()
        store.preds_path("swag", "one").unlink()


def test_report_without_metrics_names_the_command(tmp_path):
    exp = Experiment(compose_config([f"results={tmp_path}"]))
    with pytest.raises(FileNotFoundError, match="stage=evaluate experiment=digits_optunet"):
        run_report(exp)


def test_streamed_reference_gives_the_in_memory_numbers(filled, tmp_path):
    """A memory limit below the zoo's size switches to the store-streamed path; same figures."""
    exp = filled[0]
    in_memory = run_evaluate(exp)
    streamed_cfg = dataclasses.replace(exp.config, evaluate=dataclasses.replace(exp.config.evaluate, max_in_memory_gb=1e-6),
                                       results=str(tmp_path / "results"))
    for cached in (exp.store.base / "eval").glob("*.json"):
        cached.unlink()
    streamed = run_evaluate(Experiment(streamed_cfg))
    cols = ["mmd_median", "mmd_mean", "mmd_max", "ns_mmd_median", "ns_mmd_mean", "ns_mmd_max", "acc", "agreement", "tv"]
    pd.testing.assert_frame_equal(in_memory[cols], streamed[cols], rtol=1e-6, atol=1e-10)
