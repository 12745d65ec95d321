import numpy as np
import pytest
import torch

from metrics.mmd import (
    PermutationTestConfig,
    aggregate_decision,
    kernel_matrix,
    layer_mmd,
    pairwise_distances,
    relabelled_statistics,
    relabelling_indicators,
    u_statistics,
)
from tests.metrics.mmd.brute_force import u_statistic_by_loops

SMALL = PermutationTestConfig(alpha=0.05, b1=150, b2=150, b3=20, seed=3)


def test_relabelled_statistics_equal_the_u_statistic_of_relabelled_data():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(9, 3))
    m = 5
    d = pairwise_distances([(torch.from_numpy(z[:m]), torch.from_numpy(z[m:]))])
    k = kernel_matrix(d.l1, "laplace", 1.7)
    indicators = relabelling_indicators(m, 4, count=6, seed=1)
    assert torch.equal(indicators.sum(0), torch.full((6,), float(m), dtype=torch.float64))
    draws = relabelled_statistics(k, m, indicators)
    for b in range(6):
        is_x = indicators[:, b].bool().numpy()
        expected = u_statistic_by_loops(z[is_x], z[~is_x], "laplace", 1.7)
        assert float(draws[b]) == pytest.approx(expected, rel=1e-5, abs=1e-7)  # the relabelling product runs in float32


def test_identity_labelling_gives_the_observed_statistic():
    d = pairwise_distances([(torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))])
    k = kernel_matrix(d.l2, "gaussian", 2.0)
    identity = torch.cat([torch.ones(6), torch.zeros(3)]).to(torch.float64)[:, None]
    observed = u_statistics(d.l2, 6, "gaussian", torch.tensor([2.0], dtype=torch.float64))
    assert float(relabelled_statistics(k, 6, identity)[0]) == pytest.approx(float(observed[0]), rel=1e-5, abs=1e-7)  # float32 product


def test_p_values_and_decision_of_a_hand_built_case():
    # Two kernels, B1 = 4 draws each; kernel 0 observed above all draws, kernel 1 in the middle.
    observed = torch.tensor([10.0, 2.5], dtype=torch.float64)
    quantile_draws = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    level_draws = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    result = aggregate_decision(observed, quantile_draws, level_draws, alpha=0.5, steps=30)
    # p = fraction of {draws, observed} >= observed: 1/5 and 3/5
    assert result.p_values.tolist() == pytest.approx([0.2, 0.6])
    # No level draw ever exceeds a quantile, so u climbs to min(1/w) = 2 and thresholds to u/2 = 1.
    assert result.u == pytest.approx(2.0, rel=1e-6)
    assert result.reject_each.tolist() == [True, True] and result.reject


def test_same_distribution_does_not_reject_and_shift_rejects():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(60, 4, generator=gen, dtype=torch.float64)
    same = layer_mmd(
        [(x, torch.randn(30, 4, generator=gen, dtype=torch.float64))], permutation_test=SMALL
    ).test
    shifted = layer_mmd(
        [(x, torch.randn(30, 4, generator=gen, dtype=torch.float64) + 1.0)], permutation_test=SMALL
    ).test
    assert not same.reject and same.p_values.min() > 0.05
    # the narrowest kernels see few pairs; the others put the observed value above every draw
    assert shifted.reject and shifted.p_values.min() == pytest.approx(1 / (SMALL.b1 + 1))
    assert int((shifted.p_values <= 0.05).sum()) >= 15
    assert 0 < same.u <= 20 and same.thresholds.shape == (20,)


@pytest.mark.parametrize("field, value", [("alpha", 0.0), ("alpha", 1.0), ("b1", 0), ("b2", -1), ("b3", 0)])
def test_bad_config_is_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        PermutationTestConfig(**{field: value})
