"""Error bars and comparisons: the one-row interval, Student's paired t-test against scipy
and R's published numbers, Holm's procedure against statsmodels, and their size and power on
simulated repetitions that share base networks; the exact sign-flip and permutation tests and
Welch's test against scipy, the t-tests' power against statsmodels and a simulation."""
import math

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from metrics.uncertainty import ALPHA, holm, holm_decisions, interval, paired_test

# Student's (1908) sleep data, as R's datasets::sleep: extra hours of sleep of 10 patients under
# two drugs. R 4.x: t.test(extra ~ group, data = sleep, paired = TRUE) prints
# t = -4.0621, df = 9, p-value = 0.002833; 95 percent confidence interval: -2.4598858 -0.7001142;
# mean difference -1.58.
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_interval_is_a_t_interval_widened_by_an_independent_standard_error():
    mean, hw = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(hw - 4.302653 * 1.0 / 3**0.5) < 1e-6
    _, wider = interval([1.0, 2.0, 3.0], extra_sd=1.0)
    assert abs(wider - (hw**2 + 1.959964**2) ** 0.5) < 1e-6
    low, high = stats.t.interval(0.95, 4, loc=np.mean([3, 1, 4, 1, 5]), scale=stats.sem([3, 1, 4, 1, 5]))
    assert interval([3, 1, 4, 1, 5])[1] == pytest.approx((high - low) / 2, rel=1e-12)


def test_one_repetition_has_no_half_width_even_with_the_reference_error():
    for extra in (math.nan, 0.5):
        mean, hw = interval([5.0], extra_sd=extra)
        assert mean == 5.0 and math.isnan(hw)
    assert all(math.isnan(x) for x in interval([]))
    assert all(math.isnan(x) for x in interval([1.0, float("nan")]))


def test_paired_test_reproduces_r_on_students_sleep_data():
    test = paired_test(SLEEP_1, SLEEP_2)
    assert test.n == 10 and test.mean == pytest.approx(-1.58, abs=1e-12)
    assert test.statistic == pytest.approx(-4.0621, abs=5e-5)
    assert test.p_value == pytest.approx(0.002833, abs=5e-7)
    assert (test.mean - test.half_width, test.mean + test.half_width) == pytest.approx((-2.4598858, -0.7001142), abs=5e-8)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_paired_test_equals_scipy_ttest_rel(n):
    rng = np.random.default_rng(n)
    base = rng.normal(0.3, 0.2, n)  # a shared base-network effect, as rows of one repetition have
    a, b = base + rng.normal(0.0, 0.02, n), base + 0.01 + rng.normal(0.0, 0.02, n)
    test, reference = paired_test(a, b), stats.ttest_rel(a, b)
    assert test.statistic == pytest.approx(reference.statistic, rel=1e-12)
    assert test.p_value == pytest.approx(reference.pvalue, rel=1e-10)
    low, high = reference.confidence_interval(0.95)
    assert test.half_width == pytest.approx((high - low) / 2, rel=1e-12)
    one_sample = stats.ttest_1samp(a - b, 0.0)
    assert test.p_value == pytest.approx(one_sample.pvalue, rel=1e-10)


def test_paired_test_drops_pairs_with_a_missing_value_and_needs_two():
    a, b = [1.0, 2.0, float("nan"), 4.0], [0.5, 1.0, 3.0, 3.9]
    assert paired_test(a, b).p_value == pytest.approx(stats.ttest_rel([1.0, 2.0, 4.0], [0.5, 1.0, 3.9]).pvalue, rel=1e-12)
    single = paired_test([1.0], [2.0])
    assert single.n == 1 and single.mean == -1.0 and not single.testable and math.isnan(single.half_width)
    assert not paired_test([float("nan")] * 3, [1.0] * 3).testable
    same = paired_test([0.2, 0.2], [0.2, 0.2])
    assert (same.statistic, same.p_value) == (0.0, 1.0)
    shifted = paired_test([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])  # differences with no spread
    assert shifted.p_value == 0.0 and shifted.statistic == math.inf
    with pytest.raises(ValueError, match="paired_test: a and b"):
        paired_test([1.0, 2.0], [1.0])


def test_holm_equals_statsmodels_and_a_hand_computation():
    p = [0.01, 0.04, 0.03, 0.005, 0.2]
    # sorted 0.005, 0.01, 0.03, 0.04, 0.2 -> x5, x4, x3, x2, x1 = 0.025, 0.04, 0.09, 0.08 -> 0.09, 0.2
    assert holm(p).tolist() == pytest.approx([0.04, 0.09, 0.09, 0.025, 0.2], rel=1e-12)
    rng = np.random.default_rng(0)
    for m in (1, 2, 4, 18):
        p = rng.uniform(0, 0.1, m) ** 2
        reject, corrected, _, _ = multipletests(p, alpha=ALPHA, method="holm")
        np.testing.assert_allclose(holm(p), corrected, rtol=1e-12)
        assert ((holm(p) <= ALPHA) == reject).all()


def test_holm_leaves_untestable_comparisons_out_of_the_family():
    adjusted = holm([0.02, float("nan"), 0.03])
    assert math.isnan(adjusted[1]) and adjusted[[0, 2]].tolist() == pytest.approx([0.04, 0.04])


def test_holm_decisions_follow_the_sign_of_the_difference():
    tests = [paired_test([0.1, 0.2, 0.15, 0.12], [0.5, 0.61, 0.55, 0.5]),  # a < b clearly
             paired_test([0.9, 0.8, 0.85, 0.95], [0.1, 0.2, 0.15, 0.12]),  # a > b clearly
             paired_test([0.1, 0.5, 0.2, 0.4], [0.3, 0.3, 0.3, 0.3]),  # no difference
             paired_test([0.1], [0.2])]  # one repetition: not testable
    assert holm_decisions(tests) == ["lower", "higher", "not distinguishable", "not distinguishable"]


def _simulate(rng, reps, effect, base_sd=0.2, noise_sd=0.02, rows=4):
    """``rows`` rows x ``reps`` repetitions: value = row mean + the repetition's base-network effect
    (shared by every row of that repetition) + the row's own noise; row 0 lower by ``effect``."""
    base = rng.normal(0.0, base_sd, reps)
    values = 0.5 + base + rng.normal(0.0, noise_sd, (rows, reps))
    values[0] -= effect
    return values


@pytest.mark.slow  # Monte Carlo over thousands of simulated families
def test_family_wise_error_is_controlled_and_pairing_gives_power():
    """Rows that share each repetition's base networks: under no difference, Holm over a claim's 3
    comparisons (row 0 against rows 1-3, dependent tests) rejects at most ~5% of the time; with a
    real difference of 0.1 (half the base-to-base spread), 5 paired repetitions find it
    while independent 95% intervals of the two rows (the previous rule) almost never separate."""
    rng = np.random.default_rng(1)

    def claim(values):
        return holm_decisions([paired_test(values[0], values[r]) for r in range(1, len(values))])

    null = [claim(_simulate(rng, 5, 0.0)) for _ in range(1000)]
    fwer = np.mean([any(d != "not distinguishable" for d in ds) for ds in null])
    assert fwer <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / 1000), fwer  # 0.05 + 3 Monte Carlo sd
    found, separated = [], []
    for _ in range(300):
        values = _simulate(rng, 5, 0.1)
        found.append(all(d == "lower" for d in claim(values)))
        (a, ha), (b, hb) = interval(values[0]), interval(values[1])
        separated.append(a + math.hypot(ha, hb) < b)
    assert np.mean(found) > 0.9 and np.mean(separated) < 0.1, (np.mean(found), np.mean(separated))


# --- distribution-free tests, unpaired comparisons, power -------------------------------------

from statsmodels.stats.power import TTestPower  # noqa: E402

from metrics.uncertainty import (  # noqa: E402
    compare_rows, min_exact_p, permutation_p, reachable, repetitions_for_power, repetitions_to_reach, sign_flip_p,
    t_power,
)


def _mean_difference(x, y, axis=-1):
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_sign_flip_p_equals_scipy_permutation_test_of_pairs(n):
    rng = np.random.default_rng(n)
    for shift in (0.0, 0.4, 2.0):
        a, b = rng.normal(shift, 1, n), rng.normal(0, 1, n)
        expected = stats.permutation_test((a, b), _mean_difference, permutation_type="samples", vectorized=True,
                                          n_resamples=10 ** 6).pvalue
        assert sign_flip_p(a - b) == pytest.approx(expected, rel=1e-12), (n, shift)
        assert compare_rows(a, b, paired=True).exact_p == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("sizes", [(2, 3), (4, 4), (5, 5), (3, 7)])
def test_permutation_p_equals_scipy_permutation_test_of_independent_samples(sizes):
    rng = np.random.default_rng(sum(sizes))
    for shift in (0.0, 0.7, 3.0):
        a, b = rng.normal(shift, 1, sizes[0]), rng.normal(0, 1, sizes[1])
        expected = stats.permutation_test((a, b), _mean_difference, permutation_type="independent", vectorized=True,
                                          n_resamples=10 ** 6).pvalue
        assert permutation_p(a, b) == pytest.approx(expected, rel=1e-12), (sizes, shift)


@pytest.mark.slow  # scipy's exact null over 2^20 sign patterns
def test_random_draws_above_the_exact_limit_agree_with_scipy_within_monte_carlo_error():
    rng = np.random.default_rng(3)
    d = rng.normal(0.3, 1, 20)  # 2^20 sign patterns > EXACT_LIMIT: drawn at random
    exact = stats.permutation_test((d, np.zeros(20)), _mean_difference, permutation_type="samples", vectorized=True,
                                   n_resamples=2 ** 20).pvalue
    assert sign_flip_p(d) == pytest.approx(exact, abs=4 * math.sqrt(exact * (1 - exact) / 100_000) + 1e-5)
    a, b = rng.normal(0.8, 1, 12), rng.normal(0, 1, 12)  # C(24, 12) splits: drawn at random
    expected = stats.permutation_test((a, b), _mean_difference, permutation_type="independent", vectorized=True,
                                      n_resamples=400_000, random_state=1).pvalue
    assert permutation_p(a, b) == pytest.approx(expected, abs=4 * math.sqrt(expected * (1 - expected) / 100_000) + 1e-4)


def test_the_smallest_exact_p_values_and_the_repetitions_that_reach_a_level():
    """5 pairs cannot give p < 0.0625 (all differences one sign: 2 of 32 patterns as extreme);
    5 + 5 independent values can give 2 / 252; 6 pairs reach 0.05, 9 reach 0.05 / 12."""
    assert min_exact_p(5) == 2 / 32 and min_exact_p(5, 5) == 2 / 252 and min_exact_p(1) == 1.0
    assert sign_flip_p([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx(0.0625)
    assert permutation_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert repetitions_to_reach(0.05, paired=True) == 6 and repetitions_to_reach(0.05 / 12, paired=True) == 9
    assert repetitions_to_reach(0.05, paired=False) == 4 and repetitions_to_reach(0.05 / 12, paired=False) == 6
    for level in (0.05, 0.01, 0.05 / 20):
        n = repetitions_to_reach(level, paired=True)
        assert 2 / 2 ** n <= level < 2 / 2 ** (n - 1)
        m = repetitions_to_reach(level, paired=False)
        assert 2 / math.comb(2 * m, m) <= level < 2 / math.comb(2 * m - 2, m - 1)
    with pytest.raises(ValueError, match="level"):
        repetitions_to_reach(0.0, paired=True)


def test_reachable_applies_holm_to_the_smallest_p_values():
    """One paired comparison of 5 repetitions cannot reach 0.05; a family of 12 unpaired 5 + 5
    comparisons cannot either (Holm's first threshold 0.05 / 12 < 2 / 252), a family of 6 can."""
    assert not reachable([min_exact_p(5)]).any()
    assert not reachable([min_exact_p(5, 5)] * 12).any() and reachable([min_exact_p(5, 5)] * 6).all()
    assert list(reachable([min_exact_p(6), min_exact_p(5)])) == [False, False]  # 2 x 2/64 > 0.05 at Holm's first step
    assert list(reachable([min_exact_p(8), min_exact_p(5, 5)])) == [True, True]


def test_compare_rows_paired_is_ttest_rel_and_unpaired_is_welch():
    rng = np.random.default_rng(7)
    a, b = rng.normal(0, 1, 6), rng.normal(0.5, 2, 6)
    paired, unpaired = compare_rows(a, b, paired=True), compare_rows(a, b, paired=False)
    rel, welch = stats.ttest_rel(a, b), stats.ttest_ind(a, b, equal_var=False)
    assert paired.paired and paired.t_p == pytest.approx(rel.pvalue, rel=1e-10)
    assert paired.statistic == pytest.approx(rel.statistic, rel=1e-10) and paired.df == 5
    assert not unpaired.paired and unpaired.t_p == pytest.approx(welch.pvalue, rel=1e-10)
    assert unpaired.statistic == pytest.approx(welch.statistic, rel=1e-10)
    assert unpaired.df == pytest.approx(welch.df, rel=1e-10)
    low, high = welch.confidence_interval(0.95)
    assert unpaired.half_width == pytest.approx((high - low) / 2, rel=1e-10)
    assert unpaired.mean == pytest.approx(a.mean() - b.mean())
    assert compare_rows([1.0, np.nan, 3.0], [2.0, 2.0, 4.0], paired=False).n_a == 2
    lonely = compare_rows([1.0], [2.0, 3.0], paired=False)
    assert not lonely.testable and math.isnan(lonely.exact_p)
    with pytest.raises(ValueError, match="shapes"):
        compare_rows([1.0, 2.0], [1.0, 2.0, 3.0], paired=True)


def test_t_power_equals_statsmodels_and_a_simulation():
    """Paired: statsmodels' TTestPower (one-sample t on the differences); Welch: a simulation of
    scipy's ttest_ind(equal_var=False)."""
    for effect, n, level in ((0.5, 5, 0.05), (1.2, 8, 0.01), (2.0, 4, 0.05 / 12), (0.0, 10, 0.05)):
        expected = TTestPower().power(effect_size=effect, nobs=n, alpha=level, alternative="two-sided")
        assert t_power(effect * 0.3, 0.3, 0.3, True, level, (n, n)) == pytest.approx(expected, rel=1e-8)
    rng = np.random.default_rng(11)
    mean, sd_a, sd_b, n, level = 1.0, 0.8, 1.6, 6, 0.05
    draws = 20_000
    x, y = rng.normal(mean, sd_a, (draws, n)), rng.normal(0.0, sd_b, (draws, n))
    simulated = np.mean(stats.ttest_ind(x, y, axis=1, equal_var=False).pvalue <= level)
    # the noncentral-t form is an approximation for Welch's test (df estimated): within 0.02
    assert t_power(mean, sd_a, sd_b, False, level, (n, n)) == pytest.approx(simulated, abs=0.02)


def test_repetitions_for_power_is_the_first_n_with_enough_power_and_a_reachable_exact_test():
    rng = np.random.default_rng(5)
    base = rng.normal(0, 1, 5)
    test = compare_rows(base + rng.normal(-0.6, 0.5, 5), base, paired=True)
    effect = abs(test.mean) / test.sd_a
    n = repetitions_for_power(test, 0.05)
    by_statsmodels = TTestPower().solve_power(effect_size=effect, alpha=0.05, power=0.8, alternative="two-sided")
    assert n == max(math.ceil(by_statsmodels), 6)
    assert test.power(0.05, n=int(n)) >= 0.8 and (n == 6 or test.power(0.05, n=int(n) - 1) < 0.8)
    assert repetitions_for_power(test, 0.05, mean=0.0) == math.inf
    huge = compare_rows(base - 10.0 + rng.normal(0, 0.01, 5), base, paired=True)
    assert repetitions_for_power(huge, 0.05) == 6  # power is ~1 at 2 pairs: the sign-flip floor decides
    assert repetitions_for_power(huge, 0.05 / 12) == 9
