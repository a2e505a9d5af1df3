"""kvlab.core.statistics: intervals against known cases, and paired comparisons that call a difference
only when the interval excludes zero."""

import pytest

from kvlab.core import statistics as st


def test_seven_of_ten_gives_the_exact_clopper_pearson_interval():
    est = st.binomial_interval(7, 10)
    assert (est.mean, est.n, est.method) == (0.7, 10, "clopper-pearson")
    # the textbook values: the 0.025 / 0.975 quantiles of Beta(7, 4) and Beta(8, 3)
    assert est.low == pytest.approx(0.3475, abs=1e-4) and est.high == pytest.approx(0.9333, abs=1e-4)
    assert st.score_interval([1, 0, 1, 1, 0, 1, 1, 1, 0, 1]) == est  # 0/1 scores are accuracy: the same interval
    assert est.text(100, 1) == "70.0 [34.8, 93.3] (n = 10)"


def test_bootstrap_interval_covers_the_mean_and_is_reproducible():
    values = [0.25, 0.5, 0.75, 1.0, 0.0, 0.5, 0.25, 0.75]  # shares of references found: not accuracy
    est = st.score_interval(values)
    assert est.method == "bootstrap" and est.n == 8 and est.mean == pytest.approx(0.5)
    assert 0.0 <= est.low < 0.5 < est.high <= 1.0
    assert st.mean_interval(values) == est  # a fixed seed: the same values, the same interval
    wider = st.mean_interval(values[:4])
    assert wider.high - wider.low > est.high - est.low  # fewer prompts, a wider interval


def test_degenerate_inputs_are_answered():
    assert st.mean_interval([]) is None and st.binomial_interval(0, 0) is None
    one = st.mean_interval([0.4])
    assert (one.n, one.low, one.high) == (1, None, None) and one.text() == "0.40 (n = 1)"
    same = st.mean_interval([0.3, 0.3, 0.3])
    assert (same.low, same.high) == (0.3, 0.3)
    with pytest.raises(ValueError):
        st.mean_interval([0.1, float("nan")])


def test_a_paired_difference_is_called_only_when_its_interval_excludes_zero():
    a = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    b = [0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0]  # a finds 10 more of 12: the interval lies above zero
    clear = st.paired_difference(a, b, names=("qjl", "snapkv"))
    assert clear.called and clear.verdict == "qjl higher" and clear.difference.low > 0
    assert clear.difference.mean == pytest.approx(10 / 12)
    flipped = st.paired_difference(b, a, names=("snapkv", "qjl"))
    assert flipped.verdict == "qjl higher" and flipped.difference.high < 0
    c = [1, 0, 1, 0, 1, 1, 0, 1]
    d = [0, 1, 1, 0, 1, 0, 1, 1]  # the same total, the wins split: the interval straddles zero
    tie = st.paired_difference(c, d)
    assert not tie.called and tie.verdict == "inconclusive"
    assert tie.difference.low < 0 < tie.difference.high
    with pytest.raises(ValueError):
        st.paired_difference([1, 0], [1])


def test_right_or_wrong_pairs_get_an_exact_interval_not_a_degenerate_bootstrap():
    # 4 of 4 prompts go one way: a bootstrap would answer [1, 1]; here the split 4 of 4 and the share of
    # prompts that differ, 4 of 4, each have a 97.5% Clopper-Pearson interval: the lower end 0.0125 ** (1/4)
    few = st.paired_difference([1, 1, 1, 1], [0, 0, 0, 0], names=("exact", "turboquant"))
    assert few.difference.method == "exact-paired" and few.verdict == "inconclusive"
    assert few.difference.low == pytest.approx(2 * 0.0125**0.25 - 1) and few.difference.high == 1.0
    # 10 of 20 differ, all one way: called, and the upper end is not the observed 0.5 (the share that
    # differs is uncertain too)
    many = st.paired_difference([1] * 20, [1] * 10 + [0] * 10, names=("a", "b"))
    assert many.verdict == "a higher" and many.difference.mean == 0.5
    share = st.binomial_interval(10, 20, 0.975)
    assert many.difference.low == pytest.approx((2 * 0.0125**0.1 - 1) * share.low)
    assert many.difference.high == pytest.approx(share.high)
    # no prompt differs: zero, bounded by the share that could differ (0 of 4 at 97.5%)
    same = st.paired_difference([1, 0, 1, 0], [1, 0, 1, 0])
    assert same.difference.mean == 0 and same.difference.high == pytest.approx(1 - 0.0125**0.25)
    assert same.difference.low == -same.difference.high and same.verdict == "inconclusive"
    # a score that is not 0 or 1: the bootstrap, as before
    assert st.paired_difference([0.5, 1, 1, 1], [0, 0, 0, 0]).difference.method == "bootstrap"
