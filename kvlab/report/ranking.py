"""Which methods of a leaderboard the data tell apart: paired tests on the same prompts, corrected for
the number of pairs, and a rank that follows from them.

At one compression ratio, every pair of methods (A, B) is compared on the prompts both ran, for one
per-prompt score (``Row.paired``): the task score, agreement with exact's answer, or the
log-probability of exact's answer.

* Right-or-wrong scores (every value 0 or 1): the exact two-sided McNemar test, a binomial test on
  the prompts where A and B differ (A right and B wrong against the other way round).
* Other scores: the two-sided Wilcoxon signed-rank test of the per-prompt differences (exact for
  small n, ties and zero differences dropped as scipy's default does).

The p-values of all pairs at one ratio and for one score are a family: Holm's step-down method
keeps the chance of any false separation in the family at most ``ALPHA``. A pair is *separated*
("above" / "below") when its Holm-adjusted p-value is below ``ALPHA``; otherwise it is
"inconclusive". A method's **rank** is 1 + the number of methods separated above it: methods that
no test tells apart share a rank, and a method shares the top rank with every method that is not
separated from the top. A pair of right-or-wrong scores needs at least 6 prompts where they differ,
all one way, before any correction (p = 0.031); with 30 methods at a ratio (plus exact: 465 pairs)
the first pair in Holm's order needs 15 of 15 (p = 6.1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
from scipy import stats

from kvlab.report.leaderboard import Row

ALPHA = 0.05
ABOVE, BELOW, INCONCLUSIVE = "above", "below", "inconclusive"


@dataclass(frozen=True)
class Pair:
    """Method ``a`` against method ``b`` at one ratio on one score, over the ``n`` prompts both ran."""

    a: str
    b: str
    metric: str
    n: int
    mean_difference: float  # mean of a - b over the prompts
    differ: int  # prompts where a and b differ
    a_wins: int  # prompts where a scores higher
    test: str  # "mcnemar-exact", "wilcoxon" or "none" (no prompt where they differ)
    p: float  # the test's two-sided p-value
    p_holm: float = 1.0  # Holm-adjusted over the family
    verdict: str = INCONCLUSIVE  # of a against b: above, below or inconclusive

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def paired_test(a: dict[str, float], b: dict[str, float]) -> tuple[int, float, int, int, str, float]:
    """(n, mean a - b, prompts that differ, prompts a wins, test, p) over the prompts both hold."""
    common = sorted(set(a) & set(b))
    x = np.array([a[k] for k in common], dtype=float)
    y = np.array([b[k] for k in common], dtype=float)
    n = len(common)
    if not n:
        return 0, 0.0, 0, 0, "none", 1.0
    d = x - y
    differ, wins = int((d != 0).sum()), int((d > 0).sum())
    if not differ:
        return n, 0.0, 0, 0, "none", 1.0
    if np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all():
        p = float(stats.binomtest(wins, differ, 0.5).pvalue)  # exact McNemar
        return n, float(d.mean()), differ, wins, "mcnemar-exact", p
    p = float(stats.wilcoxon(d[d != 0]).pvalue)
    return n, float(d.mean()), differ, wins, "wilcoxon", p


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (each at most 1, monotone in Holm's order)."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    adjusted, running = [1.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def pairs(rows: list[Row], metric: str = "task_score", alpha: float = ALPHA) -> list[Pair]:
    """Every pair of the rows (one ratio), tested on ``metric`` and Holm-corrected together."""
    values = {r.method: r.paired(metric) for r in rows}
    raw = []
    for a, b in combinations([r.method for r in rows], 2):
        n, diff, differ, wins, test, p = paired_test(values[a], values[b])
        raw.append(Pair(a, b, metric, n, diff, differ, wins, test, p))
    adjusted = holm([p.p for p in raw])
    out = []
    for pair, p_holm in zip(raw, adjusted):
        verdict = INCONCLUSIVE if p_holm >= alpha else (ABOVE if pair.mean_difference > 0 else BELOW)
        out.append(Pair(**{**pair.as_dict(), "p_holm": p_holm, "verdict": verdict}))
    return out


def ranks(methods: list[str], separated: list[Pair]) -> dict[str, int]:
    """1 + the number of methods separated above each method."""
    above = {m: 0 for m in methods}
    for p in separated:
        if p.verdict == ABOVE:
            above[p.b] += 1
        elif p.verdict == BELOW:
            above[p.a] += 1
    return {m: 1 + above[m] for m in methods}


@dataclass(frozen=True)
class Ranking:
    """One ratio's ranking on one score: each method's rank and mean, and every pair's test."""

    ratio: float
    metric: str
    ranks: dict[str, int]
    means: dict[str, float]
    pairs: list[Pair]

    @property
    def separated(self) -> list[Pair]:
        return [p for p in self.pairs if p.verdict != INCONCLUSIVE]

    def as_dict(self) -> dict:
        return {
            "ratio": self.ratio,
            "metric": self.metric,
            "ranks": self.ranks,
            "means": self.means,
            "separated": [p.as_dict() for p in self.separated],
            "pairs_tested": len(self.pairs),
        }


def rank_board(items: list[Row], metric: str = "task_score", alpha: float = ALPHA) -> list[Ranking]:
    """A ``Ranking`` per compression ratio of the leaderboard (exact, at ratio 0, joins every ratio as the
    reference), for ``metric`` (task_score, agreement, answer_logprob)."""
    exact = [r for r in items if r.ratio == 0]
    out = []
    for ratio in sorted({r.ratio for r in items if r.ratio > 0}):
        at = exact + [r for r in items if r.ratio == ratio]
        at = [r for r in at if r.paired(metric)]
        if len(at) < 2:
            continue
        tested = pairs(at, metric, alpha)
        means = {r.method: float(np.mean(list(r.paired(metric).values()))) for r in at}
        out.append(Ranking(ratio, metric, ranks([r.method for r in at], tested), means, tested))
    return out


def markdown(ranking: Ranking, scale: float = 100.0, digits: int = 1) -> str:
    """The ranking as a Markdown table (rank, method, mean) and the separated pairs below it."""
    lines = ["| rank | method | mean |", "| --- | --- | --- |"]
    for m in sorted(ranking.ranks, key=lambda m: (ranking.ranks[m], -ranking.means[m])):
        lines.append(f"| {ranking.ranks[m]} | `{m}` | {ranking.means[m] * scale:.{digits}f} |")
    sep = ranking.separated
    if sep:
        lines.append("")
        lines.append(f"Separated pairs (Holm-adjusted p < {ALPHA} over {len(ranking.pairs)} pairs):")
        for p in sorted(sep, key=lambda p: p.p_holm):
            hi, lo = (p.a, p.b) if p.verdict == ABOVE else (p.b, p.a)
            wins = p.a_wins if p.verdict == ABOVE else p.differ - p.a_wins
            lines.append(
                f"* `{hi}` above `{lo}`: higher on {wins} of the {p.differ} prompts where they differ "
                f"(n = {p.n}, {p.test}, p = {p.p:.2g}, Holm {p.p_holm:.2g})"
            )
    else:
        lines.append("")
        lines.append(f"No pair separated (Holm-adjusted p < {ALPHA} over {len(ranking.pairs)} pairs).")
    return "\n".join(lines)


__all__ = ["ABOVE", "ALPHA", "BELOW", "INCONCLUSIVE", "Pair", "Ranking", "holm", "markdown", "pairs", "rank_board"]
