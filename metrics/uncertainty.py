"""Error bars of the tables: the spread over independent repetitions, and for MMD the standard
error due to the finite reference zoo (from reference half-samples), combined.

For a metric measured in R independent repetitions with values v_1..v_R, the table reports
their mean and the half-width of a 95% interval: ``t_{0.975, R-1} * sd(v) / sqrt(R)``; an extra
independent standard error ``s`` (the reference's, the same for every repetition) adds in
quadrature: ``sqrt((t sd / sqrt(R))^2 + (z_{0.975} s)^2)``. One repetition gives only the
second term (NaN without it).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95


def interval(values: Sequence[float], extra_sd: float = math.nan, level: float = LEVEL) -> tuple[float, float]:
    """``(mean, half-width)`` of the ``level`` interval of the mean of ``values`` (finite floats),
    widened by an independent standard error ``extra_sd`` when it is finite (see module doc)."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.size == 0 or not np.isfinite(v).all():
        return math.nan, math.nan
    variance = 0.0 if v.size > 1 else math.nan
    if v.size > 1:
        variance = (stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)) ** 2
    if math.isfinite(extra_sd):
        variance = (0.0 if math.isnan(variance) else variance) + (stats.norm.ppf(0.5 + level / 2) * extra_sd) ** 2
    return float(v.mean()), math.sqrt(variance) if math.isfinite(variance) else math.nan


def compare(a: float, a_hw: float, b: float, b_hw: float) -> str:
    """Whether ``a < b`` with the two values' interval half-widths: ``"lower"`` when the whole
    difference interval (half-width ``sqrt(a_hw^2 + b_hw^2)``) is below 0, ``"higher"`` when above,
    else ``"not distinguishable"`` (also when a half-width is unknown)."""
    if not all(math.isfinite(x) for x in (a, b)):
        return "not distinguishable"
    half = math.sqrt((a_hw if math.isfinite(a_hw) else math.inf) ** 2 + (b_hw if math.isfinite(b_hw) else math.inf) ** 2)
    if a + half < b:
        return "lower"
    if a - half > b:
        return "higher"
    return "not distinguishable"
