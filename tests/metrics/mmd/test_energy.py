"""The energy coefficient against independent computations: scipy's energy distance in one
dimension, explicit loops over pairs in many, and its closed form for copies of one network."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from metrics.mmd import ReferenceResampling, mmd, pairwise_distances, split_columns
from metrics.mmd.energy import energy_coefficient, energy_distance
from tests.metrics.mmd.brute_force import distance


def _distances(x: torch.Tensor, y: torch.Tensor):
    return pairwise_distances(split_columns(x, y, max_chunk_elements=7 * (len(x) + len(y))))


def test_the_v_statistic_is_scipys_energy_distance_squared_in_one_dimension():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, generator=gen, dtype=torch.float64), 0.5 + 2 * torch.rand(25, 1, generator=gen, dtype=torch.float64)
    expected = scipy.stats.energy_distance(x[:, 0].numpy(), y[:, 0].numpy()) ** 2
    assert energy_distance(_distances(x, y), unbiased=False) == pytest.approx(expected, rel=1e-10)


def _by_loops(x: np.ndarray, y: np.ndarray) -> float:
    m, n = len(x), len(y)
    xx = sum(distance(x[i], x[j], "l2") for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(distance(y[i], y[j], "l2") for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    xy = sum(distance(a, b, "l2") for a in x for b in y) / (m * n)
    return (2 * xy - xx - yy) / (2 * xy)


def test_the_u_statistic_coefficient_matches_loops_over_pairs_in_many_dimensions():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 23, generator=gen, dtype=torch.float64)
    y = 0.3 + 1.5 * torch.randn(8, 23, generator=gen, dtype=torch.float64)
    assert energy_coefficient(_distances(x, y)) == pytest.approx(_by_loops(x.numpy(), y.numpy()), rel=1e-9)


def test_copies_of_one_network_have_the_closed_form_and_two_draws_of_one_distribution_about_zero():
    gen = torch.Generator().manual_seed(2)
    zoo = torch.randn(200, 50, generator=gen, dtype=torch.float64)
    y0 = torch.randn(1, 50, generator=gen, dtype=torch.float64)
    copies = y0.repeat(30, 1)
    d_xx = torch.pdist(zoo).mean().item()  # mean over distinct pairs
    d_xy = torch.cdist(zoo, y0).mean().item()
    assert energy_coefficient(_distances(zoo, copies)) == pytest.approx(1 - d_xx / (2 * d_xy), rel=1e-9)
    # a typical member: about 1/2 (in high dimension |x - y0| concentrates on sqrt(2) x the spread, as |x - x'| does)
    assert 0.4 < energy_coefficient(_distances(zoo, copies)) < 0.6
    second = torch.randn(100, 50, generator=gen, dtype=torch.float64)
    assert abs(energy_coefficient(_distances(zoo, second))) < 0.01
    far = second + 3.0
    assert energy_coefficient(_distances(zoo, far)) > 0.3


def test_mmd_gives_the_parameter_weighted_energy_and_its_reference_spread():
    gen = torch.Generator().manual_seed(3)
    x = {"a.weight": torch.randn(30, 4, generator=gen), "b.weight": torch.randn(30, 2, 3, generator=gen)}
    y = {"a.weight": torch.randn(12, 4, generator=gen) + 1, "b.weight": torch.randn(12, 2, 3, generator=gen)}
    result = mmd(x, y, resampling=ReferenceResampling(count=5, seed=0))
    per_layer = {
        name: energy_coefficient(_distances(x[f"{name}.weight"].reshape(30, -1).double(), y[f"{name}.weight"].reshape(12, -1).double()))
        for name in ("a", "b")
    }
    assert result.per_layer["energy"].tolist() == pytest.approx([per_layer["a"], per_layer["b"]], rel=1e-9)
    assert result.aggregate["energy"] == pytest.approx((4 * per_layer["a"] + 6 * per_layer["b"]) / 10, rel=1e-9)
    halves = result.resampled["energy"]
    assert halves.shape == (5,) and bool(torch.isfinite(halves).all()) and float(halves.std()) > 0
    assert math.isclose(float(halves.mean()), result.aggregate["energy"], rel_tol=0.5)


def test_copies_of_one_network_sit_at_the_mmds_ceiling_but_not_at_the_energys():
    """S copies of y0: the within-copies kernel mean is 1, and at MMDAgg's smallest Gaussian bandwidth
    (half the smallest cross distance) every zoo-y0 kernel value is at most e^-4, so that MMD^2 is at
    least 1 - 2e^-4 whatever the zoo; the Laplace kernel's smallest gives at least 1 - 2e^-2."""
    gen = torch.Generator().manual_seed(4)
    for scale, dim in ((1.0, 60), (0.5, 300), (3.0, 20)):
        zoo = {"fc.weight": scale * torch.randn(300, dim, generator=gen, dtype=torch.float64)}
        y0 = scale * torch.randn(1, dim, generator=gen, dtype=torch.float64)
        copies = {"fc.weight": y0.repeat(50, 1)}
        result = mmd(zoo, copies)
        kernels = result.per_kernel.set_index(["kernel", "bandwidth_index"])["mmd"]
        assert kernels[("gaussian", 0)] >= 1 - 2 * math.exp(-4)
        assert kernels[("laplace", 0)] >= 1 - 2 * math.exp(-2)
        assert result.aggregate["max"] >= 1 - 2 * math.exp(-4)
        energy = result.aggregate["energy"]
        d_xx, d_xy = torch.pdist(zoo["fc.weight"]).mean().item(), torch.cdist(zoo["fc.weight"], y0).mean().item()
        assert energy == pytest.approx(1 - d_xx / (2 * d_xy), rel=1e-9)
        assert 0.3 < energy < 0.7  # far from its own ceiling (1: point masses apart)
        second = {"fc.weight": scale * torch.randn(50, dim, generator=gen, dtype=torch.float64)}
        assert abs(mmd(zoo, second).aggregate["energy"]) < 0.02
