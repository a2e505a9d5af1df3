"""The "Claims" tab: every paper claim of the committed reproduction summary, judged, with its evidence.

Reads ``bench/results/reproduce/summary.json`` (``KVLAB_REPRODUCE_SUMMARY`` names another file) when the
page is built and shows it whole, filtered by paper and by verdict on the page; nothing is recomputed
(``kvlab.report.claims_view``). The implementation checks and the controls sit apart, below the claims.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

import gradio as gr

from kvlab.report.boards import RESULTS_DIR, shown_path
from kvlab.report.claims_view import FILTERS, Summary, SummaryError, apart_html, claims_html

SUMMARY = RESULTS_DIR / "reproduce" / "summary.json"


def summary_path() -> Path:
    env = os.environ.get("KVLAB_REPRODUCE_SUMMARY", "").strip()
    return Path(env) if env else SUMMARY


def read_summary(path: Path) -> tuple[Summary | None, str]:
    """The summary, or None and why it cannot be shown (one line)."""
    try:
        return Summary.of(json.loads(path.read_text(encoding="utf-8"))), ""
    except OSError:
        return None, f"no reproduction summary at {shown_path(path)}: run `python -m kvlab reproduce all`"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, f"{shown_path(path)} is not JSON"
    except SummaryError as exc:
        return None, f"{shown_path(path)}: {exc}"


def head_html(s: Summary, path: Path) -> str:
    return (
        f"<p id='kv-claims-run'>From <code>{html.escape(shown_path(path))}</code>: {s.run_text()}. Not "
        f"recomputed.</p><p id='kv-claims-tally'>{html.escape(s.tally_text())}</p>"
    )


def claims_tab(path: Path | None = None) -> Summary | None:
    """The tab's components and events (inside a ``gr.Tab``)."""
    path = path or summary_path()
    s, why = read_summary(path)
    gr.Markdown(
        "Each paper claim kvlab reproduces, as the committed run of `python -m kvlab reproduce all` judged it at "
        "the paper's operating point: the quoted claim, the operating point, the verdict (holds, does not hold, "
        "inconclusive, not testable), the effect with n and its 95% interval, and the command that reproduces "
        "it. The checks of kvlab's own implementation and the controls are listed apart, below. "
        "How verdicts are decided: `docs/reproductions.md` in the repository."
    )
    if s is None:
        gr.HTML(f"<p id='kv-claims-run'>{html.escape(why)}</p>", elem_id="kv-claims-info")
        return None
    gr.HTML(head_html(s, path), elem_id="kv-claims-info")
    with gr.Row():
        papers = gr.CheckboxGroup(s.papers(), value=[], label="Paper (none ticked: all)", elem_id="kv-claims-paper")
        verdicts = gr.CheckboxGroup(
            list(FILTERS), value=[], label="Verdict (none ticked: all)", elem_id="kv-claims-verdict"
        )
    claims = gr.HTML(claims_html(s), elem_id="kv-claims")
    apart = gr.HTML(apart_html(s), elem_id="kv-claims-apart")

    def filtered(p: list[str] | None, v: list[str] | None) -> tuple[str, str]:
        return claims_html(s, p or [], v or []), apart_html(s, p or [], v or [])

    gr.on(
        [papers.input, verdicts.input],
        filtered,
        [papers, verdicts],
        [claims, apart],
        api_name="claims",
        show_progress="hidden",
    )
    return s


__all__ = ["claims_tab", "read_summary", "summary_path"]
