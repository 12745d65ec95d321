"""One definition per measured column: what the results, tables and findings derive from it."""
from __future__ import annotations

import numpy as np
import pytest

from metrics.columns import COLUMNS, baseline_directions, column, keys, table1_columns
from metrics.predictive import METRIC_KEYS, predictive_metrics


def test_table1_is_the_papers_columns_then_ours_in_order():
    assert [c.label for c in table1_columns()] == [
        "MMD", "NS MMD", "Energy", "NS Energy", "Acc", "ECE", "Brier", "AUPR", "FPR95", "ID MI", "OOD MI", "Agree", "TV"]
    assert len({c.table1 for c in table1_columns()}) == len(table1_columns())


def test_the_predictive_columns_are_what_predictive_metrics_returns():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=(4, 20))
    result = predictive_metrics(probs, rng.integers(0, 3, 20), rng.dirichlet(np.ones(3), size=(4, 10)), probs.mean(0))
    assert tuple(result) == METRIC_KEYS == keys("predictive")


def test_directions_and_lookups():
    assert [k for k, lower in baseline_directions().items() if not lower] == ["acc", "aupr"]
    assert column("agreement").better == "higher" and column("tv").lower and column("fpr95").lower
    with pytest.raises(ValueError, match="'id_mi' has no better direction"):
        column("id_mi").lower
    with pytest.raises(KeyError, match="no measured column 'accuracy'"):
        column("accuracy")
    assert len({c.key for c in COLUMNS}) == len({c.label for c in COLUMNS}) == len(COLUMNS)
