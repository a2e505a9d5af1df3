"""What each head keeps: one retention map per run, drawn from the kept-position snapshots a result records.

A map has the token positions across (the prompt, then the generated tokens, past a dotted line) and one
row per (layer, KV head) down. Each cell is one of:

* **evicted**: the cache no longer holds the token;
* **summarized**: not held itself, but standing in what is held (SubGen's clusters and samples, CaM's merged
  values, BalanceKV's and weighted k-center's weights; ``Compressor.summarizes``);
* **quantized**: held as codes, shaded by the measured bits per number (darker: more bits);
* **kept**: held at full precision; among those, the **sink** (the run of kept tokens from the first
  position) and the **window** (the run of kept tokens up to the newest), unless the row keeps everything;
* not seen yet (blank): a generated position after the step shown.

Snapshots (``kvlab.measure.retention``) are taken at a bounded number of steps; the map at step s shows
each run's latest snapshot at or before s. Past ``MAX_COLUMNS`` positions the columns are pooled as the
attention maps are: a column shows the most-kept state among its positions (kept > quantized >
summarized > evicted). Nothing is recomputed: the masks are the result's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.core.bitmask import unpack
from kvlab.core.results import CompareResult, RunResult
from kvlab.report.comparison_figures import MAX_COLUMNS, Pooling, no_data

NOT_SEEN, EVICTED, SUMMARIZED, KEPT, SINK, WINDOW = 0, 1, 2, 20, 21, 22
QUANTIZED = 10  # 10 + (bits - 1): 1..8 bits -> 10..17
COLOURS = {
    NOT_SEEN: "#ffffff",
    EVICTED: "#e5e7eb",
    SUMMARIZED: "#f5c2e7",
    KEPT: "#2563eb",
    SINK: "#7c3aed",
    WINDOW: "#16a34a",
}
QUANT_SHADES = ("#fed7aa", "#fdba74", "#fb923c", "#f97316", "#ea580c", "#c2410c", "#9a3412", "#7c2d12")  # 1..8 bits
LEGEND = (
    (KEPT, "kept (full precision)"),
    (SINK, "sink: kept from the first token on"),
    (WINDOW, "window: kept up to the newest token"),
    (QUANTIZED + 3, "quantized (darker: more bits per number)"),
    (SUMMARIZED, "summarized (in clusters, merged values or weights)"),
    (EVICTED, "evicted"),
    (NOT_SEEN, "not generated yet"),
)
TOP = 22


def colour_of(code: int) -> str:
    if QUANTIZED <= code < QUANTIZED + len(QUANT_SHADES):
        return QUANT_SHADES[code - QUANTIZED]
    return COLOURS.get(code, "#000000")


def colourscale() -> list[list]:
    """A discrete plotly colourscale over the codes 0..TOP (each code its own colour)."""
    stops: list[list] = []
    for code in range(TOP + 1):
        c = colour_of(code)
        stops += [[code / (TOP + 1), c], [(code + 1) / (TOP + 1), c]]
    return stops


@dataclass
class RunMap:
    """One run's recorded snapshots."""

    label: str
    layers: int
    kv_heads: int
    prompt_tokens: int
    streaming: bool
    summarizes: bool
    snapshots: list[dict]

    @classmethod
    def of(cls, run: RunResult) -> RunMap | None:
        ret = (run.extras or {}).get("retention")
        if not isinstance(ret, dict) or not ret.get("snapshots"):
            return None
        return cls(
            run.label, int(ret["layers"]), int(ret["kv_heads"]), int(ret["prompt_tokens"]),
            bool(ret.get("streaming")), bool(ret.get("summarizes")), list(ret["snapshots"]),
        )  # fmt: skip

    @property
    def steps(self) -> list[int]:
        return sorted({int(s["step"]) for s in self.snapshots})

    @property
    def changes_while_decoding(self) -> bool:
        """Whether its prompt's rows change after compression (not only new tokens appended)."""
        return self.streaming

    def at(self, step: int) -> dict:
        """The latest snapshot taken at or before ``step`` (the first one when none is). A prefill-only run
        (not ``streaming``) is snapshotted after compression and at its end only; between them its prompt
        stays as compressed and each generated token is appended: its end snapshot cut at ``step`` is its
        state then (``cut_from`` marks such a view)."""
        shot = self.snapshots[0]
        for s in self.snapshots:
            if int(s["step"]) <= step:
                shot = s
        last = self.snapshots[-1]
        if not self.streaming and int(shot["step"]) < step < int(last["step"]):
            seen = int(last["seen"]) - (int(last["step"]) - step)
            return {**last, "step": step, "seen": seen, "cut_from": int(last["seen"])}
        return shot

    def masks(self, shot: dict) -> tuple[np.ndarray, np.ndarray]:
        """(held, full) of a snapshot as [layers * kv_heads, seen] bool."""
        stored, seen = int(shot.get("cut_from", shot["seen"])), int(shot["seen"])
        shape = (self.layers, self.kv_heads, stored)
        rows = self.layers * self.kv_heads
        held, full = (unpack(shot[k], shape).reshape(rows, -1)[:, :seen] for k in ("held", "full"))
        return held, full


def codes(held: np.ndarray, full: np.ndarray, summarizes: bool, bits: float | None, width: int) -> np.ndarray:
    """[rows, width] uint8 codes of one snapshot (positions past its ``seen`` are ``NOT_SEEN``)."""
    rows, seen = held.shape
    out = np.full((rows, width), NOT_SEEN, dtype=np.uint8)
    part = np.where(held, KEPT, SUMMARIZED if summarizes else EVICTED).astype(np.uint8)
    coded = held & ~full
    if coded.any():
        shade = QUANTIZED + min(len(QUANT_SHADES) - 1, max(0, round(bits or 1) - 1))
        part[coded] = SUMMARIZED if summarizes else shade
    if seen:
        sink = np.cumprod(full, axis=1).astype(bool)
        window = np.cumprod(full[:, ::-1], axis=1)[:, ::-1].astype(bool)
        whole = full.all(axis=1, keepdims=True)
        part[sink & ~whole] = SINK
        part[window & ~whole & ~sink] = WINDOW
    out[:, :seen] = part
    return out


def pooled(x: np.ndarray, pooling: Pooling) -> np.ndarray:
    """[rows, n] codes -> [rows, columns]: each column's most-kept state (the largest code)."""
    if pooling.width == 1:
        return x
    return pooling.pool(x.astype(np.float32), "max").astype(np.uint8)


def maps_of(result: CompareResult) -> list[RunMap]:
    return [m for m in (RunMap.of(r) for r in result.runs) if m is not None]


def last_step(result: CompareResult) -> int:
    """The largest snapshot step of any run (the slider's end)."""
    return max((s for m in maps_of(result) for s in m.steps), default=0)


def snapshot_steps(result: CompareResult) -> list[int]:
    """Every step at which some run was snapshotted."""
    return sorted({s for m in maps_of(result) for s in m.steps})


def _fraction(x: np.ndarray, n: int) -> float:
    return float(x[:, :n].mean()) if n and x.size else 0.0


def run_title(m: RunMap, shot: dict, step: int) -> str:
    """A map's title: the run, the step it shows, what it holds of the prompt (mean over layers and heads)."""
    held, full = m.masks(shot)
    n = m.prompt_tokens
    at = f"step {int(shot['step'])}"
    if int(shot["step"]) != step:
        ended = shot is m.snapshots[-1]
        at += " (its run ended there)" if ended else f" (its latest snapshot at or before {step})"
    if shot.get("stage") == "compressed":
        at = "after compression"
    elif shot.get("stage") == "question":
        at = "after the question"
    parts = [f"full precision {100 * _fraction(full, n):.0f}%"]
    if (held & ~full).any():
        what = "summarized" if m.summarizes else f"quantized {100 * _fraction(held & ~full, n):.0f}%"
        if not m.summarizes and shot.get("bits") is not None:
            what += f" at {shot['bits']:.2f} bits/number"
        parts.append(what)
    if m.summarizes and not (held & ~full).any():
        parts.append(f"summarized {100 * (1 - _fraction(held, n)):.0f}%")
    elif not (held & ~full).any():
        parts.append(f"evicted {100 * (1 - _fraction(held, n)):.0f}%")
    still = (
        ""
        if m.changes_while_decoding or m.label == "exact"
        else " · prefill-only: its prompt stays as compressed, each generated token is kept"
    )
    return f"<b>{m.label}</b> · {at} · of the prompt: {', '.join(parts)}{still}"


def figure_or_empty(result: CompareResult | None) -> go.Figure:
    """The maps at the end of a result, or the empty figure without one."""
    if result is None:
        return no_data("What each head keeps", "no result yet")
    return figure(result)


def figure(result: CompareResult, step: int | None = None, labels: list[str] | None = None) -> go.Figure:
    """One retention map per run (or per run of ``labels``) at decode ``step`` (None: the end)."""
    maps = [m for m in maps_of(result) if not labels or m.label in labels]
    if not maps:
        return no_data("What each head keeps", "no kept-position snapshots in this result (run a comparison)")
    end = last_step(result)
    step = end if step is None else max(0, min(int(step), end))
    width = max(int(s["seen"]) for m in maps for s in m.snapshots)
    pooling = Pooling.of(width, MAX_COLUMNS)
    x = pooling.x()
    heights = [m.layers * m.kv_heads for m in maps]
    shots = [m.at(step) for m in maps]
    fig = make_subplots(
        rows=len(maps), cols=1, shared_xaxes=True, vertical_spacing=min(0.08, 0.35 / len(maps)),
        row_heights=heights, subplot_titles=[run_title(m, s, step) for m, s in zip(maps, shots)],
    )  # fmt: skip
    scale = colourscale()
    for i, (m, shot) in enumerate(zip(maps, shots), start=1):
        held, full = m.masks(shot)
        z = pooled(codes(held, full, m.summarizes, shot.get("bits"), width), pooling)
        ys = [f"L{layer} h{h}" for layer in range(m.layers) for h in range(m.kv_heads)]
        fig.add_trace(
            go.Heatmap(
                z=z, x=x, y=ys, zmin=0, zmax=TOP + 1, colorscale=scale, showscale=False, xgap=0, ygap=0,
                hovertemplate="position %{x}<br>%{y}<extra>" + m.label + "</extra>",
            ),
            row=i, col=1,
        )  # fmt: skip
        every = max(1, math.ceil(m.layers / 10))
        fig.update_yaxes(
            autorange="reversed", tickmode="array", tickvals=[f"L{layer} h0" for layer in range(0, m.layers, every)],
            ticktext=[f"layer {layer}" for layer in range(0, m.layers, every)], tickfont={"size": 9}, row=i, col=1,
        )  # fmt: skip
        fig.add_vline(x=m.prompt_tokens - 0.5, line={"color": "#111827", "width": 1, "dash": "dot"}, row=i, col=1)
    for a in fig.layout.annotations:
        a.font = {"size": 11}
        a.x, a.xanchor = 0.0, "left"
    pooled_note = (
        "" if pooling.width == 1 else f" · each column: the most-kept state of {pooling.width} positions (pooled)"
    )
    fig.update_layout(
        title={
            "text": f"What each head keeps · {step_text(result, step)}<br><sup>rows: layer x KV head; the dotted line "
            f"ends the prompt ({maps[0].prompt_tokens} tokens){pooled_note}</sup>",
            "font": {"size": 14},
        },
        height=120 + sum(max(90, 2 * h) + 40 for h in heights),
        margin={"l": 70, "r": 20, "t": 90, "b": 40},
        template="plotly_white",
    )
    fig.update_xaxes(title_text="token position", row=len(maps), col=1)
    return fig


def step_text(result: CompareResult, step: int) -> str:
    end = last_step(result)
    return "after compression" if step == 0 else f"decode step {step} of {end}"


def legend_html() -> str:
    """The map's colours, as a row of swatches."""
    items = "".join(
        f"<span class='kv-ret-key'><span style='display:inline-block;width:12px;height:12px;margin-right:4px;"
        f"vertical-align:middle;border:1px solid #9ca3af;background:{colour_of(code)}'></span>{text}</span> "
        for code, text in LEGEND
    )
    return f"<div class='kv-ret-legend' id='kv-ret-legend' style='font-size:.85em;line-height:1.9'>{items}</div>"


__all__ = [
    "RunMap",
    "codes",
    "figure",
    "figure_or_empty",
    "last_step",
    "legend_html",
    "maps_of",
    "snapshot_steps",
    "step_text",
]
