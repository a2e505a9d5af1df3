"""kvlab.core.statistics against textbook cases: Clopper-Pearson, the t interval at small n, the exact
McNemar test and an interval that agrees with it, no zero-width interval from values that do not vary."""

import itertools

import numpy as np
import pytest
from scipy import stats

from kvlab.core import statistics as st


def test_seven_of_ten_gives_the_exact_clopper_pearson_interval():
    est = st.binomial_interval(7, 10)
    assert (est.mean, est.n, est.method) == (0.7, 10, "clopper-pearson")
    # the textbook values: the 0.025 / 0.975 quantiles of Beta(7, 4) and Beta(8, 3)
    assert est.low == pytest.approx(0.3475, abs=1e-4) and est.high == pytest.approx(0.9333, abs=1e-4)
    assert st.score_interval([1, 0, 1, 1, 0, 1, 1, 1, 0, 1]) == est  # 0/1 scores are accuracy: the same interval
    assert est.text(100, 1) == "70.0 [34.8, 93.3] (n = 10)"


def test_below_fifteen_values_a_mean_gets_the_student_t_interval():
    # n = 4: mean 2.5, s = 1.2910, t(0.975, 3) = 3.1824: 2.5 ± 2.0543
    est = st.mean_interval([1.0, 2.0, 3.0, 4.0])
    assert est.method == "student-t" and est.n == 4
    assert est.low == pytest.approx(0.4457, abs=1e-4) and est.high == pytest.approx(4.5543, abs=1e-4)
    values = [0.25, 0.5, 0.75, 1.0, 0.0, 0.5, 0.25, 0.75]  # shares of references found: not accuracy
    share = st.score_interval(values)
    assert share.method == "student-t" and 0.0 <= share.low < 0.5 < share.high <= 1.0


def test_from_fifteen_values_the_percentile_bootstrap_reproducibly():
    rng = np.random.default_rng(3)
    values = rng.exponential(size=20)
    est = st.mean_interval(values)
    assert est.method == "bootstrap" and est.n == 20 and est.low < est.mean < est.high
    assert st.mean_interval(values) == est  # a fixed seed: the same values, the same interval


def test_values_that_do_not_vary_get_no_interval_and_say_so():
    assert st.mean_interval([]) is None and st.binomial_interval(0, 0) is None
    one = st.mean_interval([0.4])
    assert (one.n, one.low, one.high) == (1, None, None) and one.text() == "0.40 (n = 1)"
    same = st.mean_interval([0.3, 0.3, 0.3])
    assert (same.low, same.high, same.method) == (None, None, "none") and "do not vary" in same.note
    assert same.text() == "0.30 (n = 3; no interval)"
    with pytest.raises(ValueError):
        st.mean_interval([0.1, float("nan")])


def test_equal_paired_differences_give_no_zero_width_interval():
    # 0.3 - 0.2 and 0.2 - 0.1: the same difference up to rounding, at n = 2; no direction can be called
    d = st.paired_difference([0.2, 0.3], [0.1, 0.2])
    assert d.verdict == "inconclusive" and d.difference.low is None and d.difference.high is None
    assert d.difference.mean == pytest.approx(0.1) and "do not vary" in d.difference.note


def test_six_of_six_is_decided_by_the_exact_mcnemar_test():
    six = st.paired_difference([1] * 6, [0] * 6, names=("streaming", "balancekv"))
    assert six.difference.p_value == pytest.approx(0.03125)  # 2 x (1/2)^6
    assert six.verdict == "streaming higher" and six.difference.low > 0 and six.difference.high == 1.0
    five = st.paired_difference([1] * 5, [0] * 5)
    assert five.difference.p_value == pytest.approx(0.0625) and five.verdict == "inconclusive"
    assert st.min_n_mcnemar() == 6
    # the prompts where both agree do not enter the test: 6 of 6 differing among 20 prompts
    mixed = st.paired_difference([1] * 6 + [1] * 7 + [0] * 7, [0] * 6 + [1] * 7 + [0] * 7)
    assert mixed.difference.p_value == pytest.approx(0.03125) and mixed.called


def test_the_paired_interval_excludes_zero_exactly_when_mcnemar_rejects():
    for n in range(2, 13):
        for k, j in itertools.product(range(n + 1), repeat=2):
            if k + j > n:
                continue
            a = [1] * k + [0] * j + [1] * (n - k - j)
            b = [0] * k + [1] * j + [1] * (n - k - j)
            est = st.paired_binary_interval(a, b)
            assert est.excludes(0.0) == (est.p_value < 0.05), (n, k, j)


def _coverage(pa: float, pb: float, n: int) -> float:
    """The exact probability that the paired interval covers pa - pb (a right only with probability pa, b
    right only with pb), summed over every outcome of n prompts."""
    total = 0.0
    for k in range(n + 1):
        for j in range(n + 1 - k):
            prob = stats.multinomial.pmf([k, j, n - k - j], n, [pa, pb, 1 - pa - pb])
            est = st.paired_binary_interval([1] * k + [0] * (n - k), [0] * k + [1] * j + [0] * (n - k - j))
            total += prob if est.low - 1e-12 <= pa - pb <= est.high + 1e-12 else 0.0
    return total


def test_the_paired_interval_covers_at_least_95_percent():
    for pa, pb in [(0.0, 0.0), (0.1, 0.0), (0.3, 0.1), (0.5, 0.5), (0.45, 0.05), (0.2, 0.2)]:
        assert _coverage(pa, pb, 10) >= 0.95, (pa, pb)


def test_a_margin_needs_enough_prompts_to_pass():
    # ten prompts that all agree: the difference could still be up to 0.31 either way
    agree = st.paired_difference([1] * 10, [1] * 10)
    assert agree.difference.high == pytest.approx(1 - 0.025**0.1) and agree.difference.low == -agree.difference.high
    assert st.min_n_paired_within(0.2) == 17
    assert st.paired_difference([1] * 17, [1] * 17).difference.high < 0.2
    assert st.min_n_proportion_above(0.8) == 17  # 0.025^(1/17) = 0.805


def test_a_continuous_paired_difference_is_the_paired_t_interval():
    a = [1.2, 0.9, 1.4, 1.1, 1.3]
    b = [1.0, 0.8, 1.0, 1.0, 1.1]
    d = st.paired_difference(a, b, names=("x", "y"))
    t = stats.ttest_rel(a, b)
    assert d.difference.method == "student-t" and d.difference.p_value == pytest.approx(t.pvalue)
    assert d.verdict == "x higher"
    c = [1, 0, 1, 0, 1, 1, 0, 1]
    e = [0, 1, 1, 0, 1, 0, 1, 1]  # the same total, the wins split
    assert st.paired_difference(c, e).verdict == "inconclusive"
    with pytest.raises(ValueError):
        st.paired_difference([1, 0], [1])
