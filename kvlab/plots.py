"""Plotly figure builders for the dashboard and its HTML export: pure functions of a ``CompareResult``.

Every builder takes the result (plus view choices such as layer and head) and returns a
``plotly.graph_objects.Figure`` with an explicit height. When the data a figure needs is absent
(no metrics recorded, a single budget, an imported file from an older version) it returns a figure
that says so in words instead of failing.

Quality vs memory, error per layer and bytes per step are the builders of ``kvlab.figures``
(shared with the sweep report, with its axis definitions), drawn from ``summaries(result)``.

Metric names (``RunResult.metrics``, docs/metrics.md): ``attn_rel_error`` [steps][layers], ``kl`` [steps],
``top1_agreement`` (scalar or [steps]), ``perplexity``, ``first_divergence``, ``text_similarity``,
``task_score``. Attention maps and kept positions live in ``RunResult.extras`` (see ``attn_map``
and ``kept_of``).
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.figures import (
    ATTN_ERROR,
    KIB,
    PALETTE,
    RunSummary,
    bytes_figure,
    error_per_layer_figure,
    no_data,
    quality_figure,
)
from kvlab.figures import finite as _finite
from kvlab.figures import layout as _layout
from kvlab.figures import mean as _mean
from kvlab.results import CompareResult, RunResult


# ----- helpers ----------------------------------------------------------------------------------
def color_of(result: CompareResult, label: str) -> str:
    labels = [r.label for r in result.runs]
    return PALETTE[labels.index(label) % len(PALETTE)] if label in labels else PALETTE[-1]


def metric(run: RunResult, name: str) -> Any:
    """A metric of a run, or None when it was not recorded."""
    return (run.metrics or {}).get(name)


def compressed_runs(result: CompareResult) -> list[RunResult]:
    return [r for r in result.runs if r.method != "exact"]


def exact_bytes_at_prefill(run: RunResult) -> int:
    return run.exact_kv_bytes_per_step[0] if run.exact_kv_bytes_per_step else 0


def fraction_held(run: RunResult) -> float | None:
    exact = exact_bytes_at_prefill(run)
    return run.kv_bytes / exact if exact else None


# ----- memory -----------------------------------------------------------------------------------
def gauges(result: CompareResult, per_row: int = 5) -> go.Figure:
    """One gauge per run: bytes held after compression as % of the exact cache; the number is % saved."""
    runs = result.runs
    if not runs:
        return no_data("Cache size", "no runs yet")
    rows = math.ceil(len(runs) / per_row)
    cols = min(per_row, len(runs))
    fig = make_subplots(rows=rows, cols=cols, specs=[[{"type": "indicator"}] * cols for _ in range(rows)])
    for i, r in enumerate(runs):
        held = 100 * (fraction_held(r) or 0.0)
        fig.add_trace(
            go.Indicator(
                mode="gauge+number",
                value=held,
                number=dict(suffix="%", valueformat=".1f", font=dict(size=22)),
                title=dict(
                    text=f"{r.label}<br><span style='font-size:11px;color:#666'>"
                    f"{r.kv_bytes / KIB:,.0f} of {exact_bytes_at_prefill(r) / KIB:,.0f} KiB · "
                    f"{100 - held:.0f}% saved</span>",
                    font=dict(size=13),
                ),
                gauge=dict(
                    axis=dict(range=[0, 100], ticksuffix="%"),
                    bar=dict(color=color_of(result, r.label)),
                    steps=[dict(range=[0, 100], color="#f3f3f3")],
                    threshold=dict(line=dict(color="#333", width=2), value=100),
                ),
            ),
            row=i // per_row + 1,
            col=i % per_row + 1,
        )
    fig = _layout(fig, 230 * rows + 30, "Cache held after compression (% of the exact cache)")
    fig.update_layout(margin=dict(l=30, r=30, t=90, b=10))
    return fig


def bytes_per_step(result: CompareResult) -> go.Figure:
    """Bytes each cache holds after every decode step, with the exact cache's growth dashed."""
    return bytes_figure(summaries(result), "Bytes per decode step")


# ----- errors -----------------------------------------------------------------------------------
def _err_matrix(run: RunResult) -> list[list[float]] | None:
    m = metric(run, "attn_rel_error")
    if not m or not isinstance(m, list) or not isinstance(m[0], list):
        return None
    return m


def n_layers(result: CompareResult) -> int:
    return int(result.model.get("n_layers", 0) or 0)


def error_per_step(result: CompareResult, layer: str | int = "mean") -> go.Figure:
    """Attention relative error ||z - a|| / ||a|| per decode step, at one layer or averaged over layers."""
    which = "mean over layers" if layer in (None, "mean") else f"layer {int(layer)}"
    title = f"Attention relative error per decode step ({which})"
    fig = go.Figure()
    for r in compressed_runs(result):
        m = _err_matrix(r)
        if m is None:
            continue
        if layer in (None, "mean"):
            ys = [_mean(row) for row in m]
        else:
            ys = [row[int(layer)] if int(layer) < len(row) else None for row in m]
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(ys) + 1)),
                y=ys,
                name=r.label,
                mode="lines+markers",
                marker=dict(size=4),
                line=dict(color=color_of(result, r.label)),
            )
        )
    if not fig.data:
        return no_data(title, "no attention-error measurements in this result")
    fig.update_xaxes(title="decode step")
    fig.update_yaxes(title=ATTN_ERROR, rangemode="tozero")
    return _layout(fig, 340, title)


def error_per_layer(result: CompareResult) -> go.Figure:
    """Heatmap of runs x layers: attention relative error averaged over decode steps."""
    return error_per_layer_figure(summaries(result), "Attention relative error per layer (mean over steps)")


def _per_step(value) -> list | None:
    if isinstance(value, list):
        return value
    return None


def kl_and_agreement(result: CompareResult) -> go.Figure:
    """Teacher-forced KL(exact || method) per step (left) and top-1 agreement per step (right)."""
    title = "Teacher-forced fidelity along the exact run"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL(exact ‖ method) per step", "top-1 agreement"))
    bars = []
    for r in compressed_runs(result):
        c = color_of(result, r.label)
        kl = _per_step(metric(r, "kl"))
        if kl:
            fig.add_trace(
                go.Scatter(x=list(range(1, len(kl) + 1)), y=kl, name=r.label, legendgroup=r.label, line=dict(color=c)),
                row=1,
                col=1,
            )
        agree = metric(r, "top1_agreement")
        if isinstance(agree, list) and agree:
            cum = [sum(agree[: i + 1]) / (i + 1) for i in range(len(agree))]
            fig.add_trace(
                go.Scatter(
                    x=list(range(1, len(cum) + 1)),
                    y=cum,
                    name=r.label,
                    legendgroup=r.label,
                    showlegend=not kl,
                    line=dict(color=c),
                ),
                row=1,
                col=2,
            )
        elif _finite(agree):
            bars.append((r.label, float(agree), c))
    if bars:
        fig.add_trace(
            go.Bar(x=[b[0] for b in bars], y=[b[1] for b in bars], marker_color=[b[2] for b in bars], showlegend=False),
            row=1,
            col=2,
        )
    if not fig.data:
        return no_data(title, "no KL / agreement measurements in this result")
    fig.update_yaxes(title="KL (nats)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="agreement (running mean)", range=[0, 1.05], row=1, col=2)
    fig.update_xaxes(title="decode step", row=1, col=1)
    return _layout(fig, 340, title)


# ----- attention --------------------------------------------------------------------------------
def attn_map(run: RunResult) -> dict | None:
    """The recorded attention map of a run (``extras["attn_map"]``, layout in kvlab/metrics.py) or None."""
    m = (run.extras or {}).get("attn_map")
    return m if isinstance(m, dict) and m.get("exact") else None


def map_site(result: CompareResult) -> tuple[int, int] | None:
    """(layer, query head) at which the attention maps of this result were recorded."""
    for r in result.runs:
        m = attn_map(r)
        if m is not None:
            return int(m.get("layer", 0)), int(m.get("head", 0))
    return None


def kept_of(run: RunResult) -> list[int] | None:
    """Prompt positions a run kept (at the map's layer and KV head), or None when not position-based."""
    kept = (run.extras or {}).get("kept_positions")
    m = attn_map(run)
    if kept is None or (m is not None and m.get("method") is None):  # sketches: every position, compressed
        return None
    return [int(x) for x in kept]


def _log_weights(z: list[list[float]]) -> list[list[float]]:
    """log10 of attention weights (floored at 1e-4): sink tokens take most of the mass on a linear scale."""
    return [[math.log10(max(float(w), 1e-4)) for w in row] for row in z]


def attention_heatmaps(result: CompareResult, labels: list[str] | None = None) -> go.Figure:
    """Exact vs each method side by side: weights of the last decode queries over the prompt positions.

    Left: exact attention for the run's own queries (full cache); right: the method's weights at the
    positions it keeps. Grey bands mark prompt positions the method evicted.
    """
    site = map_site(result)
    title = "Attention over the prompt" + (f" · layer {site[0]}, head {site[1]}" if site else "")
    runs = [r for r in compressed_runs(result) if labels is None or r.label in labels]
    runs = [r for r in runs if attn_map(r) is not None]
    if not runs:
        why = "no attention maps in this result (turn the measurements on and run again)"
        return no_data(title, why, height=300)
    n = len(runs)
    fig = make_subplots(
        rows=n,
        cols=2,
        shared_xaxes=True,
        horizontal_spacing=0.05,
        vertical_spacing=min(0.08, 0.3 / n),
        subplot_titles=[t for r in runs for t in (f"exact · queries of {r.label}", r.label)],
    )
    for i, r in enumerate(runs, start=1):
        m = attn_map(r)
        steps = m.get("steps") or list(range(len(m["exact"])))
        for col, z in ((1, m["exact"]), (2, m.get("method"))):
            if z is None:
                k = 2 * (i - 1) + col  # subplot index: axes x{k}, y{k} (paper coordinates render everywhere)
                xd, yd = fig.layout[f"xaxis{k}"].domain, fig.layout[f"yaxis{k}"].domain
                fig.add_annotation(
                    text="no token-level weights for this cache (sketched or clustered keys)",
                    showarrow=False,
                    x=sum(xd) / 2,
                    y=sum(yd) / 2,
                    xref="paper",
                    yref="paper",
                    xanchor="center",
                    font=dict(size=12, color="#666"),
                )
                fig.update_xaxes(visible=False, row=i, col=col)
                fig.update_yaxes(visible=False, row=i, col=col)
                continue
            fig.add_trace(
                go.Heatmap(
                    z=_log_weights(z),
                    y=steps,
                    customdata=z,
                    colorscale="Magma",
                    zmin=-4,
                    zmax=0,
                    showscale=(i == 1 and col == 1),
                    colorbar=dict(title="log10 w", len=0.5, y=1.0, yanchor="top"),
                    hovertemplate="pos %{x}<br>step %{y}<br>w=%{customdata:.4f}<extra>" + r.label + "</extra>",
                ),
                row=i,
                col=col,
            )
        kept = kept_of(r)
        if kept is not None:
            for a, b in _runs_of(sorted(set(range(result.prompt_tokens)) - set(kept))):
                fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor="#7fa7c9", opacity=0.45, line_width=0, row=i, col=2)
        fig.update_yaxes(title="step", row=i, col=1)
    fig.update_xaxes(title="prompt position", row=n, col=1)
    fig.update_xaxes(title="prompt position (blue bands: evicted)", row=n, col=2)
    return _layout(fig, 80 + 170 * n, title)


def _runs_of(xs: list[int]) -> list[tuple[int, int]]:
    """Consecutive integers grouped into (first, last) spans."""
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


# ----- quality vs memory ------------------------------------------------------------------------
def quality_vs_memory(result: CompareResult) -> go.Figure:
    """Quality (one ``QUALITY`` measure for every run) against bytes held, one line per method across budgets."""
    return quality_figure(summaries(result), "Quality vs memory")


# ----- figures shared with the sweep report ------------------------------------------------------
def summaries(result: CompareResult) -> list[RunSummary]:
    """One ``RunSummary`` per run of a comparison."""
    out = []
    for r in result.runs:
        m = _err_matrix(r)
        out.append(
            RunSummary(
                label=r.label,
                method=r.method,
                color=color_of(result, r.label),
                bytes_fraction=fraction_held(r),
                metrics=_scalars(r.metrics or {}),
                error_per_layer=None if m is None else [_mean(col) for col in zip(*m)],
                kv_bytes_per_step=list(r.kv_bytes_per_step),
                exact_kv_bytes_per_step=list(r.exact_kv_bytes_per_step),
            )
        )
    return out


def _scalars(metrics: dict) -> dict:
    """The scalar metrics of a run (a per-step top-1 agreement, from older results, becomes its mean)."""
    out = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
    if isinstance(metrics.get("top1_agreement"), list):
        out["top1_agreement"] = _mean(metrics["top1_agreement"])
    return out


ALL = ("gauges", "bytes_per_step", "error_per_step", "error_per_layer", "kl_and_agreement", "quality_vs_memory")


def overview_figures(result: CompareResult) -> dict[str, go.Figure]:
    """The figures that need no view choice, by name (used by the HTML report)."""
    return {name: globals()[name](result) for name in ALL}
