import numpy as np
import pytest
import torch
from scipy.spatial.distance import cdist

from metrics.mmd import DistanceAccumulator, MMDInputError, pairwise_distances, split_columns
from metrics.mmd.l1_kernel import accumulate_l1_upper
from metrics.mmd.sources import zip_column_blocks
from tests.metrics.mmd.brute_force import distance


def _uneven_blocks(x, y, widths):
    start = 0
    for w in widths:
        yield x[:, start : start + w], y[:, start : start + w]
        start += w
    assert start == x.shape[1]


def test_matches_scipy_cdist_over_uneven_column_blocks():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(23, 37)), rng.normal(1.0, 2.0, size=(9, 37))
    d = pairwise_distances(_uneven_blocks(torch.from_numpy(x), torch.from_numpy(y), [1, 10, 3, 23]))
    z = np.concatenate([x, y])
    assert (d.m, d.n, d.n_params) == (23, 9, 37)
    np.testing.assert_allclose(d.l1.numpy(), cdist(z, z, "cityblock"), rtol=1e-13, atol=1e-12)
    np.testing.assert_allclose(d.l2.numpy(), cdist(z, z, "euclidean"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 9])
def test_l1_kernel_matches_pair_loops_for_any_row_count(rows):
    rng = np.random.default_rng(rows)
    z = rng.normal(size=(rows, 1030))  # more than one internal column block
    upper = torch.zeros(rows, rows, dtype=torch.float64)
    accumulate_l1_upper(torch.from_numpy(z), upper)
    for i in range(rows):
        for j in range(i + 1, rows):
            assert float(upper[i, j]) == pytest.approx(distance(z[i], z[j], "l1"), rel=1e-12)


def test_l1_kernel_rejects_wrong_dtype_and_shape():
    with pytest.raises(TypeError, match="float64"):
        accumulate_l1_upper(torch.zeros(3, 2), torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"contiguous \[3, 3\]"):
        accumulate_l1_upper(torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64))


def test_gram_trick_is_accurate_far_from_the_origin():
    # Weights near 1e4 with spread 1e-3: without centring, |z|^2 ~ 1e9 would swamp distances ~ 1e-3.
    rng = np.random.default_rng(1)
    z = 1e4 + 1e-3 * rng.normal(size=(12, 50))
    d = pairwise_distances(split_columns(torch.from_numpy(z[:8]), torch.from_numpy(z[8:]), max_chunk_elements=12 * 7))
    np.testing.assert_allclose(d.l2.numpy(), cdist(z, z, "euclidean"), rtol=1e-9, atol=1e-14)


def test_identical_samples_give_exact_zero_distances():
    x = torch.full((4, 6), 0.3, dtype=torch.float32)
    d = pairwise_distances([(x, x[:3])])
    assert torch.count_nonzero(d.l1) == 0 and torch.count_nonzero(d.l2) == 0


def test_matrices_are_symmetric_with_zero_diagonal():
    x, y = torch.randn(10, 20), torch.randn(6, 20)
    d = pairwise_distances(split_columns(x, y, max_chunk_elements=16 * 3))
    for matrix in (d.l1, d.l2):
        assert torch.equal(matrix, matrix.T)
        assert torch.count_nonzero(matrix.diagonal()) == 0
        assert (matrix >= 0).all()


def test_cross_block_takes_first_rows_of_each_side():
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    d = pairwise_distances([(x, y)])
    expected = torch.cdist(x[:4], y[:4], p=1).reshape(-1)
    torch.testing.assert_close(d.cross("l1", 4), expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("side", ["X", "Y"])
def test_non_finite_values_name_the_layer_and_side(bad, side):
    x, y = torch.zeros(3, 4), torch.ones(3, 4)
    (x if side == "X" else y)[1, 2] = bad
    with pytest.raises(MMDInputError, match=f"layer 'fc9': {side}.*NaN or Inf"):
        pairwise_distances([(x, y)], layer="fc9")


def test_block_errors():
    acc = DistanceAccumulator(layer="conv")
    with pytest.raises(MMDInputError, match="layer 'conv': X block has 3 columns but Y block has 2"):
        acc.add(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(MMDInputError, match="2-D"):
        acc.add(torch.zeros(4, 3, 1), torch.zeros(4, 3, 1))
    acc.add(torch.zeros(4, 3), torch.zeros(5, 3))
    with pytest.raises(MMDInputError, match="earlier blocks had 4 and 5"):
        acc.add(torch.zeros(3, 3), torch.zeros(5, 3))
    with pytest.raises(MMDInputError, match="no column blocks"):
        DistanceAccumulator(layer="conv").finish()
    with pytest.raises(MMDInputError, match="Y has 1 sample"):
        DistanceAccumulator(layer="conv").add(torch.zeros(4, 3), torch.zeros(1, 3))


def test_zip_column_blocks_realigns_different_widths():
    x, y = torch.randn(5, 17), torch.randn(3, 17)
    xs = [x[:, :4], x[:, 4:4], x[:, 4:11], x[:, 11:]]
    ys = [y[:, :6], y[:, 6:17]]
    pairs = list(zip_column_blocks(xs, ys))
    assert [p[0].shape[1] for p in pairs] == [4, 2, 5, 6]
    assert all(a.shape[1] == b.shape[1] for a, b in pairs)
    assert torch.equal(torch.cat([a for a, _ in pairs], 1), x)
    assert torch.equal(torch.cat([b for _, b in pairs], 1), y)


def test_zip_column_blocks_rejects_different_totals():
    with pytest.raises(MMDInputError, match="layer 'fc1': X and Y have different numbers of columns"):
        list(zip_column_blocks([torch.zeros(2, 5)], [torch.zeros(2, 4)], layer="fc1"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x, y = torch.randn(40, 300), torch.randn(20, 300) + 0.1
    cpu = pairwise_distances(split_columns(x, y, max_chunk_elements=60 * 70))
    gpu = pairwise_distances(split_columns(x, y, max_chunk_elements=60 * 70), device="cuda")
    torch.testing.assert_close(gpu.l1.cpu(), cpu.l1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gpu.l2.cpu(), cpu.l2, rtol=1e-10, atol=1e-12)
