"""The energy distance of one layer (Szekely and Rizzo 2013): the MMD of the distance kernel, with
no bandwidth, on the same L2 distances as the 20 kernels (``PairwiseDistances.l2``).

With X = reference rows ``:m`` and Y = method rows ``m:`` of the pooled Euclidean distances d:

    E = 2 mean_{i,j} d(x_i, y_j) - mean_{i!=i'} d(x_i, x_i') - mean_{j!=j'} d(y_j, y_j')

(the unbiased U-statistic: within-sample means over distinct pairs; ``unbiased=False``, the
V-statistic, also averages the zero diagonal, as ``scipy.stats.energy_distance`` does, which
returns sqrt(E_V)). E is in the weights' units and 0 when X and Y have one distribution.

The column the tables print is the **energy coefficient** ``H = E / (2 mean d(x, y))``: unitless, in
[0, 1] for the V-statistic (Szekely and Rizzo's H; the U-statistic is about 0 for two draws of one
distribution and can be slightly negative), and invariant to a rescaling of the layer, so layers of
different scales average like the MMD's (weighted by parameter count, ``table.tabulate``).

Why it does not saturate where the Gaussian and Laplace MMDs do: a sample of S copies of one network
y0 has ``H = 1 - mean_{i!=i'} d(x_i, x_i') / (2 mean_i d(x_i, y0))``, which is about 1/2 when y0 is a
typical member of the reference (its mean distance to the reference equals the reference's own)
and moves with how far y0 lies from the reference; the MMD of MMDAgg's smallest bandwidth, which
is set by the closest cross pair, is then at least 1 - 2e^-4 whatever the reference.
"""
from __future__ import annotations

import torch

from metrics.mmd.distances import PairwiseDistances


def energy_terms(distances: PairwiseDistances, unbiased: bool = True) -> tuple[float, float, float]:
    """``(mean d(x, x'), mean d(y, y'), mean d(x, y))`` of one layer's L2 distances (float64; the
    within means over distinct pairs when ``unbiased``, over all m^2 / n^2 pairs otherwise)."""
    d, m, n = distances.l2, distances.m, distances.n
    within_x, within_y = d[:m, :m].sum(), d[m:, m:].sum()
    pairs_x, pairs_y = (m * (m - 1), n * (n - 1)) if unbiased else (m * m, n * n)
    between = d[:m, m:].mean()
    return float(within_x / pairs_x), float(within_y / pairs_y), float(between)


def energy_distance(distances: PairwiseDistances, unbiased: bool = True) -> float:
    """E of one layer (see the module docstring), in the weights' units."""
    xx, yy, xy = energy_terms(distances, unbiased)
    return 2 * xy - xx - yy


def energy_coefficient(distances: PairwiseDistances, unbiased: bool = True) -> float:
    """H = E / (2 mean d(x, y)) of one layer: unitless, 0 for one distribution, 1 for point masses
    at distinct places (the V-statistic lies in [0, 1]); 0 when every cross distance is 0."""
    xx, yy, xy = energy_terms(distances, unbiased)
    return 0.0 if xy == 0 else (2 * xy - xx - yy) / (2 * xy)


def half_sample_energy(distances: PairwiseDistances, halves: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64: the energy coefficient of ``[X[halves[b]]; Y]`` for each of B sub-samples of
    the reference (``halves [B, h]`` row indices of X), Y kept whole."""
    return torch.tensor([energy_coefficient(distances.subset_x(rows)) for rows in halves], dtype=torch.float64, device="cpu")
