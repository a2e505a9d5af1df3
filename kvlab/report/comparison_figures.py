"""Plotly figure builders for the dashboard and its HTML export: pure functions of a ``CompareResult``.

Every builder takes the result (plus view choices such as layer and head) and returns a
``plotly.graph_objects.Figure`` with an explicit height. When the data a figure needs is absent
(no metrics recorded, a single budget, an imported file from an older version) it returns a figure
that says so in words instead of failing.

Quality vs memory, error per layer and bytes per step are the builders of ``kvlab.report.charts``
(shared with the sweep report, with its axis definitions), drawn from ``summaries(result)``.

Metric names (``RunResult.metrics``, docs/metrics.md): ``attn_rel_error`` [steps][layers], ``kl`` [steps],
``top1_agreement`` (scalar or [steps]), ``perplexity``, ``first_divergence``, ``text_similarity``,
``task_score``. Attention maps and kept positions live in ``RunResult.extras`` (see ``attn_map``
and ``kept_of``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.core.results import CompareResult, RunResult
from kvlab.report.charts import (
    ATTN_ERROR,
    KIB,
    PALETTE,
    RunSummary,
    bytes_figure,
    error_per_layer_figure,
    no_data,
    quality_figure,
)
from kvlab.report.charts import finite as _finite
from kvlab.report.charts import layout as _layout
from kvlab.report.charts import mean as _mean


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
    """One gauge per run: the peak bytes held over the run as % of the exact cache's peak (the bar and the
    number) and the mean over the run as % of the exact cache's mean (the darker band); shared per-model
    bytes (QJL's sketches) are named under the title."""
    runs = result.runs
    if not runs:
        return no_data("Cache size", "no runs yet")
    rows = math.ceil(len(runs) / per_row)
    cols = min(per_row, len(runs))
    fig = make_subplots(rows=rows, cols=cols, specs=[[{"type": "indicator"}] * cols for _ in range(rows)])
    for i, r in enumerate(runs):
        mem = r.memory
        peak, mean = 100 * (mem["peak_fraction"] or 0.0), 100 * (mem["mean_fraction"] or 0.0)
        shared = f"<br>+ {mem['shared_bytes'] / KIB:,.0f} KiB shared across sequences" if mem["shared_bytes"] else ""
        # the KiB figures are on the cards; a gauge is a fifth of the page wide, so its subtitle stays short
        fig.add_trace(
            go.Indicator(
                mode="gauge+number",
                value=peak,
                number=dict(suffix="% peak", valueformat=".1f", font=dict(size=20)),
                title=dict(
                    text=f"{r.label}<br><span style='font-size:11px;color:#666'>"
                    f"mean {mean:.0f}% of exact's{shared}</span>",
                    font=dict(size=13),
                ),
                gauge=dict(
                    axis=dict(range=[0, 100], ticksuffix="%"),
                    bar=dict(color=color_of(result, r.label)),
                    steps=[dict(range=[0, 100], color="#f3f3f3"), dict(range=[0, mean], color="#cfcfcf")],
                    threshold=dict(line=dict(color="#333", width=2), value=100),
                ),
            ),
            row=i // per_row + 1,
            col=i % per_row + 1,
        )
    fig = _layout(
        fig, 230 * rows + 30, "Cache held: peak (bar) and mean over the run (grey band), % of the exact cache"
    )
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
    """The recorded attention map of a run (``extras["attn_map"]``, layout in kvlab/measure/metrics.py) or None."""
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


MAX_COLUMNS = 1100  # about the pixel width of the attention figure: longer prompts are max-pooled to this
GAMMA = 0.6  # colour = (weight / scale) ** GAMMA: a power scale lifts the small weights off white
QUANTILE = 0.995  # the weight shown at full colour: this quantile of exact's weights for the same query
TICKS = (0.0, 0.1, 0.5, 1.0)  # colourbar ticks, as weight / scale
WEIGHTS = [[0.0, "#ffffff"], [0.15, "#fde4b0"], [0.4, "#f99a3e"], [0.7, "#d4380d"], [1.0, "#5c0a0a"]]
HELD = [[0.0, "#eef2f6"], [1.0, "#4a7bab"]]  # the kept row: light where evicted, blue where kept
ALL_HELD = 0.35  # the kept row's shade for a method that holds every position in compressed form


def answer_of(result: CompareResult) -> list[int]:
    """Prompt positions of the task's answer (e.g. the needle's number) recorded with the result, or []."""
    pos = (result.settings or {}).get("answer_positions")
    if not isinstance(pos, list):
        return []
    return [p for p in pos if isinstance(p, int) and not isinstance(p, bool) and 0 <= p < result.prompt_tokens]


@dataclass
class Pooling:
    """Prompt positions grouped into at most ``MAX_COLUMNS`` columns of ``width`` positions each."""

    n: int
    width: int

    @classmethod
    def of(cls, n: int, max_columns: int = MAX_COLUMNS) -> Pooling:
        return cls(n, max(1, math.ceil(n / max_columns)))

    @property
    def columns(self) -> int:
        return math.ceil(self.n / self.width)

    def x(self) -> np.ndarray:
        """Each column's first prompt position."""
        return np.arange(self.columns) * self.width

    def pool(self, rows: np.ndarray, how: str = "max") -> np.ndarray:
        """[r, n] -> [r, columns]: the max (or mean) of each column's positions (NaN rows stay NaN)."""
        pad = self.columns * self.width - self.n
        fill = -np.inf if how == "max" else np.nan
        x = np.pad(rows, ((0, 0), (0, pad)), constant_values=fill).reshape(rows.shape[0], self.columns, self.width)
        return x.max(-1) if how == "max" else np.nanmean(x, -1)

    def caption(self) -> str:
        return "" if self.width == 1 else f" · each column: the largest weight of {self.width} positions"


def _rows(m: list | None, n: int) -> np.ndarray | None:
    """A map's rows as float32 [Q, n] (None entries, i.e. non-finite values, become 0); None if not a map."""
    try:
        rows = [[0.0 if w is None else float(w) for w in row[:n]] + [0.0] * (n - len(row)) for row in m or []]
    except (TypeError, ValueError):  # an imported file with something else in its map
        return None
    return np.array(rows, dtype=np.float32) if rows else None


def _scale(exact: np.ndarray) -> np.ndarray:
    """Per query: exact's ``QUANTILE`` weight [Q, 1], the value shown at full colour (sinks exceed it)."""
    return np.maximum(np.quantile(exact, QUANTILE, axis=-1, keepdims=True), 1e-6)


def _held(run: RunResult, pooling: Pooling) -> np.ndarray:
    """The kept row [1, columns]: the share of each column's positions the run keeps (``ALL_HELD`` when it
    evicts nothing)."""
    kept = kept_of(run)
    held = np.full((1, pooling.n), ALL_HELD, dtype=np.float32)
    if kept is not None:
        held[:] = 0
        idx = np.array([p for p in kept if 0 <= p < pooling.n], dtype=np.int64)
        held[0, idx] = 1
    return pooling.pool(held, "mean")


def attention_heatmaps(result: CompareResult, labels: list[str] | None = None) -> go.Figure:
    """Per run, exact's weights and the method's own estimate for the last decode queries, over the prompt.

    One panel per run: on top exact's attention of the run's queries over the full prompt, below the
    weights the method itself assigns (``Compressor.estimated_weights``: softmax over the kept
    tokens, QJL's sketched scores, SubGen's cluster estimates), and between them one kept row (light
    where the method evicted the positions). Two traces per run whatever the evictions. Colour: each
    weight divided by exact's 99.5th-percentile weight of the same query (``QUANTILE``), capped at
    1, raised to the power ``GAMMA`` (0.6). Prompts longer than ``MAX_COLUMNS`` positions are
    max-pooled. The task's answer, when recorded, is marked by one dotted line. The figure is
    assembled as one dict (no per-panel plotly updates): its cost is the pooling, not the number
    of runs or evicted spans.
    """
    site = map_site(result)
    title = "Attention over the prompt" + (f" · layer {site[0]}, head {site[1]}" if site else "")
    runs = [r for r in compressed_runs(result) if labels is None or r.label in labels]
    n = result.prompt_tokens
    maps: list[tuple[RunResult, np.ndarray]] = []  # (run, exact's rows [Q, n]) of the runs with a map
    for r in runs:
        m = attn_map(r)
        exact = None if m is None else _rows(m["exact"], n)
        if exact is not None:
            maps.append((r, exact))
    runs = [r for r, _ in maps]
    if not runs or not n:
        why = "no attention maps in this result (turn the measurements on and run again)"
        return no_data(title, why, height=300)
    pooling = Pooling.of(n)
    height = 110 + PANEL_PX * len(runs)
    gap = min(0.06, 24 / height)
    span = (1 - gap * (len(runs) - 1)) / len(runs)
    data: list[dict] = []
    layout: dict[str, Any] = {}  # plotly's layout, as JSON
    for i, (r, exact) in enumerate(maps):
        top = 1 - i * (span + gap)
        data += _panel(r, exact, pooling, i + 1, colorbar_len=min(1.0, 300 / height))
        layout[f"yaxis{i + 1}"] = dict(domain=[max(0.0, top - span), min(1.0, top)], **_panel_axis(r, data[-2]))
        layout[f"xaxis{i + 1}"] = dict(
            anchor=f"y{i + 1}",
            matches="x" if i else None,
            showticklabels=i == len(runs) - 1,
            showgrid=False,
            zeroline=False,
            range=[-0.5 * pooling.width, n],
        )
    layout[f"xaxis{len(runs)}"]["title"] = dict(text="prompt position" + pooling.caption())
    answer = answer_of(result)
    if answer:
        mid = (answer[0] + answer[-1]) / 2
        layout["shapes"] = [dict(type="line", x0=mid, x1=mid, y0=0, y1=1, xref="x", yref="paper", line=ANSWER_LINE)]
        layout["annotations"] = [
            dict(
                text="answer", x=mid, y=1.0, xref="x", yref="paper", yanchor="bottom", showarrow=False,
                font=dict(size=11, color=ANSWER_LINE["color"]),
            )
        ]  # fmt: skip
    fig = go.Figure(dict(data=data, layout=layout))
    fig = _layout(fig, height, title)
    fig.update_layout(margin=dict(l=160, r=20, t=60, b=60))
    return fig


PANEL_PX = 150  # height of one run's panel
ANSWER_LINE = dict(color="#1f5fbf", width=1.5, dash="dot")


def _panel(run: RunResult, exact: np.ndarray, pooling: Pooling, k: int, colorbar_len: float) -> list[dict]:
    """One run's two traces (axes x{k}, y{k}): weights (exact's rows [Q, n], a gap, the method's) and the kept row."""
    m = attn_map(run) or {}
    method = _rows(m.get("method"), pooling.n)
    q = exact.shape[0]
    weights = np.full((2 * q + 1, pooling.columns), np.nan, dtype=np.float32)
    weights[:q] = pooling.pool(exact)
    if method is not None and method.shape[0] >= q:
        weights[q + 1 :] = pooling.pool(method[:q])
    scale = _scale(exact)
    scales = np.concatenate([scale, [[np.nan]], scale])
    axes = dict(xaxis=f"x{k}", yaxis=f"y{k}")
    x = pooling.x()
    weight_trace = dict(
        type="heatmap",
        z=np.minimum(weights / scales, 1.0) ** GAMMA,
        x=x,
        y=np.arange(2 * q + 1),
        customdata=weights,
        colorscale=WEIGHTS,
        zmin=0,
        zmax=1,
        showscale=k == 1,
        colorbar=dict(
            title=dict(text=f"weight ÷ exact's<br>{100 * QUANTILE:g}th percentile<br>(power {GAMMA:g})", side="right"),
            len=colorbar_len,
            y=1.0,
            yanchor="top",
            tickvals=[t**GAMMA for t in TICKS],
            ticktext=[f"{t:g}" for t in TICKS[:-1]] + ["≥ 1"],
        ),
        hovertemplate="position %{x}<br>weight %{customdata:.4f}<extra>" + run.label + "</extra>",
        hoverongaps=False,
        **axes,
    )
    held_trace = dict(
        type="heatmap",
        z=_held(run, pooling),
        x=x,
        y=[q],
        colorscale=HELD,
        zmin=0,
        zmax=1,
        showscale=False,
        hovertemplate=(
            "position %{x}<br>kept: %{z:.0%}" if kept_of(run) is not None else "every position held, compressed"
        )
        + "<extra>"
        + run.label
        + "</extra>",
        **axes,
    )
    return [weight_trace, held_trace]


def _panel_axis(run: RunResult, weight_trace: dict) -> dict:
    """A panel's y axis: its rows top to bottom (exact's queries, the kept row, the method's), labelled."""
    q = len(weight_trace["y"]) // 2
    label = run.label if (attn_map(run) or {}).get("method") else f"{run.label} (no per-token weights)"
    kept = "kept" if kept_of(run) is not None else "all held"
    return dict(
        tickvals=[(q - 1) / 2, q, q + 1 + (q - 1) / 2],
        ticktext=["exact", kept, label],
        autorange="reversed",
        showgrid=False,
        zeroline=False,
    )


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
                peak_fraction=r.memory["peak_fraction"],
                mean_fraction=r.memory["mean_fraction"],
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
