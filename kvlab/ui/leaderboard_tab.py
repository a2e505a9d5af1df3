"""The "Leaderboard" tab: the committed leaderboards, open by default, or a sweep's ``results.json`` uploaded.

A picker lists every committed leaderboard (``kvlab.report.boards``: each sweep folder under
``bench/results`` over compression ratios), labelled from its own file: model, prompt length, protocol,
tasks x prompts. The first is drawn when the page opens. Nothing is recomputed: the file's cells are
averaged per method and ratio (``kvlab.report.leaderboard``): the figure draws each mean with its 95%
interval, the table groups the methods that paired tests cannot separate (``kvlab.report.board_table``)
and shows the fidelity columns where the board has them, and the CSV in kvpress's leaderboard columns is
offered for download.
"""

from __future__ import annotations

import html
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from kvlab.engine import embedded
from kvlab.report import boards
from kvlab.report.board_table import METRICS, grouped_table_html, rank_metrics
from kvlab.report.leaderboard import (
    LeaderboardError,
    Row,
    csv_text,
    figure,
    protocol_text,
    rows_from_results,
    tasks_of,
)

UPLOADED = "an uploaded file"


def model_name(spec: str) -> str:
    """An embedded model's display name ("SmolLM2-135M-Instruct (embedded Q4_1 GGUF)"), else the spec itself."""
    carried = embedded.embedded(spec) if spec else None
    return carried.display if carried else spec


def board_label(b: boards.Board) -> str:
    return b.label(model_name(b.model))


@dataclass
class Loaded:
    """One leaderboard read from its file: what the tab shows of it."""

    board: boards.Board
    rows: list[Row]
    source: str  # the file's name as the page says it ("bench/results/ruler-1k/results.json", an upload's name)
    ranking: list | None = None  # the ranking the file carries (``kvlab sweep`` writes it), read as it is


def read_board(path: Path, source: str) -> Loaded:
    """A results.json as a leaderboard; ``gr.Error`` (one line) when it cannot be one."""
    try:
        data = boards.read_results(path)
        board = boards.describe(path, data)
        if board is None:
            raise LeaderboardError("not a sweep's results.json: it has no 'cells' list of cell records")
        rows = rows_from_results(data)
    except OSError as exc:
        raise gr.Error(f"cannot read the file: {exc.strerror or exc}") from None
    except LeaderboardError as exc:
        raise gr.Error(str(exc)) from None
    stored = data.get("ranking")
    return Loaded(board, rows, source, stored if isinstance(stored, list) else None)


def summary_html(x: Loaded) -> str:
    """Where every number of the tab comes from: model, length, protocol, tasks, prompts, ratios, file."""
    b, items = x.board, x.rows
    tasks = tasks_of(items)
    ratios = sorted({r.ratio for r in items if r.ratio > 0})
    return (
        f"<p id='kv-board-summary'><b>Model:</b> {html.escape(model_name(b.model))} · <b>prompts:</b> "
        f"{html.escape(b.length_text)}, {b.prompts} per task · {boards.methods_text(r.method for r in items)}, "
        f"{len(tasks)} task{'s' if len(tasks) != 1 else ''} ({html.escape(', '.join(tasks))}), compression ratios "
        f"{html.escape(', '.join(f'{x:g}' for x in ratios))} (fraction removed; kvlab's budget kept = 1 - ratio) "
        f"· from <code>{html.escape(x.source)}</code>, not recomputed. Scores 0-100, each with its 95% interval "
        f"over prompts and n.</p><p id='kv-board-protocol'><b>Protocol:</b> "
        f"{html.escape(protocol_text(b.protocol))}</p>"
    )


def rendered(x: Loaded, metric: str) -> tuple[str, object, str, str, object]:
    """(summary, figure, grouped table, CSV path, the rank-by choices) of one leaderboard."""
    b = x.board
    title = f"{model_name(b.model).split(' (')[0]} · {b.length_text}: score against compression ratio"
    out = Path(tempfile.mkdtemp(prefix="kvlab-board-")) / "leaderboard.csv"
    out.write_text(csv_text(x.rows, b.protocol), encoding="utf-8")
    metrics = rank_metrics(x.rows)
    metric = metric if metric in metrics else "task_score"
    choices = gr.update(choices=[(METRICS[m], m) for m in metrics], value=metric)
    return (
        summary_html(x),
        figure(x.rows, title=title, protocol=b.protocol),
        grouped_table_html(x.rows, b.protocol, metric, x.ranking),
        str(out),
        choices,
    )


class LeaderboardTab:
    """The tab's state: the committed boards (found when the page is built) and the callbacks."""

    def __init__(self, root: Path | None = None):
        self.root = root
        self.boards = boards.leaderboards(root)
        self.labels = [board_label(b) for b in self.boards]

    def _committed(self, label: str) -> Loaded:
        for b, lab in zip(self.boards, self.labels):
            if lab == label:
                return read_board(b.path, boards.shown_path(b.path))
        raise gr.Error(f"no committed leaderboard named {label[:80]!r}; pick one from the list")

    def pick(self, label: str, metric: str = "task_score"):
        """The picker: draw a committed leaderboard (an uploaded file is let go)."""
        return (*self.rendered_or_empty(self._committed(label) if label else None, metric), gr.update(value=None))

    def upload(self, path: str | None, metric: str = "task_score"):
        """An uploaded results.json (the picker then says so)."""
        if not path:
            raise gr.Error("choose a sweep's results.json to load")
        x = read_board(Path(path), Path(path).name)
        return (*rendered(x, metric), gr.update(value=None))

    def rerank(self, label: str | None, path: str | None, metric: str):
        """The rank-by choice: the table again, grouped on that score (the upload's when one was loaded last)."""
        if path:
            x = read_board(Path(path), Path(path).name)
        elif label:
            x = self._committed(label)
        else:
            return gr.skip()
        return grouped_table_html(x.rows, x.board.protocol, metric, x.ranking)

    @staticmethod
    def rendered_or_empty(x: Loaded | None, metric: str):
        if x is None:
            empty = "<p id='kv-board-summary'>No leaderboard is committed under bench/results; upload one.</p>"
            return empty, None, "", None, gr.update(choices=[(METRICS["task_score"], "task_score")])
        return rendered(x, metric)

    def first(self) -> Loaded | None:
        """What the tab shows when the page opens: the first committed leaderboard (None when there is none)."""
        return self._committed(self.labels[0]) if self.labels else None


def leaderboard_tab(root: Path | None = None) -> LeaderboardTab:
    """The tab's components and events (inside a ``gr.Tab``), drawn with the first committed leaderboard."""
    tab = LeaderboardTab(root)
    first = tab.first()
    summary0, fig0, table0, csv0, _ = tab.rendered_or_empty(first, "task_score")
    metrics0 = rank_metrics(first.rows) if first else ["task_score"]
    gr.Markdown(
        "The committed leaderboards of this repository (`bench/results/*/results.json`), or a sweep's own "
        "`results.json` (`python -m kvlab sweep --suite ruler --lengths 1k --methods all --ratios 0.25,0.5,0.75 "
        "--seeds 10`): each method's average score against the compression ratio (the fraction of the cache "
        "removed, kvpress's convention; kvlab's budget is the fraction kept, 1 - ratio) with 95% intervals over "
        "prompts, its scores per task, the fidelity to exact where measured, the protocol it ran under, and the "
        "CSV in kvpress's leaderboard columns."
    )
    with gr.Row(equal_height=False):
        picker = gr.Dropdown(
            tab.labels,
            value=tab.labels[0] if tab.labels else None,
            label="Committed leaderboard (model · prompt length · protocol · tasks x prompts)",
            elem_id="kv-board-pick",
            scale=4,
        )
        metric = gr.Radio(
            [(METRICS[m], m) for m in metrics0],
            value="task_score",
            label="Group the table by",
            elem_id="kv-board-metric",
            scale=2,
        )
    summary = gr.HTML(summary0, elem_id="kv-board-info")
    plot = gr.Plot(value=fig0, label="Score against compression ratio", elem_id="kv-board")
    table = gr.HTML(table0, elem_id="kv-board-table")
    with gr.Row():
        csv_file = gr.File(value=csv0, label="leaderboard.csv (method, ratio, score per task, average)",
                           interactive=False, elem_id="kv-board-csv")  # fmt: skip
        upload = gr.File(label="Or load a sweep's results.json", file_types=[".json"], type="filepath",
                         elem_id="kv-board-upload")  # fmt: skip
    outputs = [summary, plot, table, csv_file, metric]
    picker.input(tab.pick, [picker, metric], [*outputs, upload], api_name="leaderboard")
    upload.upload(tab.upload, [upload, metric], [*outputs, picker], api_name="load_leaderboard")
    metric.input(tab.rerank, [picker, upload, metric], table, api_name="leaderboard_groups")
    return tab


__all__ = ["LeaderboardTab", "board_label", "leaderboard_tab", "model_name", "read_board"]
