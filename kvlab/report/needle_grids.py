"""Needle grids: a sweep's accuracy per needle depth and prompt length, one heatmap per method@budget.

The picture the needle-in-a-haystack literature draws: depth of the needle (0 = start of the
context, 1 = its end) down, prompt length across, each cell coloured from red (never found) to
green (always found) and annotated with hits / seeds. ``grids`` reads the compact cell records of
``kvlab.sweep`` (or a whole ``results.json`` through ``grids_from_results``); ``grid_figure``
draws them, one panel per label, sharing one colour scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

# red (0) through yellow to green (1), as in the needle-in-a-haystack pictures
COLORSCALE = [[0.0, "#d73027"], [0.5, "#fee08b"], [1.0, "#1a9850"]]


class GridError(ValueError):
    """A results file that holds no scored cells to draw."""


@dataclass
class Grid:
    """Hits and seeds of one run label per (depth, length): ``hits[i][j]`` at ``depths[i]``, ``lengths[j]``."""

    label: str
    method: str
    budget: str | None
    depths: list[float]
    lengths: list[int]
    hits: list[list[int]]  # [n_depths][n_lengths]
    seeds: list[list[int]]  # [n_depths][n_lengths]; 0 where the cell was not run

    @property
    def accuracy(self) -> list[list[float | None]]:
        """hits / seeds per cell, None where no seed ran: [n_depths][n_lengths]."""
        return [[h / n if n else None for h, n in zip(hr, nr)] for hr, nr in zip(self.hits, self.seeds)]


def cell_depth(rec: dict, default: float = 0.5) -> float:
    """The depth a cell record was built at: the cell's own, else its task's, else ``default``."""
    d = rec["cell"].get("depth", rec.get("meta", {}).get("depth"))
    return float(default if d is None else d)


def grids(recs: list[dict], default_depth: float = 0.5) -> list[Grid]:
    """One grid per run label (in the order the labels first appear) from compact cell records.

    A run counts as a hit when its ``task_score`` is >= 0.5 (exact match scores 1.0 or 0.0); runs
    without a task score (the ``document`` task) are left out, and so is a label that has none.
    """
    depths = sorted({cell_depth(r, default_depth) for r in recs})
    lengths = sorted({r["cell"]["length"] for r in recs})
    acc: dict[str, Grid] = {}
    for rec in recs:
        i, j = depths.index(cell_depth(rec, default_depth)), lengths.index(rec["cell"]["length"])
        for run in rec["runs"]:
            score = run["metrics"].get("task_score")
            if score is None or (isinstance(score, float) and math.isnan(score)):
                continue
            g = acc.get(run["label"])
            if g is None:
                zeros = [[0] * len(lengths) for _ in depths]
                g = acc[run["label"]] = Grid(
                    run["label"], run["method"], run.get("budget"), depths, lengths, zeros, [r[:] for r in zeros]
                )
            g.hits[i][j] += score >= 0.5
            g.seeds[i][j] += 1
    return list(acc.values())


def grids_from_results(data: dict) -> tuple[str, list[Grid]]:
    """(protocol, grids) from a sweep's ``results.json``; raises ``GridError`` when nothing can be drawn."""
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise GridError("not a kvlab sweep results.json: it has no 'cells' list")
    config = data.get("config")
    if not isinstance(config, dict):
        config = {}
    protocol = str(data.get("protocol") or config.get("protocol") or "query-aware")
    try:
        out = grids(data["cells"], float(config.get("depth", 0.5)))
    except (KeyError, TypeError, ValueError) as exc:
        raise GridError(f"a cell of this results.json is not a kvlab sweep cell ({exc!r})") from None
    if not out:
        raise GridError("this sweep has no task scores (a task with an answer is needed for a grid)")
    return protocol, out


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def grid_figure(items: list[Grid], title: str = "Needle grid", cols: int = 4) -> go.Figure:
    """One heatmap per grid (depth down, length across), red-yellow-green over accuracy 0..1, cells
    annotated with hits/seeds; an empty cell (not run) stays blank."""
    cols = max(1, min(cols, len(items)))
    rows = max(1, math.ceil(len(items) / cols))
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=[g.label for g in items] or [""],
        horizontal_spacing=0.06,
        vertical_spacing=0.32 / rows if rows > 1 else 0.1,  # room for the x title above the next row's titles
    )
    for k, g in enumerate(items):
        text = [[f"{h}/{n}" if n else "" for h, n in zip(hr, nr)] for hr, nr in zip(g.hits, g.seeds)]
        fig.add_trace(
            go.Heatmap(
                z=g.accuracy,
                x=[_length_label(n) for n in g.lengths],
                y=[f"{d:g}" for d in g.depths],
                text=text,
                texttemplate="%{text}",
                coloraxis="coloraxis",
                xgap=2,
                ygap=2,
                name=g.label,
                hovertemplate="length %{x}<br>depth %{y}<br>found %{text}<extra>" + g.label + "</extra>",
            ),
            row=k // cols + 1,
            col=k % cols + 1,
        )
    fig.update_xaxes(type="category", title_text="prompt tokens")
    fig.update_yaxes(type="category", autorange="reversed", title_text="depth")
    fig.update_layout(
        title=title,
        coloraxis={"colorscale": COLORSCALE, "cmin": 0, "cmax": 1, "colorbar": {"title": {"text": "found"}}},
        height=120 + 280 * rows,
        margin={"l": 60, "r": 30, "t": 80, "b": 50},
        template="plotly_white",
    )
    return fig
