"""Figures shared by the dashboard and the sweep report, and the one definition of each of their axes.

The builders draw ``RunSummary`` items: one per run of a comparison (``kvlab.report.comparison_figures.summaries``), or
one per label averaged over a sweep's cells (``kvlab.report.sweep_report.summaries``). Axes: ``BYTES_HELD``
(bytes after compression, % of the exact cache's), ``QUALITY`` (the measures a quality axis may
show, in order of preference; one figure shows one of them for all its runs) and ``ATTN_ERROR``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import plotly.graph_objects as go

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#ff7f0e",
    "#17becf",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
)
KIB = 1024.0
ATTN_ERROR = "attention relative error ||z − a|| / ||a||"


def layout(fig: go.Figure, height: int, title: str, **kw) -> go.Figure:
    fig.update_layout(
        height=height,
        title=dict(text=title, x=0.01, font=dict(size=15)),
        margin=dict(l=60, r=20, t=50, b=90),
        template="plotly_white",
        legend=dict(orientation="h", y=-0.3, yanchor="top"),
        **kw,
    )
    return fig


def no_data(title: str, why: str, height: int = 320) -> go.Figure:
    """An empty figure that explains, in words, why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(
        text=why, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font=dict(size=14, color="#666")
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return layout(fig, height, title)


def finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def mean(xs) -> float | None:
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else None


@dataclass
class RunSummary:
    """What the shared figures draw of one run, or of one label averaged over a sweep's cells."""

    label: str
    method: str
    color: str
    bytes_fraction: float | None  # bytes held after compression / the exact cache's bytes
    metrics: dict  # scalar metrics (task_score, top1_agreement, attn_rel_error_mean, ...)
    error_per_layer: list[float | None] | None  # mean over decode steps, per layer
    kv_bytes_per_step: list[float]  # [k] after k decode steps
    exact_kv_bytes_per_step: list[float]
    peak_fraction: float | None = None  # the most bytes held over the run / the exact cache's most
    mean_fraction: float | None = None  # the bytes held, averaged over the run / the exact cache's mean


@dataclass(frozen=True)
class Measure:
    """A number on a figure's axis: its axis title and how it is read from a run's scalar metrics."""

    title: str
    read: Callable[[dict], float | None]


def _one_minus(x) -> float | None:
    return 1.0 - x if finite(x) else None


#: "Quality" of a run, in order of preference; a figure uses the first one that some run has, for all its runs.
QUALITY = (
    Measure("task score", lambda m: m.get("task_score")),
    Measure("top-1 agreement with exact, teacher-forced", lambda m: m.get("top1_agreement")),
    Measure("1 − attention relative error", lambda m: _one_minus(m.get("attn_rel_error_mean"))),
    Measure("text similarity to exact", lambda m: m.get("text_similarity")),
)
BYTES_HELD = "peak bytes held (% of exact)"


def quality_measure(items: list[RunSummary]) -> Measure | None:
    """The first ``QUALITY`` measure that at least one of ``items`` has."""
    return next((q for q in QUALITY if any(finite(q.read(it.metrics)) for it in items)), None)


def quality_figure(items: list[RunSummary], title: str) -> go.Figure:
    """Quality against the peak bytes held (compressed runs; the mean in the hover), one line per method through
    its budgets. Runs without a peak (older results) are placed at their bytes after compression."""
    items = [it for it in items if it.method != "exact" and _peak(it) is not None]
    q = quality_measure(items)
    if q is None:
        return no_data(title, "no quality measurements in this result")
    by_method: dict[str, list[tuple[float, RunSummary]]] = {}  # (peak, run) per method
    for it in items:
        peak = _peak(it)
        if peak is not None and finite(q.read(it.metrics)):
            by_method.setdefault(it.method, []).append((peak, it))
    fig = go.Figure()
    for method, pts in by_method.items():
        pts.sort(key=lambda p: (p[0], q.read(p[1].metrics)))
        fig.add_trace(
            go.Scatter(
                x=[100 * peak for peak, _ in pts],
                y=[q.read(it.metrics) for _, it in pts],
                text=[it.label for _, it in pts],
                customdata=[100 * (it.mean_fraction if finite(it.mean_fraction) else peak) for peak, it in pts],
                name=method,
                mode="lines+markers",
                marker=dict(size=9),
                line=dict(color=pts[0][1].color),
                hovertemplate="%{text}<br>peak %{x:.1f}% · mean %{customdata:.1f}% of exact bytes<br>%{y:.3f}"
                "<extra></extra>",
            )
        )
    fig.update_xaxes(title=BYTES_HELD, rangemode="tozero")
    fig.update_yaxes(title=q.title)
    if max(len(pts) for pts in by_method.values()) < 2:
        fig.add_annotation(
            text="run several budgets (e.g. 0.5, 0.25, 0.1) to trace a curve",
            x=0.5,
            y=1.08,
            xref="paper",
            yref="paper",
            showarrow=False,
            font=dict(size=11, color="#888"),
        )
    return layout(fig, 360, f"{title} ({q.title})")


def _peak(it: RunSummary) -> float | None:
    return it.peak_fraction if finite(it.peak_fraction) else it.bytes_fraction


def error_per_layer_figure(items: list[RunSummary], title: str, lines: bool = False) -> go.Figure:
    """Attention relative error per layer (mean over decode steps) of the compressed runs.

    A heatmap of runs x layers, or (``lines``) one line per run across the layers.
    """
    items = [it for it in items if it.method != "exact" and it.error_per_layer]
    if not items:
        return no_data(title, "no attention-error measurements in this result")
    layers = list(range(len(items[0].error_per_layer or ())))
    if lines:
        fig = go.Figure()
        for it in items:
            line = dict(color=it.color)
            fig.add_trace(go.Scatter(x=layers, y=it.error_per_layer, name=it.label, mode="lines+markers", line=line))
        fig.update_yaxes(title=ATTN_ERROR, rangemode="tozero")
        height = 420
    else:
        fig = go.Figure(
            go.Heatmap(
                z=[it.error_per_layer for it in items],
                x=layers,
                y=[it.label for it in items],
                colorscale="Viridis",
                colorbar=dict(title="rel. err"),
                hovertemplate="%{y}<br>layer %{x}: %{z:.3f}<extra></extra>",
            )
        )
        height = 120 + 38 * len(items)
    fig.update_xaxes(title="layer", dtick=2)
    return layout(fig, height, title)


def bytes_figure(items: list[RunSummary], title: str) -> go.Figure:
    """KiB held after each decode step, one line per run, with the exact cache's growth dashed."""
    items = [it for it in items if it.kv_bytes_per_step]
    if not items:
        return no_data(title, "no runs yet")
    fig = go.Figure()
    ref = max(items, key=lambda it: len(it.exact_kv_bytes_per_step))  # the longest run: exact growth over all steps
    fig.add_trace(
        go.Scatter(
            x=list(range(len(ref.exact_kv_bytes_per_step))),
            y=[b / KIB for b in ref.exact_kv_bytes_per_step],
            name="exact (all tokens seen)",
            line=dict(color="#999", dash="dash"),
        )
    )
    for it in items:
        steps = list(range(len(it.kv_bytes_per_step)))
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=[b / KIB for b in it.kv_bytes_per_step],
                name=it.label,
                mode="lines",
                line=dict(color=it.color),
            )
        )
        mean = sum(it.kv_bytes_per_step) / len(it.kv_bytes_per_step) / KIB  # the mean over the run, dotted
        fig.add_trace(
            go.Scatter(
                x=[steps[0], steps[-1]],
                y=[mean, mean],
                name=f"{it.label} mean",
                mode="lines",
                line=dict(color=it.color, dash="dot", width=1),
                showlegend=False,
                hovertemplate=f"{it.label}: mean %{{y:,.0f}} KiB over the run<extra></extra>",
            )
        )
    fig.update_xaxes(title="decode step (0 = after prefill; dotted: each run's mean)")
    fig.update_yaxes(title="KiB held", rangemode="tozero")
    return layout(fig, 380, title)
