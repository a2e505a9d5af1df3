"""The "Leaderboard" tab: load a sweep's ``results.json`` and rank its methods by score against ratio.

Nothing is recomputed: the file's cells (``kvlab sweep --suite ruler --ratios ...``) are averaged
per method and compression ratio (``kvlab.report.leaderboard``): one line per method, the table per task,
and the CSV in kvpress's leaderboard columns to download.
"""

from __future__ import annotations

import html
import json
import tempfile
from pathlib import Path

import gradio as gr

from kvlab.report.leaderboard import (
    LeaderboardError,
    csv_text,
    figure,
    protocol_of,
    protocol_text,
    rows_from_results,
    table_html,
    tasks_of,
)

MAX_BYTES = 64 * 1024 * 1024


def load_leaderboard(path: str | None) -> tuple[str, object, str, str]:
    """(summary HTML, figure, table HTML, CSV path) for an uploaded results.json; a bad file raises ``gr.Error``."""
    if not path:
        raise gr.Error("choose a sweep's results.json to load")
    try:
        if Path(path).stat().st_size > MAX_BYTES:
            raise gr.Error(f"the file is larger than {MAX_BYTES // 2**20} MiB")
        data = json.loads(Path(path).read_bytes())
        items = rows_from_results(data)
    except OSError as exc:
        raise gr.Error(f"cannot read the file: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise gr.Error("the file is not JSON: load a sweep's results.json") from None
    except LeaderboardError as exc:
        raise gr.Error(str(exc)) from None
    config = data.get("config") or {}
    protocol = str(data.get("protocol") or config.get("protocol") or protocol_of(data["cells"]))
    methods = list(dict.fromkeys(r.method for r in items))
    ratios = sorted({r.ratio for r in items if r.ratio > 0})
    summary = (
        f"<p id='kv-board-summary'>{len(methods)} methods, {len(tasks_of(items))} tasks "
        f"({html.escape(', '.join(tasks_of(items)))}), compression ratios "
        f"{html.escape(', '.join(f'{x:g}' for x in ratios))} (fraction removed; kvlab's budget kept = 1 - ratio), "
        f"lengths {html.escape(', '.join(str(n) for n in config.get('lengths', [])))} "
        f"({html.escape(Path(path).name)}, not recomputed). Scores 0-100, each with its 95% interval over "
        f"prompts and n.</p><p id='kv-board-protocol'><b>Protocol:</b> {html.escape(protocol_text(protocol))}</p>"
    )
    out = Path(tempfile.mkdtemp(prefix="kvlab-board-")) / "leaderboard.csv"
    out.write_text(csv_text(items, protocol), encoding="utf-8")
    return summary, figure(items, protocol=protocol), table_html(items, protocol), str(out)


def leaderboard_tab() -> None:
    """The tab's components and its one event (inside a ``gr.Tab``)."""
    gr.Markdown(
        "Load the `results.json` of a sweep over compression ratios "
        "(`python -m kvlab sweep --suite ruler --lengths 1k --methods all --ratios 0.25,0.5,0.75 --seeds 10`): "
        "each method's average score against the compression ratio (the fraction of the cache removed, "
        "kvpress's convention; kvlab's budget is the fraction kept, 1 - ratio) with 95% intervals over "
        "prompts, its scores per task, the protocol it ran under, and the CSV in kvpress's leaderboard "
        "columns (then the protocol, n and the intervals)."
    )
    upload = gr.File(label="Sweep results.json", file_types=[".json"], type="filepath", elem_id="kv-board-upload")
    summary = gr.HTML("", elem_id="kv-board-info")
    plot = gr.Plot(label="Score against compression ratio", elem_id="kv-board")
    table = gr.HTML("", elem_id="kv-board-table")
    csv_file = gr.File(label="leaderboard.csv (method, ratio, score per task, average)", interactive=False,
                       elem_id="kv-board-csv")  # fmt: skip
    upload.upload(load_leaderboard, upload, [summary, plot, table, csv_file], api_name="load_leaderboard")
