"""Uncertainty of every mean kvlab reports over prompts or seeds: pure functions over lists of numbers.

* ``mean_interval``: the mean, n and a 95% interval over continuous values. Below ``SMALL_N`` values
  (15) the Student t interval (mean ± t s / sqrt(n)); from ``SMALL_N`` on, the percentile bootstrap
  (scipy.stats.bootstrap, a fixed seed so that the same values always give the same interval). No BCa:
  at n = 4 to 12 it covers about 80 to 90% of the time, not 95%.
* ``binomial_interval``: the exact (Clopper-Pearson) interval of a proportion, k successes in n
  (scipy.stats.binomtest(...).proportion_ci): for accuracy, each prompt right or wrong.
* ``score_interval``: whichever of the two fits a list of task scores: the exact binomial interval
  when every score is 0 or 1 (accuracy), ``mean_interval`` otherwise (RULER's share of references found),
  cut to [0, 1].
* ``paired_difference``: two methods on the same prompts, the mean of their per-prompt differences
  with its interval, and a direction called only when the data support it: for two right-or-wrong
  scores the exact two-sided McNemar test (``mcnemar_p``) with ``paired_binary_interval``, which
  excludes zero exactly when that test rejects; for continuous scores the paired t interval (or the
  bootstrap from ``SMALL_N`` prompts on).

No interval is made up where the data give none: no values give no estimate; one value, or values
that do not vary at all, give the mean with no interval and ``note`` saying why (an interval of zero
width would claim a certainty that two equal numbers cannot give). The ``min_n_*`` functions say
how many prompts a test needs before it can pass at all, so that a row below that n can say it is
inconclusive by design.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
SEED = 0  # the bootstrap's generator: the same values give the same interval, run after run
RESAMPLES = 9999  # scipy's default
SMALL_N = 15  # below this many values a continuous mean gets the t interval, not a bootstrap
INCONCLUSIVE = "inconclusive"
NO_SPREAD = "the values do not vary: no spread to base an interval on"
ONE_VALUE = "one value: no interval"
Values = Sequence[float] | np.ndarray  # per-prompt numbers


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its interval (``low``/``high`` None where the data give none: ``note``
    says why). ``p_value``: the two-sided p value of the test the interval inverts, where there is one
    (a paired comparison against zero)."""

    mean: float
    n: int
    low: float | None
    high: float | None
    method: str  # "student-t", "bootstrap", "clopper-pearson", "mcnemar-exact" or "none"
    confidence: float = CONFIDENCE
    note: str = ""
    p_value: float | None = None

    def as_dict(self, scale: float = 1.0) -> dict:
        """JSON-able: mean, n, low, high (scaled, e.g. by 100 for a 0-100 score), method, confidence, and the
        note and p value where there are any."""
        out = {
            "mean": self.mean * scale,
            "n": self.n,
            "low": None if self.low is None else self.low * scale,
            "high": None if self.high is None else self.high * scale,
            "method": self.method,
            "confidence": self.confidence,
        }
        if self.note:
            out["note"] = self.note
        if self.p_value is not None:
            out["p_value"] = self.p_value
        return out

    def excludes(self, value: float) -> bool:
        """True when the interval exists and lies wholly above or below ``value``."""
        return self.low is not None and self.high is not None and (self.low > value or self.high < value)

    def text(self, scale: float = 1.0, digits: int = 2) -> str:
        """``0.70 [0.35, 0.93] (n = 10)``; without an interval ``0.70 (n = 1)``; a p value where there is one."""
        f = f"{{:.{digits}f}}"
        head = f.format(self.mean * scale)
        p = "" if self.p_value is None else f", p = {self.p_value:.3g}"
        if self.low is None or self.high is None:
            return f"{head} (n = {self.n}{p}; no interval)" if self.n > 1 else f"{head} (n = {self.n})"
        return f"{head} [{f.format(self.low * scale)}, {f.format(self.high * scale)}] (n = {self.n}{p})"


def _values(values: Values) -> np.ndarray:
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("statistics: the values must be finite numbers (a missing score is not a zero)")
    return x


def _constant(x: np.ndarray) -> bool:
    """True when the values are equal up to rounding (0.3 - 0.2 and 0.2 - 0.1 are the same difference)."""
    return bool(np.ptp(x) <= 1e-9 * max(1.0, float(np.abs(x).max())))


def _rng_kw(seed: int) -> dict:
    """scipy renamed the bootstrap's generator argument (``random_state`` -> ``rng``, 1.15)."""
    name = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"
    return {name: np.random.default_rng(seed)}


def t_interval(x: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The Student t interval of the mean of ``x`` (n >= 2, not all equal) and the two-sided p value of the
    one-sample t test against zero."""
    n = x.size
    mean, se = float(x.mean()), float(x.std(ddof=1)) / math.sqrt(n)
    half = float(stats.t.ppf(1 - (1 - confidence) / 2, n - 1)) * se
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    return mean - half, mean + half, p


def mean_interval(
    values: Values, confidence: float = CONFIDENCE, seed: int = SEED, resamples: int = RESAMPLES
) -> Estimate | None:
    """The mean of ``values`` with n and its interval (None when there are none): the t interval below
    ``SMALL_N`` values, the percentile bootstrap from there on; no interval for one value or values that
    do not vary (``note`` says so)."""
    x = _values(values)
    if not x.size:
        return None
    mean = float(x.mean())
    if x.size < 2:
        return Estimate(mean, 1, None, None, "none", confidence, ONE_VALUE)
    if _constant(x):
        return Estimate(mean, int(x.size), None, None, "none", confidence, NO_SPREAD)
    if x.size < SMALL_N:
        low, high, _ = t_interval(x, confidence)
        return Estimate(mean, int(x.size), low, high, "student-t", confidence)
    res = stats.bootstrap(
        (x,), np.mean, n_resamples=resamples, confidence_level=confidence, method="percentile", **_rng_kw(seed)
    )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Estimate(mean, int(x.size), low, high, "bootstrap", confidence)


def binomial_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> Estimate | None:
    """The proportion ``successes / n`` with its exact (Clopper-Pearson) interval (None when n = 0)."""
    if n <= 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"statistics: {successes} successes out of {n} is not a proportion")
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return Estimate(successes / n, int(n), float(ci.low), float(ci.high), "clopper-pearson", confidence)


def score_interval(
    values: Values, confidence: float = CONFIDENCE, seed: int = SEED, resamples: int = RESAMPLES
) -> Estimate | None:
    """Task scores over prompts (each in [0, 1]): the exact binomial interval when each is 0 or 1, else
    ``mean_interval`` cut to [0, 1]."""
    x = _values(values)
    if x.size and np.isin(x, (0.0, 1.0)).all():
        return binomial_interval(int(x.sum()), int(x.size), confidence)
    est = mean_interval(x, confidence, seed, resamples)
    if est is None or est.low is None or est.high is None:
        return est
    return Estimate(est.mean, est.n, max(0.0, est.low), min(1.0, est.high), est.method, confidence, est.note)


def mcnemar_p(a_only: int, b_only: int) -> float:
    """The exact two-sided McNemar test: the binomial test of ``a_only`` successes in the ``a_only + b_only``
    prompts where the two differ, at one half (1 when they never differ)."""
    m = a_only + b_only
    return 1.0 if m == 0 else float(stats.binomtest(a_only, m, 0.5).pvalue)


def paired_binary_interval(a: Values, b: Values, confidence: float = CONFIDENCE) -> Estimate | None:
    """Two 0/1 scores per prompt (right or wrong, a and b on the same prompts): the mean of a - b with an
    interval that agrees with the exact McNemar test.

    The difference is (2p - 1) q, with q the share of prompts on which the two differ and p the share of
    those that a gets right. p has its exact (Clopper-Pearson) interval given the m prompts that differ,
    which excludes one half exactly when the two-sided exact McNemar test rejects at 1 - ``confidence``
    (the binomial at one half is symmetric); q its Clopper-Pearson interval over the n prompts; the
    interval spans (2p - 1) q over the corners of both, so it excludes zero exactly when McNemar's test
    rejects, and it is wide when few prompts differ (0 of 10: [-0.31, 0.31]). Its exact coverage is at
    least 95% (enumerated in tests/test_statistics.py). ``p_value``: McNemar's."""
    x, y = _values(a), _values(b)
    n = int(x.size)
    if not n:
        return None
    k, j = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    m = k + j
    p_value = mcnemar_p(k, j)
    if n < 2:
        return Estimate(float(x[0] - y[0]), 1, None, None, "none", confidence, ONE_VALUE, p_value)
    q = binomial_interval(m, n, confidence)
    p = binomial_interval(k, m, confidence) if m else None
    assert q is not None and q.low is not None and q.high is not None
    p_low, p_high = (0.0, 1.0) if p is None or p.low is None or p.high is None else (p.low, p.high)
    corners = [(2 * pp - 1) * qq for pp in (p_low, p_high) for qq in (q.low, q.high)]
    return Estimate((k - j) / n, n, min(corners), max(corners), "mcnemar-exact", confidence, p_value=p_value)


@dataclass(frozen=True)
class PairedDifference:
    """Method a against method b on the same prompts: the mean of a - b with its paired interval."""

    difference: Estimate
    verdict: str  # "a higher", "b higher" or "inconclusive"

    @property
    def called(self) -> bool:
        return self.verdict != INCONCLUSIVE

    def as_dict(self, scale: float = 1.0) -> dict:
        return {**self.difference.as_dict(scale), "verdict": self.verdict}


def is_binary(*values: Values) -> bool:
    """True when every value of every list is 0 or 1 (right-or-wrong scores)."""
    return all(np.isin(_values(v), (0.0, 1.0)).all() for v in values)


def paired_difference(
    a: Values,
    b: Values,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
    resamples: int = RESAMPLES,
    names: tuple[str, str] = ("a", "b"),
) -> PairedDifference | None:
    """``a`` and ``b`` measured on the same prompts (same order): the mean of a_i - b_i and its paired
    interval: ``paired_binary_interval`` (exact McNemar) for right-or-wrong scores, ``mean_interval`` of
    the differences otherwise (the paired t interval below ``SMALL_N`` prompts). The verdict names the
    higher one only when the interval excludes zero; otherwise "inconclusive" (one prompt, or differences
    that do not vary, too). None when there are no prompts."""
    x, y = _values(a), _values(b)
    if x.shape != y.shape:
        raise ValueError(f"statistics: a paired comparison needs the same prompts ({x.size} values against {y.size})")
    binary = x.size > 0 and is_binary(x, y)
    est = paired_binary_interval(x, y, confidence) if binary else mean_interval(x - y, confidence, seed, resamples)
    if est is None:
        return None
    if est.method == "student-t":  # the paired t test's p value
        est = replace(est, p_value=t_interval(x - y, confidence)[2])
    if est.excludes(0.0):
        verdict = f"{names[0]} higher" if est.mean > 0 else f"{names[1]} higher"
    else:
        verdict = INCONCLUSIVE
    return PairedDifference(est, verdict)


def min_n_mcnemar(confidence: float = CONFIDENCE) -> int:
    """The fewest prompts on which the exact two-sided McNemar test can reject: every one of them differing,
    all the same way (6 at 95%: p = 2 / 2^6 = 0.031)."""
    m = 1
    while mcnemar_p(m, 0) >= 1 - confidence:
        m += 1
    return m


def min_n_paired_within(margin: float, confidence: float = CONFIDENCE) -> int:
    """The fewest prompts on which ``paired_binary_interval`` can lie wholly below ``margin`` (the two never
    differing: the interval is ± the upper end of 0 of n): 17 for a margin of 0.2 at 95%."""
    n = 1
    while (binomial_interval(0, n, confidence).high or 1.0) >= margin:  # type: ignore[union-attr]
        n += 1
    return n


def min_n_proportion_above(threshold: float, confidence: float = CONFIDENCE) -> int:
    """The fewest prompts on which a Clopper-Pearson interval can lie wholly above ``threshold``: every prompt
    right, whose lower end is ((1 - confidence) / 2)^(1/n)."""
    n = 1
    while (binomial_interval(n, n, confidence).low or 0.0) <= threshold:  # type: ignore[union-attr]
        n += 1
    return n


MIN_N_CONTINUOUS = 2  # a t interval can exclude a value from two values on, where they differ a little


__all__ = [
    "CONFIDENCE",
    "INCONCLUSIVE",
    "MIN_N_CONTINUOUS",
    "NO_SPREAD",
    "SMALL_N",
    "Estimate",
    "PairedDifference",
    "Values",
    "binomial_interval",
    "is_binary",
    "mcnemar_p",
    "mean_interval",
    "min_n_mcnemar",
    "min_n_paired_within",
    "min_n_proportion_above",
    "paired_binary_interval",
    "paired_difference",
    "score_interval",
    "t_interval",
]
