"""The page's configuration: what a shared page allows, which models it offers, and its stylesheet."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.engine import embedded
from kvlab.engine.loader import EMBEDDED

ASSETS = Path(__file__).resolve().parents[2] / "assets"
# the model box's row: the Load button sits level with the box, not stretched to the label's height
MODEL_CSS = "#kv-model-row {align-items: flex-end} #kv-load-model {margin-bottom: 10px}\n"
CSS = ((ASSETS / "style.css").read_text() if (ASSETS / "style.css").is_file() else "") + MODEL_CSS
GROUP_TITLES = {
    "paper": "Papers' methods",
    "baseline": "Baselines",
    "recent": "Recent methods",
    "quantizer": "Quantizers",
    "reference": "Reference",
}
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def model_choice_allowed(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the page loads any model a visitor names: ``KVLAB_ALLOW_MODEL_CHOICE`` 1 (yes) or 0 (no: the
    fixed list); unset, yes on a local run and no on a Hugging Face Space (``SPACE_ID`` set)."""
    value = env.get("KVLAB_ALLOW_MODEL_CHOICE", "").strip().lower()
    if value in _YES or value in _NO:
        return value in _YES
    return not env.get("SPACE_ID")


def fixed_models(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The models a page without free choice offers: ``KVLAB_MODELS`` (comma-separated), else the embedded
    ones installed here (both are local files, so a shared page stays safe). The model the page started
    with is offered too."""
    names = [m.strip() for m in env.get("KVLAB_MODELS", "").split(",") if m.strip()]
    carried = [m.spec for m in embedded.MODELS if m.spec == EMBEDDED or m.installed()]
    return tuple(dict.fromkeys(names or carried))


@dataclass
class Limits:
    """What a shared page allows (environment variables override the defaults)."""

    max_prompt_tokens: int = int(os.environ.get("KVLAB_MAX_PROMPT_TOKENS", 4096))
    max_new_tokens: int = int(os.environ.get("KVLAB_MAX_NEW_TOKENS", 256))
    allow_model_choice: bool = field(default_factory=model_choice_allowed)
    queue_size: int = int(os.environ.get("KVLAB_QUEUE_SIZE", 16))
    models: tuple[str, ...] = field(default_factory=fixed_models)  # offered when the choice is not free
