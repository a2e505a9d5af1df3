"""Uncertainty of every mean kvlab reports over prompts or seeds: pure functions over lists of numbers.

* ``mean_interval``: the mean, n and a 95% bootstrap interval over the values (scipy.stats.bootstrap,
  BCa, a fixed seed so that the same values always give the same interval).
* ``binomial_interval``: the exact (Clopper-Pearson) interval of a proportion, k successes in n
  (scipy.stats.binomtest(...).proportion_ci): for accuracy, each prompt right or wrong.
* ``score_interval``: whichever of the two fits a list of task scores: the exact binomial interval
  when every score is 0 or 1 (accuracy), the bootstrap otherwise (RULER's share of references found).
* ``paired_difference``: two methods on the same prompts, the mean of their per-prompt differences
  with a paired bootstrap interval (an exact interval when both are 0/1 scores: the share of prompts
  where they differ and the split of those, ``paired_binary_interval``); a difference is called only
  when the interval excludes zero, else the comparison reads "inconclusive".

Degenerate cases are answered rather than warned about: no values give no estimate; one value, a
mean with no interval; values all equal (every resample the same) an interval of that one value.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
SEED = 0  # the bootstrap's generator: the same values give the same interval, run after run
RESAMPLES = 9999  # scipy's default
INCONCLUSIVE = "inconclusive"
Values = Sequence[float] | np.ndarray  # per-prompt numbers


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its interval (``low``/``high`` None when n < 2)."""

    mean: float
    n: int
    low: float | None
    high: float | None
    method: str  # "bootstrap", "clopper-pearson", "exact-paired" or "none" (fewer than two values)
    confidence: float = CONFIDENCE

    def as_dict(self, scale: float = 1.0) -> dict:
        """JSON-able: mean, n, low, high (scaled, e.g. by 100 for a 0-100 score), method, confidence."""
        return {
            "mean": self.mean * scale,
            "n": self.n,
            "low": None if self.low is None else self.low * scale,
            "high": None if self.high is None else self.high * scale,
            "method": self.method,
            "confidence": self.confidence,
        }

    def excludes(self, value: float) -> bool:
        """True when the interval exists and lies wholly above or below ``value``."""
        return self.low is not None and self.high is not None and (self.low > value or self.high < value)

    def text(self, scale: float = 1.0, digits: int = 2) -> str:
        """``0.70 [0.35, 0.93] (n = 10)``; without an interval ``0.70 (n = 1)``."""
        f = f"{{:.{digits}f}}"
        head = f.format(self.mean * scale)
        if self.low is None or self.high is None:
            return f"{head} (n = {self.n})"
        return f"{head} [{f.format(self.low * scale)}, {f.format(self.high * scale)}] (n = {self.n})"


def _values(values: Values) -> np.ndarray:
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("statistics: the values must be finite numbers (a missing score is not a zero)")
    return x


def _rng_kw(seed: int) -> dict:
    """scipy renamed the bootstrap's generator argument (``random_state`` -> ``rng``, 1.15)."""
    name = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"
    return {name: np.random.default_rng(seed)}


def _bootstrap(x: np.ndarray, confidence: float, seed: int, resamples: int) -> tuple[float, float]:
    if np.all(x == x[0]):  # every resample has the same mean
        return float(x[0]), float(x[0])
    res = stats.bootstrap(
        (x,), np.mean, n_resamples=resamples, confidence_level=confidence, method="BCa", **_rng_kw(seed)
    )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):  # BCa undefined (e.g. n = 2): the percentile interval
        res = stats.bootstrap(
            (x,), np.mean, n_resamples=resamples, confidence_level=confidence, method="percentile", **_rng_kw(seed)
        )
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return low, high


def mean_interval(
    values: Values, confidence: float = CONFIDENCE, seed: int = SEED, resamples: int = RESAMPLES
) -> Estimate | None:
    """The mean of ``values`` with n and a bootstrap interval over them (None when there are none)."""
    x = _values(values)
    if not x.size:
        return None
    mean = float(x.mean())
    if x.size < 2:
        return Estimate(mean, 1, None, None, "none", confidence)
    low, high = _bootstrap(x, confidence, seed, resamples)
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
    """Task scores over prompts: the exact binomial interval when each is 0 or 1, else the bootstrap."""
    x = _values(values)
    if x.size and np.isin(x, (0.0, 1.0)).all():
        return binomial_interval(int(x.sum()), int(x.size), confidence)
    return mean_interval(x, confidence, seed, resamples)


def paired_binary_interval(a: Values, b: Values, confidence: float = CONFIDENCE) -> Estimate | None:
    """Two 0/1 scores per prompt (right or wrong, a and b on the same prompts): the mean of a - b with an
    exact interval. The difference is (2p - 1) q, with q the share of prompts on which the two differ and p
    the share of those that a gets right (McNemar's setting). Each has its Clopper-Pearson interval at
    half the miss rate (Bonferroni: both hold together with at least ``confidence``), and the difference's
    interval spans (2p - 1) q over both; with no prompt where they differ, p is anything in [0, 1]. Unlike a
    bootstrap, a few prompts that all go one way give a wide interval (4 of 4: [-0.33, 1.00]), not [1, 1]."""
    x, y = _values(a), _values(b)
    n = int(x.size)
    if not n:
        return None
    if n < 2:
        return Estimate(float(x[0] - y[0]), 1, None, None, "none", confidence)
    k, m = int(((x == 1) & (y == 0)).sum()), int((x != y).sum())
    each = 1 - (1 - confidence) / 2
    q = binomial_interval(m, n, each)
    p = binomial_interval(k, m, each) if m else None
    assert q is not None and q.low is not None and q.high is not None
    p_low, p_high = (0.0, 1.0) if p is None or p.low is None or p.high is None else (p.low, p.high)
    corners = [(2 * pp - 1) * qq for pp in (p_low, p_high) for qq in (q.low, q.high)]
    return Estimate((2 * k - m) / n, n, min(corners), max(corners), "exact-paired", confidence)


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


def paired_difference(
    a: Values,
    b: Values,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
    resamples: int = RESAMPLES,
    names: tuple[str, str] = ("a", "b"),
) -> PairedDifference | None:
    """``a`` and ``b`` measured on the same prompts (same order): the mean of a_i - b_i and a paired
    bootstrap interval (the prompts resampled, each keeping its pair). The verdict names the higher
    one only when the interval excludes zero; otherwise "inconclusive" (fewer than two prompts too).
    None when there are no prompts."""
    x, y = _values(a), _values(b)
    if x.shape != y.shape:
        raise ValueError(f"statistics: a paired comparison needs the same prompts ({x.size} values against {y.size})")
    binary = x.size > 1 and np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all()
    est = paired_binary_interval(x, y, confidence) if binary else mean_interval(x - y, confidence, seed, resamples)
    if est is None:
        return None
    if est.excludes(0.0):
        verdict = f"{names[0]} higher" if est.mean > 0 else f"{names[1]} higher"
    else:
        verdict = INCONCLUSIVE
    return PairedDifference(est, verdict)


__all__ = [
    "CONFIDENCE",
    "INCONCLUSIVE",
    "Estimate",
    "PairedDifference",
    "Values",
    "binomial_interval",
    "mean_interval",
    "paired_binary_interval",
    "paired_difference",
    "score_interval",
]
