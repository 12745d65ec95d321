"""Independent reference computations for the MMD tests: plain Python loops over pairs."""
from __future__ import annotations

import math

import numpy as np


def distance(a: np.ndarray, b: np.ndarray, kind: str) -> float:
    """L1 or L2 distance of two vectors, one coordinate at a time."""
    if kind == "l1":
        return sum(abs(float(u) - float(v)) for u, v in zip(a, b))
    return math.sqrt(sum((float(u) - float(v)) ** 2 for u, v in zip(a, b)))


def bandwidths_by_hand(cross: list[float], count: int = 10) -> list[float]:
    """MMDAgg's rule written out: min (or floored 5% order statistic if < 0.1) / 2 to 2 * max(max, 0.3)."""
    ordered = sorted(cross)
    low = ordered[0]
    if low < 0.1:
        low = max(ordered[int(len(ordered) * 0.05)], 0.1)
    low = low / 2
    high = 2 * max(ordered[-1], 0.3)
    ratio = (high / low) ** (1 / (count - 1))
    return [low * ratio**i for i in range(count)]


def kernel_value(dist: float, kernel: str, bandwidth: float) -> float:
    """Laplace exp(-d/l) on L1 distances, Gaussian exp(-d^2/l^2) on L2 distances."""
    return math.exp(-dist / bandwidth) if kernel == "laplace" else math.exp(-(dist**2) / bandwidth**2)


def u_statistic_by_loops(x: np.ndarray, y: np.ndarray, kernel: str, bandwidth: float) -> float:
    """Unbiased MMD^2 with explicit double loops over pairs."""
    kind = "l1" if kernel == "laplace" else "l2"
    m, n = len(x), len(y)

    def k(a, b):
        return kernel_value(distance(a, b, kind), kernel, bandwidth)

    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j)
    yy = sum(k(y[i], y[j]) for i in range(n) for j in range(n) if i != j)
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(n))
    return xx / (m * (m - 1)) + yy / (n * (n - 1)) - 2 * xy / (m * n)


def mmd_values_by_loops(x: np.ndarray, y: np.ndarray, max_rows: int = 500) -> tuple[list[float], dict]:
    """The 20 values (Laplace then Gaussian) with bandwidths from the first ``max_rows`` rows."""
    values, grids = [], {}
    for kernel, kind in (("laplace", "l1"), ("gaussian", "l2")):
        cross = [distance(a, b, kind) for a in x[:max_rows] for b in y[:max_rows]]
        grids[kernel] = bandwidths_by_hand(cross)
        values += [u_statistic_by_loops(x, y, kernel, bw) for bw in grids[kernel]]
    return values, grids
