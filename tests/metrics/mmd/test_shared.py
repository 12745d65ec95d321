"""MMD with one bandwidth grid per layer shared by every method: the grid from the reference alone
(MMDAgg's rule on reference-vs-reference distances, by hand), the statistic with it against
brute-force loops, the same grid whatever the method's samples, and the data-driven numbers unchanged."""
import numpy as np
import pandas as pd
import pytest
import torch

from metrics.mmd import MMDInputError, ReferenceResampling, layer_mmd, mmd, reference_bandwidths
from tests.metrics.mmd.brute_force import bandwidths_by_hand, distance, u_statistic_by_loops
from tests.metrics.mmd.test_table import _sample_sets


def _double(sample_set):
    return {k: v.double() for k, v in sample_set.items()}


def _flat_fc(sample_set):
    """The fc layer (weight then bias) flattened per sample, as MMD reads it ``[S, 9]``."""
    return torch.cat([sample_set["fc.weight"].reshape(len(sample_set["fc.bias"]), -1), sample_set["fc.bias"]], 1).numpy()


@pytest.mark.parametrize("rows", [500, 4])
def test_grid_is_mmdaggs_rule_on_two_halves_of_the_reference(rows):
    x, _ = _sample_sets(m=13, n=7)
    x = _double(x)
    grids = reference_bandwidths(x, max_bandwidth_rows=rows, max_chunk_elements=26)  # several blocks per layer
    assert list(grids) == ["conv1", "bn1", "fc"]  # buffers are not a layer
    h = min(rows, 13 // 2)
    flat = _flat_fc(x)
    for kernel, kind in (("laplace", "l1"), ("gaussian", "l2")):
        cross = [distance(a, b, kind) for a in flat[:h] for b in flat[h : 2 * h]]
        assert grids["fc"][kernel].dtype == torch.float64
        np.testing.assert_allclose(grids["fc"][kernel].numpy(), bandwidths_by_hand(cross), rtol=1e-12)


@pytest.mark.parametrize("m", [2, 3])
def test_a_reference_of_two_or_three_gives_the_grid_of_its_one_distance(m):
    x = _double(_sample_sets(m=m, n=2)[0])
    grids = reference_bandwidths(x, max_chunk_elements=m * 2)
    flat = _flat_fc(x)
    for kernel, kind in (("laplace", "l1"), ("gaussian", "l2")):
        expected = bandwidths_by_hand([distance(flat[0], flat[1], kind)])
        np.testing.assert_allclose(grids["fc"][kernel].numpy(), expected, rtol=1e-12)


def test_statistic_with_the_shared_grid_equals_brute_force_and_the_grid_does_not_depend_on_the_method():
    x, y1 = _sample_sets(m=12, n=7, seed=0)
    _, y2 = _sample_sets(m=12, n=9, seed=1)
    x, y1 = _double(x), _double(y1)
    y2 = {k: 3.0 * v.double() for k, v in y2.items()}  # a much broader method
    grids = reference_bandwidths(x)
    first, second = mmd(x, y1, shared_bandwidths=grids), mmd(x, y2, shared_bandwidths=grids)
    for a, b in zip(first.shared.layers, second.shared.layers):
        for kernel in ("laplace", "gaussian"):
            assert torch.equal(a.bandwidths[kernel], grids[a.layer][kernel])
            assert torch.equal(a.bandwidths[kernel], b.bandwidths[kernel])
    # the data-driven grids differ between the two methods: what the shared grid removes
    assert not torch.equal(first.layers[2].bandwidths["laplace"], second.layers[2].bandwidths["laplace"])
    for result, y in ((first, y1), (second, y2)):
        expected = [u_statistic_by_loops(_flat_fc(x), _flat_fc(y), kernel, bw)
                    for kernel in ("laplace", "gaussian") for bw in grids["fc"][kernel].tolist()]
        np.testing.assert_allclose(result.shared.layers[2].values.numpy(), expected, rtol=1e-10, atol=1e-14)
        weights = result.shared.per_layer["n_params"] / result.shared.per_layer["n_params"].sum()
        assert result.shared.aggregate["median"] == pytest.approx(float((weights * result.shared.per_layer["median"]).sum()))
    assert first.shared.shared is None and np.isnan(first.shared.reject_fraction)


def test_shared_grid_leaves_the_data_driven_result_unchanged():
    x, y = _sample_sets(m=16, n=7)
    resampling = ReferenceResampling(count=3, seed=2)
    plain = mmd(x, y, resampling=resampling)
    both = mmd(x, y, resampling=resampling, shared_bandwidths=reference_bandwidths(x))
    pd.testing.assert_frame_equal(plain.per_kernel, both.per_kernel, check_exact=True)
    assert plain.aggregate == both.aggregate and plain.shared is None
    for name in ("median", "mean", "max"):
        assert torch.equal(plain.resampled[name], both.resampled[name])


def test_reference_halves_keep_the_shared_grid():
    x, y = _sample_sets(m=16, n=7)
    x, y = _double(x), _double(y)
    grids = reference_bandwidths(x)
    resampling = ReferenceResampling(count=3, seed=5)
    result = mmd(x, y, resampling=resampling, shared_bandwidths=grids)
    for b, rows in enumerate(resampling.halves(16)):
        direct = mmd({k: v[rows] for k, v in x.items()}, y, shared_bandwidths=grids).shared
        assert float(result.shared.resampled["median"][b]) == pytest.approx(direct.aggregate["median"], rel=1e-10)


def test_fixed_bandwidths_of_one_layer():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 4, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen, dtype=torch.float64)
    grid = {"laplace": torch.tensor([0.5, 2.0]), "gaussian": torch.tensor([1.0])}
    result = layer_mmd([(x, y)], bandwidths=grid)
    expected = [u_statistic_by_loops(x.numpy(), y.numpy(), "laplace", bw) for bw in (0.5, 2.0)]
    expected.append(u_statistic_by_loops(x.numpy(), y.numpy(), "gaussian", 1.0))
    np.testing.assert_allclose(result.values.numpy(), expected, rtol=1e-12)
    with pytest.raises(MMDInputError, match="layer 'layer': fixed bandwidths lack the kernel"):
        layer_mmd([(x, y)], bandwidths={"laplace": torch.ones(3)})
    with pytest.raises(MMDInputError, match="fixed gaussian bandwidths must be finite and > 0"):
        layer_mmd([(x, y)], bandwidths={"laplace": torch.ones(3), "gaussian": torch.tensor([1.0, 0.0])})


def test_bad_inputs_name_the_layer():
    x, y = _sample_sets(m=12, n=7)
    grids = reference_bandwidths(x)
    with pytest.raises(MMDInputError, match=r"no grid for layer\(s\) \['bn1'\]"):
        mmd(x, y, shared_bandwidths={k: v for k, v in grids.items() if k != "bn1"})
    with pytest.raises(MMDInputError, match="layer 'conv1'.*1 sample\\(s\\) in X; need at least 2"):
        reference_bandwidths({k: v[:1] for k, v in x.items()})
    with pytest.raises(ValueError, match="max_bandwidth_rows must be >= 2"):
        reference_bandwidths(x, max_bandwidth_rows=1)


def test_half_sample_statistics_with_fixed_bandwidths_equal_loops_and_the_subset_path():
    """The fixed-grid shortcut (one kernel matrix per bandwidth for every half) against plain loops
    on each half and against recomputing each half from its own distance matrix."""
    from metrics.mmd import half_sample_u_statistics, pairwise_distances, u_statistics

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(10, 5, generator=gen, dtype=torch.float64)
    y = 0.5 + 1.3 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    distances = pairwise_distances([(x, y)])
    halves = ReferenceResampling(count=4, seed=2).halves(10)
    grid = {"laplace": torch.tensor([0.7, 3.0]), "gaussian": torch.tensor([0.9, 4.0])}
    for kernel, kind in (("laplace", "l1"), ("gaussian", "l2")):
        fast = half_sample_u_statistics(getattr(distances, kind), 10, kernel, grid[kernel], halves)
        assert fast.shape == (4, 2) and fast.dtype == torch.float64
        for b, rows in enumerate(halves):
            loops = [u_statistic_by_loops(x[rows].numpy(), y.numpy(), kernel, bw) for bw in grid[kernel].tolist()]
            np.testing.assert_allclose(fast[b].numpy(), loops, rtol=1e-7, atol=1e-9)  # L2 via the Gram matrix
            subset = distances.subset_x(rows)
            np.testing.assert_allclose(fast[b].numpy(), u_statistics(getattr(subset, kind), 5, kernel, grid[kernel]).numpy(),
                                       rtol=1e-12)
    with pytest.raises(ValueError, match="unknown kernel 'cosine'"):
        half_sample_u_statistics(distances.l1, 10, "cosine", grid["laplace"], halves)
