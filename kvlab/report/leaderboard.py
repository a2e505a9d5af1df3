"""The leaderboard view of a sweep: each method's task scores against the compression ratio.

kvpress's leaderboard convention: the **compression ratio** is the fraction of the cache removed
(0.25-0.875), so a method at ratio 0.75 keeps a quarter. kvlab's **budget** is the fraction kept,
of the exact cache's bytes: ratio = 1 - budget. (For evicting methods the bytes kept are the tokens
kept; a quantizing method keeps every token in fewer bytes.) Token budgets ("512t") have no ratio
and are left out.

Scores are on RULER's and kvpress's scale, 0-100: the mean ``task_score`` over a task's cells
times 100 (RULER's string match for its tasks, exact match for kvlab's own). ``average`` is the
mean over the tasks that method ran. ``exact`` (nothing removed) is the row at ratio 0.

``rows`` reads the compact cell records of ``kvlab.sweep`` (or, through ``rows_from_results``, a
whole ``results.json``); ``write_csv`` writes kvpress's leaderboard columns (method, ratio, one
score per task, average); ``figure`` draws average score against ratio, one line per method.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go

from kvlab.report.charts import PALETTE


class LeaderboardError(ValueError):
    """A results file without scored runs at fraction budgets."""


@dataclass
class Row:
    """One method at one compression ratio: its mean score (0-100) per task and over the tasks."""

    method: str
    ratio: float  # fraction of the cache removed (kvpress); 0 for exact
    scores: dict[str, float] = field(default_factory=dict)  # task -> mean score, 0-100
    cells: dict[str, int] = field(default_factory=dict)  # task -> prompts scored

    @property
    def budget(self) -> float:
        """kvlab's budget: the fraction of the exact cache kept (1 - ratio)."""
        return round(1.0 - self.ratio, 6)

    @property
    def average(self) -> float:
        return sum(self.scores.values()) / len(self.scores)


def _ratio(budget: str | None) -> float | None:
    """The compression ratio of a budget label ("0.25" -> 0.75); None for a token budget; 0 without one."""
    if budget is None:
        return 0.0
    if str(budget).endswith("t"):
        return None
    return round(1.0 - float(budget), 6)


def rows(recs: list[dict]) -> list[Row]:
    """One ``Row`` per (method, ratio), methods in the order they first appear, ratios ascending."""
    acc: dict[tuple[str, float], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for rec in recs:
        task = rec["cell"]["task"]
        for r in rec["runs"]:
            score, ratio = r["metrics"].get("task_score"), _ratio(r.get("budget"))
            if score is None or ratio is None:
                continue
            method = r["label"].split("@")[0]
            order += [method] if method not in order else []
            acc[(method, ratio)][task].append(float(score))
    out = [
        Row(m, ratio, {t: 100 * sum(v) / len(v) for t, v in per.items()}, {t: len(v) for t, v in per.items()})
        for (m, ratio), per in acc.items()
    ]
    return sorted(out, key=lambda r: (order.index(r.method), r.ratio))


def rows_from_results(data: dict) -> list[Row]:
    """``rows`` of a sweep's ``results.json`` (``LeaderboardError`` when nothing in it can be ranked)."""
    recs = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(recs, list) or not all(isinstance(r, dict) and "runs" in r and "cell" in r for r in recs):
        raise LeaderboardError("not a sweep's results.json: it has no 'cells' list of cell records")
    out = rows(recs)
    if not out:
        raise LeaderboardError(
            "the sweep has no task scores at fraction budgets: run a task with an answer "
            "(e.g. --suite ruler) with --ratios or fraction --budgets"
        )
    return out


def tasks_of(items: list[Row]) -> list[str]:
    """The tasks in the rows, in the order they first appear."""
    return list(dict.fromkeys(t for r in items for t in r.scores))


def csv_text(items: list[Row]) -> str:
    """kvpress's leaderboard columns: method, ratio, one score per task (0-100), average."""
    tasks = tasks_of(items)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "ratio", *tasks, "average"])
    for r in items:
        scores = [f"{r.scores[t]:.2f}" if t in r.scores else "" for t in tasks]
        w.writerow([r.method, f"{r.ratio:g}", *scores, f"{r.average:.2f}"])
    return buf.getvalue()


def write_csv(items: list[Row], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(csv_text(items), encoding="utf-8")
    return path


def table_html(items: list[Row]) -> str:
    """The leaderboard as an HTML table: ratio with kvlab's budget beside it, scores per task, average."""
    import html

    tasks = tasks_of(items)
    head = ["method", "ratio (removed)", "budget (kept)", *tasks, "average"]
    body = []
    for r in sorted(items, key=lambda r: (r.ratio, -r.average)):
        cells = [r.method, f"{r.ratio:g}", f"{r.budget:g}", *(f"{r.scores[t]:.1f}" if t in r.scores else "—"
                 for t in tasks), f"{r.average:.1f}"]  # fmt: skip
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return (
        "<table class='kv-leaderboard'><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join(body)
        + "</table>"
    )


STYLES = (("solid", "circle"), ("dot", "diamond"), ("dashdot", "square"))  # line dash and marker per colour cycle


def figure(items: list[Row], title: str = "Leaderboard: score against compression ratio") -> go.Figure:
    """Average score (0-100) against the compression ratio, one line per method; exact as a dashed line."""
    fig = go.Figure()
    by_method: dict[str, list[Row]] = defaultdict(list)
    for r in items:
        by_method[r.method].append(r)
    ratios = sorted({r.ratio for r in items if r.ratio > 0})
    i = 0
    for method, rs in by_method.items():
        rs = sorted(rs, key=lambda r: r.ratio)
        hover = [f"{method}<br>ratio {r.ratio:g} (budget {r.budget:g} kept)<br>average {r.average:.1f}" for r in rs]
        if method == "exact" and ratios:
            y = rs[0].average
            fig.add_trace(
                go.Scatter(x=[ratios[0], ratios[-1]], y=[y, y], mode="lines", name="exact (ratio 0)",
                           line={"color": "#444", "dash": "dash"}, hovertext=hover * 2, hoverinfo="text")
            )  # fmt: skip
            continue
        cycle = i // len(PALETTE) % len(STYLES)  # past the palette's colours, a line and marker of another style
        fig.add_trace(
            go.Scatter(x=[r.ratio for r in rs], y=[r.average for r in rs], mode="lines+markers", name=method,
                       line={"color": PALETTE[i % len(PALETTE)], "dash": STYLES[cycle][0]},
                       marker={"symbol": STYLES[cycle][1], "size": 8}, hovertext=hover, hoverinfo="text")
        )  # fmt: skip
        i += 1
    fig.update_layout(
        title=title,
        yaxis_title="average score (0-100)",
        xaxis={
            "title": "compression ratio: fraction of the cache removed (kvlab budget kept = 1 - ratio)",
            "tickvals": ratios,
            "ticktext": [f"{x:g}<br>keeps {1 - x:g}" for x in ratios],
        },
        yaxis_range=[-2, 102],
        template="plotly_white",
        height=480,
    )
    return fig
