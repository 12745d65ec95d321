"""MMDAgg's bandwidth collection (Schrab et al. 2023, reference code ``compute_bandwidths``).

From the cross distances between the first 500 rows of X and of Y (L1 for the Laplace
kernels, L2 for the Gaussian ones):
- l_min = the smallest distance; when it is below 0.1 (e.g. repeated samples), the 5%
  order statistic ``sorted(d)[floor(0.05 * len(d))]`` floored at 0.1 instead; then halved;
- l_max = 2 * max(largest distance, 0.3);
- ``count`` values geometric from l_min to l_max (both included).
The floors keep every bandwidth >= 0.05 > 0, so identical samples never divide by zero.
"""
from __future__ import annotations

import math

import torch

NUMBER_OF_BANDWIDTHS = 10
SMALL_DISTANCE = 0.1
QUANTILE = 0.05
MAX_FLOOR = 0.3


def bandwidth_grid(cross_distances: torch.Tensor, count: int = NUMBER_OF_BANDWIDTHS) -> torch.Tensor:
    """The ``count`` bandwidths ``[count]`` (float64, units of the distances) for one distance type.

    ``cross_distances``: any-shaped tensor of distances between X rows and Y rows (>= 1 value).
    """
    if count < 2:
        raise ValueError(f"bandwidth_grid: count must be >= 2, got {count}")
    d = cross_distances.detach().reshape(-1).to(torch.float64)
    if d.numel() == 0:
        raise ValueError("bandwidth_grid: no cross distances given")
    smallest = float(d.min())
    if smallest < SMALL_DISTANCE:
        order_statistic = float(torch.sort(d).values[math.floor(d.numel() * QUANTILE)])
        l_min = max(order_statistic, SMALL_DISTANCE)
    else:
        l_min = smallest
    l_min /= 2
    l_max = 2 * max(float(d.max()), MAX_FLOOR)
    exponents = torch.arange(count, dtype=torch.float64, device="cpu") / (count - 1)
    return l_min * (l_max / l_min) ** exponents
