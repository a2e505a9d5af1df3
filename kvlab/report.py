"""A self-contained HTML report of a sweep: plotly figures (plotly.js inlined once) and a summary table.

Figures (averaged over the sweep's cells):
* quality vs memory — task score (or text similarity for fidelity-scored tasks) against the
  fraction of the exact cache's bytes held, one line per method through its budgets;
* attention error per layer — mean relative error per layer, one line per method@budget;
* bytes per step — KiB held after each decode step at the longest length, one line per run.
"""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

import plotly.graph_objects as go


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _by_label(recs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for rec in recs:
        for r in rec["runs"]:
            out[r["label"]].append(r)
    return out


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(
        title=title,
        xaxis_title=x,
        yaxis_title=y,
        template="plotly_white",
        height=420,
        margin=dict(l=60, r=20, t=50, b=50),
        legend=dict(font=dict(size=10)),
    )
    return fig


def _quality(r: dict) -> float | None:
    m = r["metrics"]
    return m.get("task_score") if m.get("task_score") is not None else m.get("text_similarity")


def quality_vs_memory(recs: list[dict]) -> go.Figure:
    points: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for label, runs in _by_label(recs).items():
        frac = _mean(r["kv_bytes"] / r["exact_kv_bytes_per_step"][0] for r in runs)
        q = _mean(_quality(r) for r in runs)
        if q is not None:
            points[runs[0]["method"]].append((frac, q, label))
    fig = go.Figure()
    for method, pts in sorted(points.items()):
        pts.sort()
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in pts],
                y=[p[1] for p in pts],
                text=[p[2] for p in pts],
                mode="lines+markers",
                name=method,
            )
        )
    return _layout(fig, "Quality vs memory", "fraction of exact cache bytes held", "mean score")


def error_per_layer(recs: list[dict]) -> go.Figure:
    fig = go.Figure()
    for label, runs in _by_label(recs).items():
        per = [r["metrics"].get("attn_rel_error_per_layer") for r in runs]
        per = [p for p in per if p]
        if not per:
            continue
        mean = [_mean(col) for col in zip(*per)]
        fig.add_trace(go.Scatter(x=list(range(len(mean))), y=mean, mode="lines+markers", name=label))
    return _layout(fig, "Attention relative error per layer (vs budget)", "layer", "mean ||z - a|| / ||a||")


def bytes_per_step(recs: list[dict]) -> go.Figure:
    fig = go.Figure()
    longest = max((rec["cell"]["length"] for rec in recs), default=0)
    for label, runs in _by_label([r for r in recs if r["cell"]["length"] == longest]).items():
        steps = min(len(r["kv_bytes_per_step"]) for r in runs)
        kib = [sum(r["kv_bytes_per_step"][s] for r in runs) / len(runs) / 1024 for s in range(steps)]
        fig.add_trace(go.Scatter(x=list(range(steps)), y=kib, mode="lines", name=label))
    return _layout(fig, f"Bytes held per decode step (length {longest})", "decode step", "KiB")


def summary_rows(recs: list[dict]) -> list[tuple]:
    out = []
    for label, runs in _by_label(recs).items():

        def avg(key, runs=runs):
            v = _mean(r["metrics"].get(key) for r in runs)
            return "—" if v is None else f"{v:.3f}"

        frac = _mean(r["kv_bytes"] / r["exact_kv_bytes_per_step"][0] for r in runs)
        out.append(
            (
                label,
                len(runs),
                f"{frac:.3f}",
                avg("task_score"),
                avg("text_similarity"),
                avg("kl_mean"),
                avg("top1_agreement"),
                avg("attn_rel_error_mean"),
            )
        )
    return out


def figures(recs: list[dict]) -> dict[str, go.Figure]:
    return {"quality": quality_vs_memory(recs), "error": error_per_layer(recs), "bytes": bytes_per_step(recs)}


def write_report(cfg, recs: list[dict], path: str | Path) -> Path:
    """Write the HTML report; plotly.js is embedded so the file opens offline."""
    figs = figures(recs)
    parts = []
    for i, (name, fig) in enumerate(figs.items()):
        parts.append(
            f"<section class='fig' id='fig-{name}'>"
            + fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False, div_id=f"plot-{name}")
            + "</section>"
        )
    head = ("label", "cells", "bytes fraction", "task score", "text similarity", "KL", "top-1", "attn error")
    table = (
        "<table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in summary_rows(recs)
        )
        + "</table>"
    )
    cfg_txt = html.escape(", ".join(f"{k}={v}" for k, v in vars(cfg).items()))
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>kvlab sweep: {html.escape(cfg.task)}</title>
<style>body{{font-family:sans-serif;margin:24px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px}}</style>
</head><body><h1>kvlab sweep — {html.escape(cfg.task)}</h1><p>{cfg_txt}</p><p>{len(recs)} cells</p>
{table}
{"".join(parts)}
</body></html>"""
    path = Path(path)
    path.write_text(doc, encoding="utf-8")
    return path
