import numpy as np
import pytest
import torch

from metrics.mmd import kernel_matrix, layer_mmd, pairwise_distances, split_columns, u_statistics
from tests.metrics.mmd.brute_force import mmd_values_by_loops


@pytest.mark.parametrize("m, n, d, max_rows", [(7, 5, 4, 500), (6, 6, 3, 4), (9, 3, 1, 500)])
def test_twenty_values_equal_a_brute_force_double_loop(m, n, d, max_rows):
    rng = np.random.default_rng(m * 100 + n)
    x, y = rng.normal(size=(m, d)), rng.normal(0.7, 1.3, size=(n, d))
    expected, grids = mmd_values_by_loops(x, y, max_rows=max_rows)
    chunks = split_columns(torch.from_numpy(x), torch.from_numpy(y), max_chunk_elements=(m + n) * 2)
    result = layer_mmd(chunks, max_bandwidth_rows=max_rows)
    np.testing.assert_allclose(result.bandwidths["laplace"].numpy(), grids["laplace"], rtol=1e-12)
    np.testing.assert_allclose(result.bandwidths["gaussian"].numpy(), grids["gaussian"], rtol=1e-12)
    np.testing.assert_allclose(result.values.numpy(), expected, rtol=1e-10, atol=1e-14)


def test_small_distances_take_the_floored_bandwidth_branch_and_match_loops():
    rng = np.random.default_rng(3)
    x, y = 0.01 * rng.normal(size=(8, 3)), 0.01 * rng.normal(size=(6, 3)) + 0.02
    expected, grids = mmd_values_by_loops(x, y)
    result = layer_mmd([(torch.from_numpy(x), torch.from_numpy(y))])
    assert result.bandwidths["gaussian"][0] == pytest.approx(0.05)
    np.testing.assert_allclose(result.values.numpy(), expected, rtol=1e-10, atol=1e-14)


def test_kernels_are_symmetric_and_follow_the_documented_formulas():
    d = pairwise_distances([(torch.randn(6, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64))])
    for kernel, matrix in (("laplace", d.l1), ("gaussian", d.l2)):
        k = kernel_matrix(matrix, kernel, 0.7)
        assert torch.equal(k, k.T)
        assert torch.equal(k.diagonal(), torch.ones(11, dtype=torch.float64))
    assert float(kernel_matrix(torch.tensor([2.0]), "laplace", 4.0)) == pytest.approx(np.exp(-0.5))
    assert float(kernel_matrix(torch.tensor([2.0]), "gaussian", 4.0)) == pytest.approx(np.exp(-0.25))
    with pytest.raises(ValueError, match="unknown kernel 'cauchy'"):
        kernel_matrix(d.l1, "cauchy", 1.0)


def test_swapping_the_samples_leaves_the_values_unchanged():
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64) + 0.5
    forward = layer_mmd([(x, y)]).values
    backward = layer_mmd([(y, x)]).values
    torch.testing.assert_close(forward, backward, rtol=1e-12, atol=1e-15)


def test_u_statistics_of_hand_built_distances():
    # m = 2, n = 2 (x1, x2, y1, y2): d(x1,x2) = 1, d(y1,y2) = 2, cross distances 3, 3, 4, 4
    d = torch.tensor(
        [[0.0, 1.0, 3.0, 4.0], [1.0, 0.0, 3.0, 4.0], [3.0, 3.0, 0.0, 2.0], [4.0, 4.0, 2.0, 0.0]], dtype=torch.float64
    )
    bandwidths = torch.tensor([1.0, 2.0], dtype=torch.float64)
    for kernel, k in (("laplace", lambda t, l: np.exp(-t / l)), ("gaussian", lambda t, l: np.exp(-(t**2) / l**2))):
        expected = [k(1, l) + k(2, l) - 2 * (2 * k(3, l) + 2 * k(4, l)) / 4 for l in (1.0, 2.0)]
        assert u_statistics(d, 2, kernel, bandwidths).tolist() == pytest.approx(expected, rel=1e-14)
    with pytest.raises(ValueError, match="unknown kernel 'imq'"):
        u_statistics(d, 2, "imq", bandwidths)


def test_same_distribution_is_near_zero_and_shifted_is_clearly_positive():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=gen, dtype=torch.float64)
    same = layer_mmd([(x, torch.randn(100, 8, generator=gen, dtype=torch.float64))]).values
    shifted = layer_mmd([(x, torch.randn(100, 8, generator=gen, dtype=torch.float64) + 1.0)]).values
    assert same.abs().max() < 0.005
    assert torch.quantile(shifted, 0.5) > 0.05 and shifted.max() > 0.2
    # The narrowest kernels see almost no pair, so their values are small in both cases.
    assert (shifted > 10 * same.abs()).all()


def test_identical_samples_give_zero_without_dividing_by_zero():
    row = torch.tensor([0.1, -2.0, 3.5])
    x, y = row.repeat(5, 1), row.repeat(3, 1)
    result = layer_mmd([(x, y)])
    assert torch.isfinite(result.bandwidths["laplace"]).all() and result.bandwidths["laplace"][0] == pytest.approx(0.05)
    assert torch.count_nonzero(result.values) == 0
