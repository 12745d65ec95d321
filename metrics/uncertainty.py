"""Error bars of the tables and the tests behind the findings: the spread over repetitions of
one row; comparisons of two rows, paired or not, by t-tests and by exact tests that need no
normality (``compare_rows``: sign-flip, permutation; below), with Holm's multiplicity control;
the smallest p-value an exact test allows and the repetitions at which it can reach a level
(``min_exact_p``, ``repetitions_to_reach``, ``reachable``); the t-tests' power and the
repetitions for 80% (``t_power``, ``repetitions_for_power``).

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

import functools
import itertools
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


# --- Distribution-free tests, unpaired comparisons, power -------------------------------------
#
# The t-tests above rest on normality (of the differences, or of each row's repetitions), which
# a row whose repetitions land in two clusters does not have. The tests below are exact under
# the design alone: a **sign-flip** test for pairs whose two values start from the same base
# network (under "no difference" each pair's difference is as likely to be -d as d: all 2^R sign
# patterns are equally likely) and a **permutation** test for two rows drawn independently of each
# other (under "no difference" every split of the R_a + R_b values into rows of R_a and R_b is
# equally likely). Their statistic is the mean difference; two-sided p-values follow scipy's
# ``permutation_test`` (twice the smaller one-sided p, at most 1, with its relative tolerance
# for ties). Their price: the smallest p-value they can give is fixed by the number of repetitions
# (``min_exact_p``): 2 / 2^R paired (0.0625 at R = 5), 2 / C(R_a + R_b, R_a) unpaired.

EXACT_LIMIT = 2 ** 18
"""Above this many sign patterns / splits the exact tests draw ``RANDOM_DRAWS`` at random."""
RANDOM_DRAWS = 100_000
POWER_TARGET = 0.8
MAX_REPETITIONS = 10_000
"""The largest number of repetitions ``repetitions_for_power`` searches; above it: ``math.inf``."""


def _two_sided(null: np.ndarray, observed: float, scale: float, exact: bool) -> float:
    """scipy's two-sided p-value of ``observed`` under the ``null`` distribution: twice the smaller
    one-sided p, at most 1 (the observed arrangement counted once more when the null was drawn
    at random). Values within 100 ulp of ``scale`` (the data's magnitude) of ``observed`` count
    as ties: a sum in another order can differ from it by rounding alone."""
    gamma = np.finfo(np.float64).eps * 100 * max(abs(observed), scale)
    less, greater = np.count_nonzero(null <= observed + gamma), np.count_nonzero(null >= observed - gamma)
    if exact:
        p_less, p_greater = less / null.size, greater / null.size
    else:
        p_less, p_greater = (less + 1) / (null.size + 1), (greater + 1) / (null.size + 1)
    return float(min(1.0, 2 * min(p_less, p_greater)))


def sign_flip_p(differences: Sequence[float], seed: int = 0) -> float:
    """Two-sided p-value of the exact sign-flip test of ``mean(differences) = 0``: the observed
    mean against the means of all 2^R sign patterns (``RANDOM_DRAWS`` random ones, drawn with
    ``seed``, above ``EXACT_LIMIT``). Non-finite differences are dropped; NaN with fewer than 2."""
    d = np.asarray(differences, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < 2:
        return math.nan
    exact = 2 ** d.size <= EXACT_LIMIT
    if exact:  # pattern 0 (no flip) is the observed arrangement
        patterns = (np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1
    else:
        patterns = np.random.default_rng(seed).integers(0, 2, (RANDOM_DRAWS + 1, d.size))
        patterns[0] = 0
    null = (1 - 2 * patterns) @ d / d.size
    return _two_sided(null[1:] if not exact else null, float(null[0]), float(np.abs(d).max()), exact)


@functools.lru_cache(maxsize=8)
def _splits(total: int, n: int) -> np.ndarray:
    """``[C(total, n), total]`` bool: every way to pick ``n`` of ``total`` values (the first: the first ``n``)."""
    count = math.comb(total, n)
    chosen = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(total), n)), dtype=np.int64,
                         count=count * n).reshape(count, n)
    mask = np.zeros((count, total), dtype=bool)
    mask[np.arange(count)[:, None], chosen] = True
    mask.flags.writeable = False
    return mask


def permutation_p(a: Sequence[float], b: Sequence[float], seed: int = 0) -> float:
    """Two-sided p-value of the exact two-sample permutation test of ``mean(a) = mean(b)`` for two
    independent samples: the observed ``mean(a) - mean(b)`` against every split of the pooled
    values into samples of the two sizes (``RANDOM_DRAWS`` random permutations, drawn with
    ``seed``, above ``EXACT_LIMIT`` splits). Non-finite values are dropped; NaN when a sample
    has none left."""
    x, y = (np.asarray(v, dtype=np.float64) for v in (a, b))
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    if x.size == 0 or y.size == 0:
        return math.nan
    pooled, n = np.concatenate([x, y]), x.size
    exact = math.comb(pooled.size, n) <= EXACT_LIMIT
    if exact:  # split 0 (the first n values to a) is the observed one
        in_a = _splits(pooled.size, n)
    else:
        rng = np.random.default_rng(seed)
        in_a = np.argsort(rng.random((RANDOM_DRAWS + 1, pooled.size)), axis=1) < n
        in_a[0] = np.arange(pooled.size) < n
    sums = in_a @ pooled
    null = sums / n - (pooled.sum() - sums) / y.size
    return _two_sided(null if exact else null[1:], float(null[0]), float(np.abs(pooled).max()), exact)


def min_exact_p(n_a: int, n_b: int | None = None) -> float:
    """The smallest two-sided p-value the exact test can give: the sign-flip test of ``n_a`` pairs
    (``n_b`` None) ``2 / 2^n_a``, the permutation test of ``n_a`` against ``n_b`` independent values
    ``2 / C(n_a + n_b, n_a)``; at most 1 (1 with fewer than 2 pairs or an empty sample)."""
    if n_b is None:
        return 1.0 if n_a < 2 else min(1.0, 2.0 / 2 ** n_a)
    return 1.0 if min(n_a, n_b) < 1 else min(1.0, 2.0 / math.comb(n_a + n_b, n_a))


def repetitions_to_reach(level: float, paired: bool) -> int:
    """The fewest repetitions (pairs; or repetitions of each row, unpaired) at which the exact test
    can give a p-value <= ``level`` at all (``min_exact_p``): 6 pairs or 4 + 4 unpaired for 0.05,
    two-sided. ``ValueError`` unless 0 < level."""
    if not level > 0:
        raise ValueError(f"repetitions_to_reach: level must be > 0, got {level}")
    n = 2
    while (min_exact_p(n) if paired else min_exact_p(n, n)) > level:
        n += 1
    return n


@dataclass(frozen=True)
class RowTest:
    """Row A against row B (``compare_rows``). ``paired``: repetition k of A and of B start from
    the same base network, so the tests are on the differences a_k - b_k (Student's paired t, the
    sign-flip test); otherwise the two rows are independent samples (Welch's t, the permutation
    test). ``n_a``, ``n_b``: values used (pairs: both the number of pairs); ``mean``: mean
    difference (paired) or difference of means; ``half_width``: of its ``level`` t-interval
    (paired or Welch); ``sd_a``, ``sd_b``: sd of the differences (paired: both) or of each row;
    ``df``: the t-test's degrees of freedom (Welch-Satterthwaite unpaired); ``t_p``: the t-test's
    two-sided p-value; ``exact_p``: the distribution-free test's; ``min_p``: the smallest
    ``exact_p`` these sizes allow. p-values are NaN when nothing can be tested."""

    paired: bool
    n_a: int
    n_b: int
    mean: float
    half_width: float
    sd_a: float
    sd_b: float
    df: float
    statistic: float
    t_p: float
    exact_p: float
    min_p: float

    @property
    def testable(self) -> bool:
        """Whether a t-test p-value exists (2 pairs; unpaired, 2 values in each row)."""
        return math.isfinite(self.t_p)

    def power(self, level: float, mean: float | None = None, n: int | None = None) -> float:
        """The t-test's power at two-sided ``level`` against a true difference ``mean`` (default:
        the observed one) with the observed sds, at ``n`` repetitions (pairs, or of each row;
        default: the ones used). NaN when the sds are unknown."""
        return t_power(self.mean if mean is None else mean, self.sd_a, self.sd_b, self.paired, level,
                       (self.n_a, self.n_b) if n is None else (n, n))


def t_power(mean: float, sd_a: float, sd_b: float, paired: bool, level: float, n: tuple[int, int]) -> float:
    """Power of the two-sided t-test at ``level`` when the true difference is ``mean``: the paired
    t-test of ``n[0]`` pairs whose differences have sd ``sd_a`` (noncentral t with ``n - 1`` df and
    noncentrality ``mean / (sd_a / sqrt(n))``), or Welch's test of ``n[0]`` and ``n[1]`` independent
    values with sds ``sd_a``, ``sd_b`` (noncentral t with the Welch-Satterthwaite df). NaN when an
    sd is not finite or a sample is too small; 1 when the spread is 0 and ``mean`` is not."""
    if paired:
        if n[0] < 2 or not math.isfinite(sd_a):
            return math.nan
        se, df = sd_a / math.sqrt(n[0]), n[0] - 1
    else:
        if min(n) < 2 or not (math.isfinite(sd_a) and math.isfinite(sd_b)):
            return math.nan
        va, vb = sd_a ** 2 / n[0], sd_b ** 2 / n[1]
        se = math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va ** 2 / (n[0] - 1) + vb ** 2 / (n[1] - 1)) if se > 0 else n[0] + n[1] - 2
    if se == 0.0:
        return level if mean == 0.0 else 1.0
    critical, nc = stats.t.ppf(1 - level / 2, df), abs(mean) / se
    # the far tail P(T < -critical) as sf(critical) at -nc: scipy's cdf there is NaN for large nc
    near, far = stats.nct.sf(critical, df, nc), stats.nct.sf(critical, df, -nc)
    return float(min(1.0, near + (0.0 if math.isnan(far) else far)))


def repetitions_for_power(test: RowTest, level: float, target: float = POWER_TARGET,
                          mean: float | None = None) -> float:
    """The fewest repetitions (pairs, or of each row unpaired) at which ``test``'s t-test reaches
    ``target`` power at two-sided ``level`` against ``mean`` (default: the observed difference),
    with the observed sds, and at which its exact test can reach ``level`` at all
    (``repetitions_to_reach``); ``math.inf`` when no number up to ``MAX_REPETITIONS`` does
    (e.g. ``mean`` 0), NaN when the sds are unknown."""
    if not math.isfinite(test.power(level, mean, 2)):
        return math.nan
    floor = repetitions_to_reach(level, test.paired)
    if test.power(level, mean, MAX_REPETITIONS) < target:
        return math.inf
    low, high = 2, MAX_REPETITIONS  # power grows with n: the smallest n with power >= target
    while low < high:
        middle = (low + high) // 2
        if test.power(level, mean, middle) >= target:
            high = middle
        else:
            low = middle + 1
    return float(max(low, floor))


def compare_rows(a: Sequence[float], b: Sequence[float], paired: bool, level: float = LEVEL, seed: int = 0) -> RowTest:
    """Row A's repetitions ``a`` against row B's ``b``. ``paired``: ``a[k]`` and ``b[k]`` start from
    the same base network (the same length required; pairs with a non-finite value dropped):
    Student's paired t-test (``paired_test``) and the exact sign-flip test; otherwise Welch's
    t-test and the exact permutation test on the finite values of each. Two-sided; see
    ``RowTest``. ``ValueError`` naming the shapes when paired rows differ in length."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if paired:
        test = paired_test(x, y, level)
        d = (x - y)[np.isfinite(x) & np.isfinite(y)]
        sd = float(d.std(ddof=1)) if d.size >= 2 else math.nan
        return RowTest(True, test.n, test.n, test.mean, test.half_width, sd, sd, float(test.n - 1), test.statistic,
                       test.p_value, sign_flip_p(d, seed), min_exact_p(test.n))
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"compare_rows: a and b must be 1-D, got shapes {x.shape} and {y.shape}")
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    mean = float(x.mean() - y.mean()) if x.size and y.size else math.nan
    if min(x.size, y.size) < 2:
        return RowTest(False, int(x.size), int(y.size), mean, math.nan, math.nan, math.nan, math.nan, math.nan,
                       math.nan, math.nan, min_exact_p(x.size, y.size))
    sa, sb = float(x.std(ddof=1)), float(y.std(ddof=1))
    va, vb = sa ** 2 / x.size, sb ** 2 / y.size
    se = math.sqrt(va + vb)
    if se == 0.0:
        df = float(x.size + y.size - 2)
        statistic, p = (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    else:
        df = (va + vb) ** 2 / (va ** 2 / (x.size - 1) + vb ** 2 / (y.size - 1))
        statistic = mean / se
        p = float(2 * stats.t.sf(abs(statistic), df))
    return RowTest(False, int(x.size), int(y.size), mean, float(stats.t.ppf(0.5 + level / 2, df)) * se, sa, sb, df,
                   statistic, p, permutation_p(x, y, seed), min_exact_p(x.size, y.size))


def reachable(min_p_values: Sequence[float], alpha: float = ALPHA) -> np.ndarray:
    """For a family tested with Holm's procedure: whether each comparison could be rejected at all,
    i.e. whether its Holm-adjusted p-value is <= ``alpha`` when every comparison of the family
    gives the smallest p-value its exact test allows (``min_exact_p``): the most any data could
    show. ``False`` marks a comparison too underpowered to decide (and NaN entries)."""
    return holm(min_p_values) <= alpha
