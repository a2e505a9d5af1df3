"""A self-contained HTML report of a sweep: plotly figures (plotly.js inlined once) and a summary table.

Figures, the same builders and axes as the dashboard's (``kvlab.figures``), each label averaged over
the sweep's cells:
* quality vs memory — the first ``figures.QUALITY`` measure the runs have (task score for the
  built-in tasks) against the share of the exact cache's bytes held, one line per method through
  its budgets;
* attention error per layer — mean relative error per layer, one line per method@budget;
* bytes per step — KiB held after each decode step at the longest length, one line per run;
* needle grid (a sweep over several depths) — accuracy per depth x length, one heatmap per
  method@budget (``kvlab.grids``);
* leaderboard (runs with task scores at fraction budgets) — average score against the compression
  ratio, one line per method, and its table per task (``kvlab.leaderboard``).
"""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

import plotly.graph_objects as go

from kvlab import figures as shared


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _by_label(recs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for rec in recs:
        for r in rec["runs"]:
            out[r["label"]].append(r)
    return out


def _mean_series(series: list[list[float]]) -> list[float]:
    """Step-wise mean of several series, over the steps they all have."""
    steps = min((len(s) for s in series), default=0)
    return [sum(s[k] for s in series) / len(series) for k in range(steps)]


def summaries(recs: list[dict]) -> list[shared.RunSummary]:
    """One ``shared.RunSummary`` per label, averaged over the cells (compact records of ``kvlab.sweep``)."""
    out = []
    for i, (label, runs) in enumerate(_by_label(recs).items()):
        keys = {k for r in runs for k, v in r["metrics"].items() if not isinstance(v, (list, dict))}
        per_layer = [r["metrics"].get("attn_rel_error_per_layer") for r in runs]
        per_layer = [p for p in per_layer if p]
        out.append(
            shared.RunSummary(
                label=label,
                method=runs[0]["method"],
                color=shared.PALETTE[i % len(shared.PALETTE)],
                bytes_fraction=_mean(r["kv_bytes"] / r["exact_kv_bytes_per_step"][0] for r in runs),
                metrics={k: _mean(r["metrics"].get(k) for r in runs) for k in keys},
                error_per_layer=[_mean(col) for col in zip(*per_layer)] if per_layer else None,
                kv_bytes_per_step=_mean_series([r["kv_bytes_per_step"] for r in runs]),
                exact_kv_bytes_per_step=_mean_series([r["exact_kv_bytes_per_step"] for r in runs]),
            )
        )
    return out


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
    items = summaries(recs)
    longest = max((rec["cell"]["length"] for rec in recs), default=0)
    at_longest = summaries([rec for rec in recs if rec["cell"]["length"] == longest])
    return (
        {
            "quality": shared.quality_figure(items, "Quality vs memory"),
            "error": shared.error_per_layer_figure(
                items, "Attention relative error per layer (mean over steps and cells)", lines=True
            ),
            "bytes": shared.bytes_figure(at_longest, f"Bytes held per decode step (length {longest})"),
        }
        | _grid(recs)
        | _leaderboard(recs)
    )


def _leaderboard(recs: list[dict]) -> dict[str, go.Figure]:
    """The leaderboard figure when the runs have task scores at fraction budgets (else nothing)."""
    from kvlab import leaderboard

    items = leaderboard.rows(recs)
    return {"leaderboard": leaderboard.figure(items)} if items else {}


def _grid(recs: list[dict]) -> dict[str, go.Figure]:
    """The needle grid figure when the cells cover several depths (else nothing)."""
    from kvlab import grids

    items = grids.grids(recs)
    if not items or len(items[0].depths) < 2:
        return {}
    return {"grid": grids.grid_figure(items, "Needle grid: found per depth x length (hits/seeds)")}


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
    from kvlab import leaderboard

    board = leaderboard.rows(recs)
    if board:
        table += (
            "<h2>Leaderboard</h2><p>compression ratio = fraction of the cache removed (kvpress's convention); "
            "budget = fraction kept (kvlab's), 1 - ratio. Scores 0-100, mean over each task's prompts.</p>"
            + leaderboard.table_html(board)
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
