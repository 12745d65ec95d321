"""Error bars and paired comparisons: the one-row interval, Student's paired t-test against scipy
and R's published numbers, Holm's procedure against statsmodels, and their size and power on
simulated repetitions that share base networks."""
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
