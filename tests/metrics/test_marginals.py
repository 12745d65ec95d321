"""Layer and unit marginals of a sample set, and the KS test against scipy on the same values."""
import numpy as np
import pytest
import torch
from scipy import stats

from metrics.marginals import ks_test, layer_values, unit_values


def test_layer_and_unit_values_pool_the_right_entries():
    weights = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # 2 samples, 3 units, 4 inputs
    sample_set = {"fc.weight": weights}
    assert np.array_equal(layer_values(sample_set, "fc.weight"), np.arange(24.0))
    assert np.array_equal(unit_values(sample_set, "fc.weight", 1), np.array([4, 5, 6, 7, 16, 17, 18, 19], dtype=float))


def test_ks_test_is_scipys_two_sample_test():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=300), rng.normal(0.3, 1.0, size=200)
    result = ks_test(x, y)
    expected = stats.ks_2samp(x, y)
    assert (result.statistic, result.pvalue) == (pytest.approx(expected.statistic), pytest.approx(expected.pvalue))
    assert (result.n_x, result.n_y) == (300, 200)
    same = ks_test(x, x)
    assert same.statistic == 0.0 and same.pvalue == pytest.approx(1.0)


def test_empty_samples_are_refused():
    with pytest.raises(ValueError, match="both samples need values, got 0 and 3"):
        ks_test(np.array([]), np.ones(3))
