"""The "Needle grid" tab: the committed depth x length grids, open by default, or a sweep's ``results.json``.

A picker lists every committed sweep over at least two depths and two lengths (``kvlab.report.boards``),
labelled from its file (model, lengths, protocol, prompts); the first is drawn when the page opens.
Nothing is recomputed: the file's cells (``kvlab sweep --depths ...``) are counted into one heatmap per
method@budget (``kvlab.report.needle_grids``).
"""

from __future__ import annotations

import html
from pathlib import Path

import gradio as gr

from kvlab.report import boards
from kvlab.report.leaderboard import LeaderboardError, protocol_text
from kvlab.report.needle_grids import GridError, grid_figure, grids_from_results
from kvlab.ui.leaderboard_tab import board_label, model_name


def grid_view(path: Path, source: str) -> tuple[str, object]:
    """(summary HTML, figure) of a sweep's results.json; a bad file raises ``gr.Error``."""
    try:
        data = boards.read_results(path)
        protocol, items = grids_from_results(data)
    except OSError as exc:
        raise gr.Error(f"cannot read the file: {exc.strerror or exc}") from None
    except LeaderboardError as exc:
        raise gr.Error(f"{exc}: load a sweep's results.json") from None
    except GridError as exc:
        raise gr.Error(str(exc)) from None
    config = data.get("config") or {}
    g = items[0]
    seeds = max(n for row in g.seeds for n in row)
    model = model_name(str(config.get("model") or "?"))
    task = html.escape(str(config.get("task", "?")))
    summary = (
        f"<p id='kv-grid-summary'><b>Model:</b> {html.escape(model)} · task <b>{task}</b> · {len(items)} runs, "
        f"depths {html.escape(', '.join(f'{d:g}' for d in g.depths))}, lengths "
        f"{html.escape(', '.join(str(n) for n in g.lengths))}, up to {seeds} seeds a cell · from "
        f"<code>{html.escape(source)}</code>, not recomputed.</p><p id='kv-grid-protocol'><b>Protocol:</b> "
        f"{html.escape(protocol_text(protocol))}</p>"
    )
    title = f"Needle grid · {model.split(' (')[0]} · {protocol}: found per depth x length"
    return summary, grid_figure(items, title)


def grid_tab(root: Path | None = None) -> list[boards.Board]:
    """The tab's components and events (inside a ``gr.Tab``), drawn with the first committed grid."""
    found = boards.grids(root)
    labels = [board_label(b) for b in found]
    by_label = dict(zip(labels, found))
    first = grid_view(found[0].path, boards.shown_path(found[0].path)) if found else ("", None)
    gr.Markdown(
        "The committed depth x length grids of this repository, or the `results.json` of a sweep over needle "
        "depths (`python -m kvlab sweep --task needle --lengths 1k,2k,4k --depths 0.1,0.3,0.5,0.7,0.9`): one "
        "heatmap per method@budget, green where the answer was found, red where not; cells show hits/seeds."
    )
    picker = gr.Dropdown(labels, value=labels[0] if labels else None, label="Committed grid", elem_id="kv-grid-pick")
    summary = gr.HTML(first[0], elem_id="kv-grid-info")
    plot = gr.Plot(value=first[1], label="Needle grid", elem_id="kv-grid")
    upload = gr.File(label="Or load a sweep's results.json", file_types=[".json"], type="filepath",
                     elem_id="kv-grid-upload")  # fmt: skip

    def pick(label: str):
        b = by_label.get(label)
        if b is None:
            raise gr.Error("pick a committed grid from the list")
        return (*grid_view(b.path, boards.shown_path(b.path)), gr.update(value=None))

    def uploaded(path: str | None):
        if not path:
            raise gr.Error("choose a sweep's results.json to load")
        return (*grid_view(Path(path), Path(path).name), gr.update(value=None))

    picker.input(pick, picker, [summary, plot, upload], api_name="needle_grid")
    upload.upload(uploaded, upload, [summary, plot, picker], api_name="load_grid")
    return found


__all__ = ["grid_tab", "grid_view"]
