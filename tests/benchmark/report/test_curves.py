"""The zoo's training curves: the stored histories, their per-epoch statistics, the figure."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from benchmark.experiment import Experiment
from benchmark.report import curves
from benchmark.stages.zoo import run_zoo
from benchmark.core.store import load_checkpoint
from tests.conftest import TINY_TRAIN, compose_config


def test_the_statistics_are_numpys_over_the_networks_that_reached_each_epoch():
    rng = np.random.default_rng(0)
    runs = [[{"epoch": e + 1, "loss": float(rng.random()), "check_accuracy": float(rng.random()),
              "train_subset_accuracy": float(rng.random())} for e in range(length)] for length in (3, 3, 2, 1)]
    failed = [[{"epoch": 1, "loss": 2.3, "check_accuracy": 0.1}]]  # stopped by the rule: no subset accuracy here
    numbers = curves.curve_numbers({"converged": runs, "failed": failed})
    for key in curves.QUANTITIES:
        for epoch in (1, 2, 3):
            values = [r[epoch - 1][key] for r in runs if len(r) >= epoch]
            row = numbers[(numbers["group"] == "converged") & (numbers["quantity"] == key) & (numbers["epoch"] == epoch)]
            assert row["networks"].item() == len(values)
            assert row["median"].item() == pytest.approx(np.median(values))
            assert (row["p10"].item(), row["p90"].item()) == pytest.approx(tuple(np.percentile(values, [10, 90])))
    failed_rows = numbers[numbers["group"] == "failed"]
    assert set(failed_rows["quantity"]) == {"loss", "check_accuracy"} and failed_rows["networks"].tolist() == [1, 1]
    assert curves.curve_numbers({"converged": [], "failed": []}).empty


@pytest.mark.slow
def test_the_zoo_stores_every_epochs_accuracies_and_the_report_draws_them(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *TINY_TRAIN,
                                     "train.epochs=3", "train.milestones=[2]", "seeds.reference=[0,6]",
                                     "seeds.heldout=[100000,100000]", "zoo.range=reference"]))
    with exp.backends():
        run_zoo(exp, exp.reference)
    store = exp.store
    assert store.completed_seeds() and store.failed_seeds(), "the tiny recipe should keep some seeds and fail others"
    for seed in store.completed_seeds():
        meta = load_checkpoint(store.checkpoint_path(seed))[1]
        history = json.loads(meta["history"])
        assert [r["epoch"] for r in history] == [1, 2, 3]
        assert history[-1]["check_accuracy"] == pytest.approx(float(meta["validation_accuracy"]))
        assert all(0 <= r["train_subset_accuracy"] <= 1 for r in history)
    for record in store.failed_seeds().values():
        assert len(record["history"]) == record["epoch"] and "check_accuracy" in record["history"][-1]
    found = curves.histories(exp)
    assert (len(found["converged"]), len(found["failed"])) == (len(store.completed_seeds()), len(store.failed_seeds()))
    written = curves.write(exp, curves.curve_numbers(found))
    assert sorted(p.name for p in written) == ["zoo_curves.csv", "zoo_curves.pdf", "zoo_curves.png"]
    numbers = pd.read_csv(exp.results_dir / "figures" / "zoo_curves.csv")
    last = numbers[(numbers["group"] == "converged") & (numbers["quantity"] == "check_accuracy") & (numbers["epoch"] == 3)]
    finals = [float(load_checkpoint(store.checkpoint_path(s))[1]["validation_accuracy"]) for s in store.completed_seeds()]
    assert last["median"].item() == pytest.approx(np.median(finals), abs=1e-6)
    (line,) = curves.summary_lines(curves.curve_numbers(found))
    assert "figures/zoo_curves.png" in line and f"validation accuracy {np.median(finals):.3g} (epoch 3" in line
