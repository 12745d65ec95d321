import numpy as np
import pandas as pd
import pytest
import torch

from metrics.mmd import InMemorySource, MMDInputError, ReferenceResampling, layer_mmd, mmd
from tests.metrics.mmd.brute_force import mmd_values_by_loops


def _sample_sets(m=12, n=7, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(count, shift):
        return {
            "conv1.weight": torch.randn(count, 2, 1, 2, 2, generator=gen) + shift,
            "bn1.weight": torch.rand(count, 2, generator=gen) + 0.5,
            "bn1.bias": torch.randn(count, 2, generator=gen),
            "bn1.running_mean": torch.randn(count, 2, generator=gen),
            "bn1.num_batches_tracked": torch.zeros(count, dtype=torch.int64),
            "fc.weight": torch.randn(count, 3, 2, generator=gen),
            "fc.bias": torch.randn(count, 3, generator=gen) * (1 + shift),
        }

    return draw(m, 0.0), draw(n, 0.4)


def test_tables_layout_summaries_and_weighted_aggregate():
    x, y = _sample_sets()
    result = mmd(x, y)
    assert list(result.per_kernel.columns) == ["layer", "n_params", "kernel", "bandwidth_index", "bandwidth", "mmd"]
    assert list(result.per_layer.columns) == ["layer", "n_params", "median", "mean", "max", "energy"]
    assert result.per_layer["layer"].tolist() == ["conv1", "bn1", "fc"]
    assert result.per_layer["n_params"].tolist() == [8, 4, 9]
    assert len(result.per_kernel) == 60
    assert (result.per_kernel.groupby("layer")["kernel"].value_counts() == 10).all()
    for _, row in result.per_layer.iterrows():
        values = result.per_kernel.loc[result.per_kernel["layer"] == row["layer"], "mmd"].to_numpy()
        assert row["median"] == pytest.approx(np.median(values), rel=1e-14)
        assert row["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert row["max"] == values.max()
    for name in ("median", "mean", "max"):
        by_hand = sum(r["n_params"] * r[name] for _, r in result.per_layer.iterrows()) / 21
        assert result.aggregate[name] == pytest.approx(by_hand, rel=1e-12)


def test_layer_values_match_brute_force_on_the_concatenated_weight_and_bias():
    x, y = _sample_sets()
    x64 = {k: v.double() for k, v in x.items()}
    y64 = {k: v.double() for k, v in y.items()}
    result = mmd(x64, y64, max_chunk_elements=19 * 3)  # several chunks per layer
    flat_x = torch.cat([x64["fc.weight"].reshape(12, -1), x64["fc.bias"]], 1).numpy()
    flat_y = torch.cat([y64["fc.weight"].reshape(7, -1), y64["fc.bias"]], 1).numpy()
    expected, _ = mmd_values_by_loops(flat_x, flat_y)
    got = result.per_kernel.loc[result.per_kernel["layer"] == "fc", "mmd"].to_numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_name_the_layer(bad):
    x, y = _sample_sets()
    y["fc.bias"][3, 1] = bad
    with pytest.raises(MMDInputError, match="layer 'fc': Y"):
        mmd(x, y)


def test_bad_sample_sets_are_rejected():
    x, y = _sample_sets()
    with pytest.raises(MMDInputError, match="layer 'conv1': key 'conv1.weight'"):
        mmd(x, {**y, "conv1.weight": torch.zeros(7, 2, 1, 3, 3)})
    with pytest.raises(MMDInputError, match="layer 'conv1'.*1 sample\\(s\\) in Y"):
        mmd(x, {k: v[:1] for k, v in y.items()})
    with pytest.raises(MMDInputError, match="layer 'head' exists only in the method Y"):
        mmd(x, {**y, "head.weight": torch.zeros(7, 2)})
    with pytest.raises(MMDInputError, match="no layers"):
        mmd({"bn.running_var": torch.ones(3, 2)}, {"bn.running_var": torch.ones(3, 2)})
    with pytest.raises(ValueError, match="max_bandwidth_rows"):
        mmd(x, y, max_bandwidth_rows=0)


def test_a_column_source_gives_the_numbers_of_its_sample_set():
    x, y = _sample_sets()

    class Narrow(InMemorySource):  # any object with shapes() and columns() is a source
        def columns(self, key, max_columns):
            return super().columns(key, 1)

    by_dicts, by_sources = mmd(x, y), mmd(Narrow(x), InMemorySource(y))
    pd.testing.assert_frame_equal(by_sources.per_kernel, by_dicts.per_kernel, rtol=1e-12)
    with pytest.raises(MMDInputError, match="expected a sample set"):
        mmd([1, 2], y)


def test_bandwidth_rows_limit_changes_only_the_bandwidths():
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 4, generator=gen, dtype=torch.float64), torch.randn(20, 4, generator=gen, dtype=torch.float64)
    full = layer_mmd([(x, y)])
    few = layer_mmd([(x, y)], max_bandwidth_rows=3)
    cross = torch.cdist(x[:3], y[:3], p=1).reshape(-1)
    assert float(few.bandwidths["laplace"][0]) == pytest.approx(float(cross.min()) / 2, rel=1e-12)
    assert not torch.equal(full.bandwidths["laplace"], few.bandwidths["laplace"])


def test_permutation_test_columns_when_requested():
    from metrics.mmd import PermutationTestConfig

    x, y = _sample_sets()
    result = mmd(x, y, permutation_test=PermutationTestConfig(b1=50, b2=50, b3=10))
    assert {"p_value", "reject"} <= set(result.per_kernel.columns)
    assert "reject" in result.per_layer.columns
    assert result.per_kernel["p_value"].between(1 / 51 - 1e-12, 1).all()


def test_reference_halves_are_fresh_comparisons_on_half_the_reference():
    x, y = _sample_sets(m=16, n=7)
    x64 = {k: v.double() for k, v in x.items()}
    y64 = {k: v.double() for k, v in y.items()}
    resampling = ReferenceResampling(count=3, seed=5)
    result = mmd(x64, y64, resampling=resampling)
    halves = resampling.halves(16)
    assert halves.shape == (3, 8) and all(len(set(h.tolist())) == 8 for h in halves)
    for b, rows in enumerate(halves):
        direct = mmd({k: v[rows] for k, v in x64.items()}, y64)
        for layer, direct_layer in zip(result.layers, direct.layers):
            torch.testing.assert_close(layer.resampled[b], direct_layer.values, rtol=1e-10, atol=1e-14)
        for name in ("median", "mean", "max"):
            assert float(result.resampled[name][b]) == pytest.approx(direct.aggregate[name], rel=1e-10, abs=1e-14)


def test_half_sample_spread_estimates_the_standard_error_of_a_finite_reference():
    """The spread of the MMD over halves of one reference is close to its spread over
    independently drawn references of the full size (what the error bars claim)."""
    gen = torch.Generator().manual_seed(0)
    y = {"fc.weight": torch.randn(40, 6, generator=gen, dtype=torch.float64) + 0.3}
    independent = [mmd({"fc.weight": torch.randn(120, 6, generator=gen, dtype=torch.float64)}, y).aggregate["median"]
                   for _ in range(40)]
    one = {"fc.weight": torch.randn(120, 6, generator=gen, dtype=torch.float64)}
    halves = mmd(one, y, resampling=ReferenceResampling(count=40, seed=1)).resampled["median"]
    ratio = float(halves.std()) / float(np.std(independent, ddof=1))
    assert 0.5 < ratio < 2.0, ratio  # the standard error of a standard deviation from 40 draws is ~11%


def test_reject_fraction_counts_the_layers_whose_test_rejects():
    from metrics.mmd import PermutationTestConfig

    x, y = _sample_sets()
    result = mmd(x, y, permutation_test=PermutationTestConfig(b1=100, b2=100, b3=10))
    rejected = [layer.test.reject for layer in result.layers]
    assert result.reject_fraction == pytest.approx(sum(rejected) / len(rejected))
    assert np.isnan(mmd(x, y).reject_fraction)
