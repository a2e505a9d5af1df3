"""A leaderboard as an HTML table whose rows are grouped by what paired tests can tell apart.

At each compression ratio the methods are ranked by ``kvlab.report.ranking.rank_board``: every pair tested
on the prompts both ran (exact McNemar for right-or-wrong scores, Wilcoxon signed-rank otherwise),
Holm-corrected over the pairs at that ratio; a method's rank is 1 + the methods separated above it. Rows
that share a rank form one group (one shade): the data cannot order them. A sweep's results.json carries
its ranking (``"ranking"``, written by ``kvlab sweep``); the table reads it from there, and ranks from the
file's per-prompt scores only for a file that does not carry one.
"""

from __future__ import annotations

import html

from kvlab.report.leaderboard import (
    FIDELITY,
    FIDELITY_HEAD,
    Row,
    _cell,
    _fidelity_cell,
    protocol_caption,
    tasks_of,
)
from kvlab.report.ranking import ALPHA, rank_board

METRICS = {
    "task_score": "task score",
    "agreement": "agreement with exact",
    "answer_logprob": "log p(exact's answer)",
}
SHADES = ("#eef4ff", "#ffffff")  # alternate groups of one rank


def rank_metrics(items: list[Row]) -> list[str]:
    """The scores the board can be ranked by: the task score, then each fidelity score it measured."""
    return ["task_score"] + [m for m in FIDELITY if any(r.fidelity_estimate(m) for r in items)]


def method_note(metric: str) -> str:
    """The line under the table: which test, which correction, what a shared rank means."""
    return (
        f"Groups: at each ratio, methods are ranked on {METRICS.get(metric, metric)} by paired tests on the "
        "prompts both ran (the exact McNemar test for right-or-wrong scores, the Wilcoxon signed-rank test "
        f"otherwise), Holm-corrected over every pair at that ratio (family-wise α = {ALPHA}); a method's rank is "
        "1 + the methods separated above it, and methods that share a rank (one shade) are not told apart by "
        "the data. Exact (ratio 0) is ranked with every ratio as the reference."
    )


def stored_rankings(stored: list | None, metric: str) -> dict[float, dict] | None:
    """The rankings a results.json carries for ``metric``, by ratio: {ratio: {"ranks", "means", "separated",
    "pairs_tested"}}; None when it carries none for that score."""
    got = {}
    for rk in stored or []:
        if isinstance(rk, dict) and rk.get("metric") == metric and isinstance(rk.get("ranks"), dict):
            got[round(float(rk["ratio"]), 6)] = {
                "ranks": {str(m): int(v) for m, v in rk["ranks"].items()},
                "means": {str(m): float(v) for m, v in (rk.get("means") or {}).items()},
                "separated": len(rk.get("separated") or []),
                "pairs_tested": int(rk.get("pairs_tested") or 0),
            }
    return got or None


def rankings_of(items: list[Row], metric: str, stored: list | None = None) -> dict[float, dict]:
    """Each ratio's ranks: from the file (``stored``) when it carries them, else from ``rank_board``."""
    from_file = stored_rankings(stored, metric)
    if from_file is not None:
        return from_file
    return {
        round(r.ratio, 6): {
            "ranks": r.ranks,
            "means": r.means,
            "separated": len(r.separated),
            "pairs_tested": len(r.pairs),
        }  # fmt: skip
        for r in rank_board(items, metric)
    }


def grouped_table_html(
    items: list[Row], protocol: str | None = None, metric: str = "task_score", stored: list | None = None
) -> str:
    """The leaderboard as HTML: exact first, then each ratio's methods by rank (groups shaded), each score
    with its 95% interval and n, the fidelity columns where the board has them, and the note on the test.
    ``stored``: the ranking a results.json carries (read, not recomputed)."""
    metric = metric if metric in rank_metrics(items) else "task_score"
    rankings = rankings_of(items, metric, stored)
    tasks = tasks_of(items)
    fid = [m for m in FIDELITY if any(r.fidelity_estimate(m) for r in items)]
    head = [
        "rank", "method", "ratio (removed)", "budget (kept)", *tasks, "average", *(FIDELITY_HEAD[m] for m in fid),
    ]  # fmt: skip
    body = []

    def row_html(r: Row, rank: str, shade: str) -> str:
        scores = [_cell(r.estimate(t), r.scores[t]) if t in r.scores else "—" for t in tasks]
        fidelity = [_fidelity_cell(r.fidelity_estimate(m), m) for m in fid]
        cells = [rank, r.method, f"{r.ratio:g}", f"{r.budget:g}", *scores, _cell(r.average_estimate(), r.average),
                 *fidelity]  # fmt: skip
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        return f"<tr class='kv-rank-row' data-rank='{html.escape(rank)}' style='background:{shade}'>{tds}</tr>"

    for r in (r for r in items if r.ratio == 0):
        body.append(row_html(r, "reference", "#f4f4f5"))
    for ratio in sorted({r.ratio for r in items if r.ratio > 0}):
        ranking = rankings.get(round(ratio, 6)) or {}
        at = [r for r in items if r.ratio == ratio]
        ranks, means = ranking.get("ranks", {}), ranking.get("means", {})
        at.sort(key=lambda r: (ranks.get(r.method, 10**6), -means.get(r.method, r.average / 100)))
        exact_rank = ranks.get("exact")
        sep, tested = ranking.get("separated", 0), ranking.get("pairs_tested", 0)
        note = f"ratio {ratio:g} (keeps {1 - ratio:g}): {len(at)} methods, {sep} of {tested} pairs separated" + (
            f"; exact ranks {exact_rank} here" if exact_rank is not None else ""
        )
        body.append(f"<tr class='kv-ratio-head'><td colspan='{len(head)}'><b>{html.escape(note)}</b></td></tr>")
        shade_of: dict[int, str] = {}
        for r in at:
            rank = ranks.get(r.method)
            if rank is not None and rank not in shade_of:
                shade_of[rank] = SHADES[len(shade_of) % 2]
            body.append(row_html(r, "—" if rank is None else str(rank), shade_of.get(rank or -1, "#ffffff")))
    caption = protocol_caption(protocol)
    return (
        caption
        + "<div class='kv-leaderboard-wrap' style='max-height:640px;overflow-y:auto'>"
        + "<table class='kv-leaderboard'><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join(body)
        + "</table></div>"
        + f"<p class='kv-rank-note' id='kv-rank-note'>{html.escape(method_note(metric))}</p>"
    )


__all__ = ["METRICS", "grouped_table_html", "method_note", "rank_metrics", "rankings_of", "stored_rankings"]
