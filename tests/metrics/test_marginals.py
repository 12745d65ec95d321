"""Layer values read in column blocks, their fixed seeded subsample, and the KS test against scipy."""
import numpy as np
import pytest
import torch
from scipy import stats

from metrics.marginals import gather, ks_test, subsample_indices


def test_gather_without_indices_returns_every_entry_of_every_block():
    weights = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # 2 samples, 3 units, 4 inputs
    assert np.array_equal(np.sort(gather([weights.reshape(2, -1)], None)), np.arange(24.0))
    blocks = [weights[:, :1], weights[:, 1:]]  # column blocks [2, 4] and [2, 8], trailing axes flattened
    assert np.array_equal(np.sort(gather(blocks, None)), np.arange(24.0))
    assert subsample_indices(2, 12, 24, seed=0) is None, "every entry fits: no subsample"


def test_a_subsample_is_the_same_entries_whatever_the_column_blocks():
    rows, columns = 7, 300
    matrix = torch.arange(rows * columns, dtype=torch.float64).reshape(rows, columns)
    indices = subsample_indices(rows, columns, 500, seed=(3, 1))
    assert len(indices) == len(np.unique(indices)) == 500 and (np.diff(indices) > 0).all()
    # column-major flat index j is row j % rows of column j // rows
    expected = matrix.T.reshape(-1).numpy()[indices]
    assert np.array_equal(gather([matrix], indices), expected)
    cuts = [0, 1, 50, 51, 299, 300]
    blocks = [matrix[:, a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    assert np.array_equal(gather(blocks, indices), expected)
    assert np.array_equal(subsample_indices(rows, columns, 500, seed=(3, 1)), indices), "fixed by the seed"
    assert not np.array_equal(subsample_indices(rows, columns, 500, seed=(3, 2)), indices)
    big = subsample_indices(1000, 10**6, 20000, seed=0)  # uniform over the 1e9 entries
    assert abs(big.mean() / 1e9 - 0.5) < 0.01 and abs(np.mean(big % 1000) / 1000 - 0.5) < 0.01


def test_gather_refuses_blocks_that_do_not_cover_the_indices():
    indices = subsample_indices(2, 10, 5, seed=0)
    with pytest.raises(ValueError, match="beyond the 8 entries of the blocks"):
        gather([torch.zeros(2, 4)], np.array([1, 3, 9]))
    with pytest.raises(ValueError, match="blocks disagree on the row count"):
        gather([torch.zeros(2, 4), torch.zeros(3, 6)], indices)


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
