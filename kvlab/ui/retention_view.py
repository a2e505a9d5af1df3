"""The "What each head keeps" tab's pieces: the prompt's text with its token positions, and the step slider.

The maps themselves are ``kvlab.report.retention_map``'s, drawn from the kept-position snapshots a result
records (``kvlab.measure.retention``); this module adds what needs the tokenizer: the prompt, token by
token, each token's position on hover and a position mark every ``MARK`` tokens, the task's answer (a
needle) highlighted, so that a position on the maps can be found in the text.
"""

from __future__ import annotations

import html

from kvlab.core.model import LoadedModel
from kvlab.core.results import CompareResult
from kvlab.report import comparison_figures as plots
from kvlab.report import retention_map as ret

MARK = 100  # a position mark every this many tokens
MAX_TOKENS = 8192  # tokens shown at most (the page's prompts are shorter)


def prompt_positions_html(result: CompareResult | None, lm: LoadedModel | None) -> str:
    """The prompt as text, token by token (hover: its position), marks every ``MARK`` positions, the answer
    highlighted; escaped, never HTML from the prompt."""
    if result is None or not result.prompt_token_ids:
        return "<div class='kv-empty'>no result yet</div>"
    ids = result.prompt_token_ids[:MAX_TOKENS]
    answer = set(plots.answer_of(result))
    pieces = [lm.decode([t]) for t in ids] if lm is not None else [f"⟨{t}⟩" for t in ids]
    out = []
    for i, p in enumerate(pieces):
        if i and i % MARK == 0:
            out.append(f"<sup class='kv-pos-mark' style='color:#6b7280;font-size:.7em'>│{i}</sup>")
        cls = " class='kv-answer' style='background:#fde68a;font-weight:600'" if i in answer else ""
        out.append(f"<span title='position {i}'{cls}>{html.escape(p)}</span>")
    note = " (the answer highlighted)" if answer else ""
    return (
        f"<div class='kv-ret-prompt-title'>The prompt, {result.prompt_tokens} tokens: hover a token for its position; "
        f"a mark every {MARK} positions{note}</div>"
        "<div class='kv-ret-prompt' id='kv-ret-prompt-text' style='max-height:150px;overflow-y:auto;"
        "white-space:pre-wrap;font-size:.8em;border:1px solid #e5e7eb;padding:6px;border-radius:6px'>"
        + "".join(out)
        + "</div>"
    )


def slider_range(result: CompareResult | None) -> tuple[int, int]:
    """(the last snapshot step, the slider's step size): the slider runs 0..last, one decode step at a time."""
    if result is None:
        return 0, 1
    return ret.last_step(result), 1


def steps_note(result: CompareResult | None) -> str:
    """Which steps hold snapshots, and which runs change while decoding (the slider moves those)."""
    if result is None:
        return ""
    maps = ret.maps_of(result)
    moving = [m.label for m in maps if m.changes_while_decoding and len(m.steps) > 2]
    steps = ret.snapshot_steps(result)
    text = f"Snapshots at steps {', '.join(map(str, steps))}; a run shows its latest snapshot at or before the step."
    if moving:
        text += f" Changing while decoding: {', '.join(moving)}."
    return f"<p id='kv-ret-steps' style='font-size:.85em'>{html.escape(text)}</p>"


__all__ = ["prompt_positions_html", "slider_range", "steps_note"]
