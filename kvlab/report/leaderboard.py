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
score per task, average) and, after them, the protocol and each mean's n and 95% interval;
``figure`` draws average score against ratio, one line per method, with the intervals as error
bars and the protocol in its title.

Every mean comes with n and a 95% interval (``kvlab.core.statistics``): a task's score over its
prompts has the exact binomial interval when every score is 0 or 1 (single-answer tasks), else a
t interval (below 15 prompts) or a bootstrap over the prompts; the average over tasks is the task's own
estimate when there is one task, else an interval over prompt indices (the i-th prompt of every task
averaged), when every task has the same number of prompts; where those averages do not vary it has no
interval (never one of zero width).

The protocol is kvpress's question: ``query-agnostic`` (the context compressed alone, the question
asked after it: kvpress's leaderboard) or ``query-aware`` (the question inside the compressed
prompt, which flatters the methods that rank by the last queries).
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import plotly.graph_objects as go

from kvlab.core.statistics import Estimate, mean_interval, score_interval
from kvlab.report.charts import PALETTE

FIDELITY = ("agreement", "answer_logprob")  # kvlab.measure.fidelity's per-prompt scores
FIDELITY_SCALE = {"agreement": 100.0, "answer_logprob": 1.0}  # agreement 0-100 as the scores; nats per token
FIDELITY_HEAD = {"agreement": "agreement with exact", "answer_logprob": "log p(exact's answer)"}

PROTOCOL_TEXT = {
    "query-agnostic": "query-agnostic: the context compressed alone, the question asked after (kvpress's protocol)",
    "query-aware": "query-aware: the question inside the compressed prompt (flatters methods that rank by it)",
}


def protocol_of(recs: list[dict]) -> str:
    """The protocol the cells ran under: one name, or the names joined with " + " when they differ."""
    seen = list(dict.fromkeys(str(r.get("protocol", "query-aware")) for r in recs))
    return " + ".join(seen) if seen else "query-aware"


def protocol_text(protocol: str) -> str:
    return PROTOCOL_TEXT.get(protocol, f"protocol {protocol}")


class LeaderboardError(ValueError):
    """A results file without scored runs at fraction budgets."""


@dataclass
class Row:
    """One method at one compression ratio: its mean score (0-100) per task and over the tasks."""

    method: str
    ratio: float  # fraction of the cache removed (kvpress); 0 for exact
    scores: dict[str, float] = field(default_factory=dict)  # task -> mean score, 0-100
    cells: dict[str, int] = field(default_factory=dict)  # task -> prompts scored
    samples: dict[str, list[float]] = field(default_factory=dict)  # task -> each prompt's score, 0-1, in cell order
    prompts: dict[str, list[str]] = field(default_factory=dict)  # task -> each prompt's cell name, as ``samples``
    # fidelity to exact (kvlab.measure.fidelity): metric -> task -> each prompt's value (None: not measured)
    fidelity: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)

    @property
    def budget(self) -> float:
        """kvlab's budget: the fraction of the exact cache kept (1 - ratio)."""
        return round(1.0 - self.ratio, 6)

    @property
    def average(self) -> float:
        return sum(self.scores.values()) / len(self.scores)

    def estimate(self, task: str) -> Estimate | None:
        """The task's mean score (0-1) with n and its 95% interval (None without samples)."""
        xs = self.samples.get(task)
        return score_interval(xs) if xs else None

    def average_estimate(self) -> Estimate | None:
        """The average over tasks with its interval: with one task, that task's own (the exact binomial one
        for right-or-wrong scores); with several, ``mean_interval`` over prompt indices (the i-th prompt of
        every task averaged), cut to [0, 1], and no interval where those averages do not vary (the estimate's
        note says so). None unless every task has the same number of prompts."""
        per = [self.samples.get(t) or [] for t in self.scores]
        if not per or len({len(x) for x in per}) != 1 or not per[0]:
            return None
        if len(per) == 1:
            return score_interval(per[0])
        est = mean_interval([sum(col) / len(col) for col in zip(*per)])
        if est is None or est.low is None or est.high is None:
            return est
        return replace(est, low=max(0.0, est.low), high=min(1.0, est.high))

    def paired(self, metric: str = "task_score") -> dict[str, float]:
        """Each prompt's value of ``metric`` (the task score or a fidelity score) by "task/cell", for pairing
        with another method on the same prompts; prompts where it was not measured are left out."""
        out: dict[str, float] = {}
        for task, names in self.prompts.items():
            values = self.samples[task] if metric == "task_score" else self.fidelity.get(metric, {}).get(task, [])
            out.update({f"{task}/{n}": float(v) for n, v in zip(names, values) if v is not None})
        return out

    def fidelity_estimate(self, metric: str) -> Estimate | None:
        """``metric``'s mean over every prompt of every task, with n and its 95% interval (None: not measured)."""
        xs = list(self.paired(metric).values())
        if not xs:
            return None
        return score_interval(xs) if metric == "agreement" else mean_interval(xs)

    def as_dict(self) -> dict:
        """JSON-able: each task's and the average's mean (0-100), n, 95% interval and method; the fidelity
        scores (agreement 0-100, answer log-probability in nats) over all prompts."""
        tasks = {t: (e.as_dict(100) if (e := self.estimate(t)) else None) for t in self.scores}
        avg = self.average_estimate()
        fid = {m: (e.as_dict(FIDELITY_SCALE[m]) if (e := self.fidelity_estimate(m)) else None) for m in FIDELITY}
        return {
            "method": self.method,
            "ratio": self.ratio,
            "budget": self.budget,
            "tasks": tasks,
            "average": avg.as_dict(100) if avg else {"mean": self.average, "n": None, "low": None, "high": None},
            "fidelity": fid,
        }


def _ratio(budget: str | None) -> float | None:
    """The compression ratio of a budget label ("0.25" -> 0.75); None for a token budget; 0 without one."""
    if budget is None:
        return 0.0
    if str(budget).endswith("t"):
        return None
    return round(1.0 - float(budget), 6)


def rows(recs: list[dict]) -> list[Row]:
    """One ``Row`` per (method, ratio), methods in the order they first appear, ratios ascending."""
    acc: dict[tuple[str, float], dict[str, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for rec in recs:
        task, cell = rec["cell"]["task"], _cell_name(rec["cell"])
        for r in rec["runs"]:
            m, ratio = r["metrics"], _ratio(r.get("budget"))
            if m.get("task_score") is None or ratio is None:
                continue
            method = r["label"].split("@")[0]
            order += [method] if method not in order else []
            acc[(method, ratio)][task].append((cell, float(m["task_score"]), *(m.get(k) for k in FIDELITY)))
    out = [
        Row(
            m,
            ratio,
            {t: 100 * sum(x[1] for x in v) / len(v) for t, v in per.items()},
            {t: len(v) for t, v in per.items()},
            {t: [x[1] for x in v] for t, v in per.items()},
            {t: [x[0] for x in v] for t, v in per.items()},
            {k: {t: [x[2 + i] for x in v] for t, v in per.items()} for i, k in enumerate(FIDELITY)},
        )
        for (m, ratio), per in acc.items()
    ]
    return sorted(out, key=lambda r: (order.index(r.method), r.ratio))


def _cell_name(cell: dict) -> str:
    """A prompt's name within its task: length, depth and seed."""
    return f"{cell.get('length')}-d{cell.get('depth', 0.5):g}-s{cell.get('seed')}"


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


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def csv_text(items: list[Row], protocol: str = "query-aware") -> str:
    """kvpress's leaderboard columns (method, ratio, one score per task (0-100), average), then the protocol
    and, per task and for the average, n and the 95% interval (``TASK_n``, ``TASK_low``, ``TASK_high``)."""
    tasks = tasks_of(items)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    extra = [f"{t}_{k}" for t in [*tasks, "average"] for k in ("n", "low", "high")]
    fid = [f"{m}{k}" for m in FIDELITY for k in ("", "_n", "_low", "_high")]
    w.writerow(["method", "ratio", *tasks, "average", "protocol", *extra, *fid])
    for r in items:
        scores = [f"{r.scores[t]:.2f}" if t in r.scores else "" for t in tasks]
        spread = []
        for e in [*(r.estimate(t) for t in tasks), r.average_estimate()]:
            d = e.as_dict(100) if e else {"n": None, "low": None, "high": None}
            spread += ["" if d["n"] is None else str(d["n"]), _num(d["low"]), _num(d["high"])]
        for m in FIDELITY:
            e = r.fidelity_estimate(m)
            d = e.as_dict(FIDELITY_SCALE[m]) if e else {"mean": None, "n": None, "low": None, "high": None}
            spread += [_num(d["mean"]), "" if d["n"] is None else str(d["n"]), _num(d["low"]), _num(d["high"])]
        w.writerow([r.method, f"{r.ratio:g}", *scores, f"{r.average:.2f}", protocol, *spread])
    return buf.getvalue()


def write_csv(items: list[Row], path: str | Path, protocol: str = "query-aware") -> Path:
    path = Path(path)
    path.write_text(csv_text(items, protocol), encoding="utf-8")
    return path


def _cell(e: Estimate | None, mean: float) -> str:
    """A table cell: ``50.0 [23.7, 76.3] n=10`` (scores 0-100); the mean alone without an interval."""
    if e is None or e.low is None or e.high is None:
        return f"{mean:.1f}" + (f" n={e.n}" if e else "")
    return f"{mean:.1f} [{100 * e.low:.1f}, {100 * e.high:.1f}] n={e.n}"


def _fidelity_cell(e: Estimate | None, metric: str) -> str:
    """A fidelity score with its interval and n: agreement 0-100 as the scores, log-probability in nats."""
    if e is None:
        return "—"
    scale, digits = FIDELITY_SCALE[metric], (1 if metric == "agreement" else 2)
    f = f"{{:.{digits}f}}"
    if e.low is None or e.high is None:
        return f.format(e.mean * scale) + f" n={e.n}"
    return f"{f.format(e.mean * scale)} [{f.format(e.low * scale)}, {f.format(e.high * scale)}] n={e.n}"


def protocol_caption(protocol: str | None) -> str:
    """The line above a leaderboard table: its protocol and how to read a score ("" without a protocol)."""
    import html

    if not protocol:
        return ""
    return (
        f"<p class='kv-protocol'>Protocol: {html.escape(protocol_text(protocol))}. "
        "Each score: the mean (0-100) [95% interval] n = prompts.</p>"
    )


def table_html(items: list[Row], protocol: str | None = None) -> str:
    """The leaderboard as an HTML table: ratio with kvlab's budget beside it, scores per task, average, each
    mean with its 95% interval and n; the protocol above it when given."""
    import html

    tasks = tasks_of(items)
    fid = [m for m in FIDELITY if any(r.fidelity_estimate(m) for r in items)]
    head = ["method", "ratio (removed)", "budget (kept)", *tasks, "average", *(FIDELITY_HEAD[m] for m in fid)]
    body = []
    for r in sorted(items, key=lambda r: (r.ratio, -r.average)):
        cells = [r.method, f"{r.ratio:g}", f"{r.budget:g}", *(_cell(r.estimate(t), r.scores[t]) if t in r.scores
                 else "—" for t in tasks), _cell(r.average_estimate(), r.average),
                 *(_fidelity_cell(r.fidelity_estimate(m), m) for m in fid)]  # fmt: skip
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    caption = protocol_caption(protocol)
    return (
        caption
        + "<table class='kv-leaderboard'><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join(body)
        + "</table>"
    )


STYLES = (("solid", "circle"), ("dot", "diamond"), ("dashdot", "square"))  # line dash and marker per colour cycle


def _bars(rs: list[Row]) -> dict | None:
    """Plotly error bars of the rows' averages (their 95% intervals); None when none has one."""
    ests = [r.average_estimate() for r in rs]
    if not any(e is not None and e.low is not None for e in ests):
        return None
    up = [0.0 if e is None or e.high is None else 100 * e.high - r.average for e, r in zip(ests, rs)]
    down = [0.0 if e is None or e.low is None else r.average - 100 * e.low for e, r in zip(ests, rs)]
    return {"type": "data", "array": up, "arrayminus": down, "visible": True, "thickness": 1}


def _hover(method: str, r: Row) -> str:
    e = r.average_estimate()
    spread = (
        "" if e is None or e.low is None or e.high is None else f" [{100 * e.low:.1f}, {100 * e.high:.1f}] (n = {e.n})"
    )
    return f"{method}<br>ratio {r.ratio:g} (budget {r.budget:g} kept)<br>average {r.average:.1f}{spread}"


def figure(
    items: list[Row], title: str = "Leaderboard: score against compression ratio", protocol: str | None = None
) -> go.Figure:
    """Average score (0-100) against the compression ratio, one line per method with its 95% intervals as error
    bars; exact as a dashed line with its interval as a band; the protocol in the title."""
    fig = go.Figure()
    by_method: dict[str, list[Row]] = defaultdict(list)
    for r in items:
        by_method[r.method].append(r)
    ratios = sorted({r.ratio for r in items if r.ratio > 0})
    i = 0
    for method, rs in by_method.items():
        rs = sorted(rs, key=lambda r: r.ratio)
        hover = [_hover(method, r) for r in rs]
        if method == "exact" and ratios:
            y = rs[0].average
            e = rs[0].average_estimate()
            if e is not None and e.low is not None and e.high is not None:  # exact's interval as a band
                fig.add_trace(
                    go.Scatter(x=[ratios[0], ratios[-1], ratios[-1], ratios[0]],
                               y=[100 * e.low, 100 * e.low, 100 * e.high, 100 * e.high], fill="toself",
                               fillcolor="rgba(68,68,68,0.12)", line={"width": 0}, hoverinfo="skip",
                               name="exact, 95% interval", showlegend=False)
                )  # fmt: skip
            fig.add_trace(
                go.Scatter(x=[ratios[0], ratios[-1]], y=[y, y], mode="lines", name="exact (ratio 0)",
                           line={"color": "#444", "dash": "dash"}, hovertext=hover * 2, hoverinfo="text")
            )  # fmt: skip
            continue
        cycle = i // len(PALETTE) % len(STYLES)  # past the palette's colours, a line and marker of another style
        fig.add_trace(
            go.Scatter(x=[r.ratio for r in rs], y=[r.average for r in rs], mode="lines+markers", name=method,
                       line={"color": PALETTE[i % len(PALETTE)], "dash": STYLES[cycle][0]},
                       marker={"symbol": STYLES[cycle][1], "size": 8}, hovertext=hover, hoverinfo="text",
                       error_y=_bars(rs))
        )  # fmt: skip
        i += 1
    if protocol:
        title = f"{title}<br><sup>{protocol_text(protocol)}; error bars: 95% intervals over prompts</sup>"
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
