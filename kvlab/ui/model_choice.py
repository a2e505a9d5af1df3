"""The model box: which models the page offers, and the line under it that says what is loaded.

On a local run the box offers the models found in this machine's caches (``loader.local_models``:
the embedded model, the causal LMs of the Hugging Face cache, the folders of kvlab's cache) and takes
any folder path or hub id typed into it; on a Hugging Face Space (or with
``KVLAB_ALLOW_MODEL_CHOICE=0``) it offers a fixed list (``config.fixed_models``). Loading is the
dashboard's (``Dashboard.choose_model``); this module only words what happened, as escaped HTML.
"""

from __future__ import annotations

import html
from collections.abc import Iterable

from kvlab.core.model import LoadedModel
from kvlab.engine.loader import local_models, verdict_of
from kvlab.ui.config import Limits

OK_STYLE = "border-left:4px solid #16a34a;background:#f0fdf4;color:#14532d"
REFUSED_STYLE = "border-left:4px solid #dc2626;background:#fdecea;color:#7f1d1d"
BOX_STYLE = "padding:6px 10px;border-radius:6px;font-size:.86em;line-height:1.45;overflow-wrap:anywhere"


def offered(start: str, limits: Limits, loaded: Iterable[str] = ()) -> list[str]:
    """The models the box lists: the page's first model, then this machine's (free choice) or the fixed list."""
    if limits.allow_model_choice:
        return list(dict.fromkeys([start, *local_models(), *loaded]))
    return list(dict.fromkeys([start, *limits.models]))


def box_info(limits: Limits) -> str:
    """The model box's help line."""
    if limits.allow_model_choice:
        return (
            "one found on this machine, or type a folder or a Hugging Face id; loading it checks kvlab's "
            "exact path against the model's own forward"
        )
    return "this page offers a fixed list (KVLAB_MODELS); KVLAB_ALLOW_MODEL_CHOICE=1 lets a page load any model"


def model_line(lm: LoadedModel) -> str:
    """What is loaded: the model, its shape and device, and the load-time self-check's verdict."""
    info = lm.info
    verdict = verdict_of(lm)
    check = verdict.summary() if verdict is not None else "self-check not run (loaded without it)"
    shape = (
        f"{info.n_layers} layers, {info.n_heads} query / {info.n_kv_heads} KV heads, head_dim {info.head_dim}, "
        f"{info.dtype} on {info.device}"
    )
    mark = "✓" if verdict is not None else "•"
    return (
        f"<div class='kv-model-line' style='{BOX_STYLE};{OK_STYLE}'><b>{html.escape(info.id)}</b> · "
        f"{html.escape(shape)}<br>{mark} {html.escape(check)}</div>"
    )


def refused_line(message: str, kept: str) -> str:
    """A refused load: why, in one line, and that the page keeps the model it had."""
    return (
        f"<div class='kv-model-line kv-model-refused' style='{BOX_STYLE};{REFUSED_STYLE}'>✗ not loaded: "
        f"{html.escape(message)}<br>The page keeps <b>{html.escape(kept)}</b> loaded; nothing was lost.</div>"
    )
