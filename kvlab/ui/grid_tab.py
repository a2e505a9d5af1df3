"""The "Needle grid" tab: load a sweep's ``results.json`` and draw its depth x length grids.

Nothing is recomputed: the file's cells (``kvlab sweep --depths ...``) are counted into one
heatmap per method@budget (``kvlab.report.needle_grids``).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import gradio as gr

from kvlab.report.needle_grids import GridError, grid_figure, grids_from_results

MAX_BYTES = 64 * 1024 * 1024


def load_grid(path: str | None) -> tuple[str, object]:
    """(summary HTML, figure) for an uploaded results.json; a bad file raises ``gr.Error``."""
    if not path:
        raise gr.Error("choose a sweep's results.json to load")
    try:
        if Path(path).stat().st_size > MAX_BYTES:
            raise gr.Error(f"the file is larger than {MAX_BYTES // 2**20} MiB")
        data = json.loads(Path(path).read_bytes())
        protocol, items = grids_from_results(data)
    except OSError as exc:
        raise gr.Error(f"cannot read the file: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise gr.Error("the file is not JSON: load a sweep's results.json") from None
    except GridError as exc:
        raise gr.Error(str(exc)) from None
    config = data.get("config") or {}
    g = items[0]
    seeds = max(n for row in g.seeds for n in row)
    summary = (
        f"<p id='kv-grid-summary'>task <b>{html.escape(str(config.get('task', '?')))}</b>, "
        f"protocol <b>{html.escape(protocol)}</b>: {len(items)} runs, depths "
        f"{html.escape(', '.join(f'{d:g}' for d in g.depths))}, lengths "
        f"{html.escape(', '.join(str(n) for n in g.lengths))}, up to {seeds} seeds a cell "
        f"({html.escape(Path(path).name)}, not recomputed)</p>"
    )
    return summary, grid_figure(items, f"Needle grid ({protocol}): found per depth x length")


def grid_tab() -> None:
    """The tab's components and its one event (inside a ``gr.Tab``)."""
    gr.Markdown(
        "Load the `results.json` of a sweep over needle depths "
        "(`python -m kvlab sweep --task needle --lengths 1k,2k,4k --depths 0,0.25,0.5,0.75,1`): "
        "one heatmap per method@budget, green where the answer was found, red where not; "
        "cells show hits/seeds."
    )
    upload = gr.File(label="Sweep results.json", file_types=[".json"], type="filepath", elem_id="kv-grid-upload")
    summary = gr.HTML("", elem_id="kv-grid-info")
    plot = gr.Plot(label="Needle grid", elem_id="kv-grid")
    upload.upload(load_grid, upload, [summary, plot], api_name="load_grid")
