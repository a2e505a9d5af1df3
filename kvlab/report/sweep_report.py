"""A self-contained HTML report of a sweep: plotly figures (plotly.js inlined once) and a summary table.

Figures, the same builders and axes as the dashboard's (``kvlab.report.charts``), each label averaged over
the sweep's cells:
* quality vs memory — the first ``figures.QUALITY`` measure the runs have (task score for the
  built-in tasks) against the peak share of the exact cache's bytes held (the mean in the hover),
  one line per method through its budgets;
* attention error per layer — mean relative error per layer, one line per method@budget;
* bytes per step — KiB held after each decode step at the longest length, one line per run, its
  mean over the run dotted;

The summary table gives each label's peak and mean bytes (fractions of the exact cache's), its
budget use (mean bytes held / bytes allowed) and shared per-model KiB (QJL's sketches).
* needle grid (a sweep over several depths) — accuracy per depth x length, one heatmap per
  method@budget (``kvlab.report.needle_grids``);
* leaderboard (runs with task scores at fraction budgets) — average score against the compression
  ratio, one line per method, and its table per task (``kvlab.report.leaderboard``).
"""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

import plotly.graph_objects as go

from kvlab.core.results import memory_figures
from kvlab.core.statistics import mean_interval, score_interval
from kvlab.report import charts as shared
from kvlab.report import leaderboard
from kvlab.report import needle_grids as grids


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
                peak_fraction=_mean(_memory(r)["peak_fraction"] for r in runs),
                mean_fraction=_mean(_memory(r)["mean_fraction"] for r in runs),
            )
        )
    return out


def _memory(r: dict) -> dict:
    """A compact run's peak and mean bytes (``kvlab.core.results.memory_figures``)."""
    return memory_figures(
        r["kv_bytes_per_step"], r["exact_kv_bytes_per_step"], r.get("budget_use"), r.get("shared_bytes")
    )


def _fmt(v, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


SUMMARY_HEAD = (
    "label",
    "cells",
    "peak (of exact)",
    "mean (of exact)",
    "budget use",
    "shared KiB",
    "task score [95% interval]",
    "text similarity [95% interval]",
    "KL",
    "top-1",
    "attn error",
)


def summary_rows(recs: list[dict]) -> list[tuple]:
    """One row per label (``SUMMARY_HEAD``), averaged over the cells: the peak and mean bytes held as fractions
    of the exact cache's, the mean budget use, shared per-model KiB, and the quality measures (the task score
    and the text similarity with their 95% intervals over the cells and n, ``kvlab.core.statistics``)."""
    out = []
    for label, runs in _by_label(recs).items():

        def avg(key, runs=runs):
            return _fmt(_mean(r["metrics"].get(key) for r in runs))

        def with_interval(key, interval, runs=runs):
            """The mean over the cells with its 95% interval and n (a single cell: its value)."""
            est = interval([v for r in runs if (v := r["metrics"].get(key)) is not None])
            return "—" if est is None else est.text()

        mem = [_memory(r) for r in runs]
        shared_kib = _mean(m["shared_bytes"] / 1024 for m in mem)
        out.append(
            (
                label,
                len(runs),
                _fmt(_mean(m["peak_fraction"] for m in mem)),
                _fmt(_mean(m["mean_fraction"] for m in mem)),
                _fmt(_mean(m["budget_use"] for m in mem), ".2f"),
                _fmt(shared_kib, ",.0f") if shared_kib else "—",
                with_interval("task_score", score_interval),
                with_interval("text_similarity", mean_interval),
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

    items = leaderboard.rows(recs)
    return {"leaderboard": leaderboard.figure(items, protocol=leaderboard.protocol_of(recs))} if items else {}


def _grid(recs: list[dict]) -> dict[str, go.Figure]:
    """The needle grid figure when the cells cover several depths (else nothing)."""

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
    head = SUMMARY_HEAD
    table = (
        "<table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in summary_rows(recs)
        )
        + "</table>"
    )

    board = leaderboard.rows(recs)
    if board:
        table += (
            "<h2>Leaderboard</h2><p>compression ratio = fraction of the cache removed (kvpress's convention); "
            "budget = fraction kept (kvlab's), 1 - ratio. Scores 0-100, mean over each task's prompts, with its "
            "95% interval and n.</p>" + leaderboard.table_html(board, leaderboard.protocol_of(recs))
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
