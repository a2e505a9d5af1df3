"""The page's About tab: the registered methods by group, and how budgets and bytes are counted."""

from __future__ import annotations

import os
import re

from kvlab.methods import methods
from kvlab.ui.config import GROUP_TITLES

#: Where the docs are served (e.g. a Space's ``.../blob/main``); unset: the path in the source tree.
DOCS_URL = os.environ.get("KVLAB_DOCS_URL", "").rstrip("/")


def doc_link(path: str) -> str:
    return f"[`{path}`]({DOCS_URL}/{path})" if DOCS_URL else f"`{path}` (in the source tree)"


def about_markdown() -> str:
    lines = ["## The methods", ""]
    for group in ("reference", "paper", "baseline", "recent", "quantizer"):
        members = [(n, c) for n, c in methods().items() if c.group == group]
        if not members:
            continue
        lines.append(f"### {GROUP_TITLES[group]}")
        for name, cls in members:
            paper = f" — *{_md(cls.paper)}*" if cls.paper else ""
            lines.append(f"* **{_md(cls.title or name)}** (`{name}`): {_md(cls.summary)}{paper}")
        lines.append("")
    lines += [
        "## Budgets and bytes",
        "",
        "* A budget is a fraction of the bytes the exact cache holds for the same tokens (`0.25`), or a "
        "token count per layer and KV head (`512t`); several at once, comma-separated. Every method runs at "
        "every budget; `exact` runs once.",
        "* Each method maps the budget onto its own knobs (tokens kept, sketch size, bits); the chosen knobs "
        "are stored with the result.",
        "* Bytes are counted from the tensors each cache really holds — packed bits, norms, scales, zero "
        "points, indices, positions, weights, score counters — never from a formula. The exact cache holds "
        "layers × KV heads × tokens × head_dim × 2 × the cache dtype's size (16-bit by default, as papers and "
        "deployments count).",
        "* Prefill-only methods keep generated tokens uncompressed; streaming methods hold their budget while "
        "decoding. The bytes-per-step chart shows both.",
        "* A card flags a run whose result cannot be trusted: bytes above its budget, non-finite logits, a "
        "compressed cache identical to exact, or nothing evicted when the budget says it must.",
        "",
        "## The papers' claims, reproduced",
        "",
        "Each paper's central claim, measured on this model with `kvlab reproduce NAME|all`: "
        f"{doc_link('docs/reproductions.md')} (what holds, what does not, and why).",
    ]
    return "\n".join(lines)


def _md(text: str) -> str:
    return re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text or "")
