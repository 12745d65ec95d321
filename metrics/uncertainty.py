"""Error bars of the tables and the tests behind the findings: the spread over repetitions of
one row, and paired comparisons of two rows with Holm's multiplicity control.

One row (``interval``). For a metric measured in R independent repetitions with values
v_1..v_R, the table reports their mean and the half-width of a 95% interval:
``t_{0.975, R-1} * sd(v) / sqrt(R)``; an extra independent standard error ``s`` (the reference
zoo's, the same for every repetition) adds in quadrature: ``sqrt((t sd / sqrt(R))^2 + (z_{0.975} s)^2)``.
One repetition has no spread to estimate: its half-width is NaN, never ``s`` alone (which
would read as a tight interval).

Two rows (``paired_test``). Repetition k of every row of an experiment is drawn around its
own block of held-out base networks, so row A's and row B's repetition k can share bases and
are compared as a pair: the test is Student's paired t-test on the differences
``d_k = a_k - b_k`` (two-sided; ``t = mean(d) / (sd(d) / sqrt(R))``, R - 1 degrees of freedom),
valid when the pairs are independent of one another whether or not a pair's two values are
correlated. The reference zoo's standard error is left out: it is common to both rows, and the
test is conditional on the zoo (is A closer to *this* reference than B).

Several comparisons (``holm``, ``holm_decisions``). The comparisons of one claim form a
family; Holm's step-down procedure (Holm 1979) rejects in order of increasing p-value while
``p_(i) <= alpha / (m - i + 1)`` and controls the family-wise error rate at ``alpha`` under
any dependence between the tests (rows of one claim share repetitions, so the tests are
dependent: this is why Holm rather than a procedure that needs independence or positive
dependence). A rejected comparison is decided by the sign of its mean difference, the usual
practice with two-sided tests (Shaffer 1980 shows that Holm's procedure then also controls the
probability of a wrong direction, for independent tests).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
ALPHA = 0.05
LOWER, HIGHER, UNDECIDED = "lower", "higher", "not distinguishable"


def interval(values: Sequence[float], extra_sd: float = math.nan, level: float = LEVEL) -> tuple[float, float]:
    """``(mean, half-width)`` of the ``level`` interval of the mean of ``values`` (finite floats),
    widened by an independent standard error ``extra_sd`` when it is finite (see module doc).
    The half-width is NaN for fewer than 2 values (no spread to estimate), and both are NaN
    when a value is not finite."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.size == 0 or not np.isfinite(v).all():
        return math.nan, math.nan
    if v.size < 2:
        return float(v[0]), math.nan
    variance = (stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)) ** 2
    if math.isfinite(extra_sd):
        variance += (stats.norm.ppf(0.5 + level / 2) * extra_sd) ** 2
    return float(v.mean()), math.sqrt(variance)


@dataclass(frozen=True)
class PairedTest:
    """Student's paired t-test of ``a - b`` (see ``paired_test``). ``n``: pairs; ``mean``: mean
    difference (units of the values); ``half_width``: of its ``level`` t-interval; ``statistic``:
    t; ``p_value``: two-sided. All but ``n`` are NaN with fewer than 2 pairs."""

    n: int
    mean: float
    half_width: float
    statistic: float
    p_value: float

    @property
    def testable(self) -> bool:
        """Whether a p-value exists (at least 2 pairs)."""
        return math.isfinite(self.p_value)


def paired_test(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> PairedTest:
    """Paired t-test of the mean of ``a[k] - b[k]`` against 0 (two-sided).

    ``a``, ``b``: ``[R]`` values of two rows, the k-th of each from the same repetition; pairs
    where either value is not finite are dropped (a metric that does not apply). With fewer than
    2 pairs nothing can be tested (NaN fields). Differences with no spread give ``t = +-inf``,
    ``p = 0`` (or ``t = 0``, ``p = 1`` when they are all 0).
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired_test: a and b must be 1-D of the same length, got shapes {x.shape} and {y.shape}")
    d = (x - y)[np.isfinite(x) & np.isfinite(y)]
    if d.size < 2:
        return PairedTest(int(d.size), float(d.mean()) if d.size else math.nan, math.nan, math.nan, math.nan)
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(d.size)
    df = d.size - 1
    if se == 0.0:
        statistic = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
        p = 1.0 if mean == 0.0 else 0.0
    else:
        statistic = mean / se
        p = float(2 * stats.t.sf(abs(statistic), df))
    return PairedTest(int(d.size), mean, float(stats.t.ppf(0.5 + level / 2, df)) * se, statistic, p)


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm-adjusted p-values ``[m]``: ``max_{j <= i} min(1, (m' - j + 1) p_(j))`` in the order of
    increasing p, mapped back; a comparison is rejected at level alpha when its adjusted p-value
    is <= alpha (the step-down procedure). NaN entries (comparisons that cannot be tested) stay
    NaN and do not count in m' (the number of finite p-values)."""
    p = np.asarray(p_values, dtype=np.float64)
    adjusted = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    m = order.size
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def holm_decisions(tests: Sequence[PairedTest], alpha: float = ALPHA) -> list[str]:
    """For a family of paired tests of ``a - b``: ``"lower"`` (a < b) or ``"higher"`` when Holm's
    procedure rejects "no difference" at family-wise level ``alpha`` (the sign of the mean
    difference decides), ``"not distinguishable"`` otherwise (also for untestable ones)."""
    adjusted = holm([t.p_value for t in tests])
    return [UNDECIDED if not (q <= alpha) else LOWER if t.mean < 0 else HIGHER for t, q in zip(tests, adjusted)]
