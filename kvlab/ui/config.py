"""The page's configuration: what a shared page allows and its stylesheet."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
CSS = (ASSETS / "style.css").read_text() if (ASSETS / "style.css").is_file() else ""
GROUP_TITLES = {
    "paper": "Papers' methods",
    "baseline": "Baselines",
    "recent": "Recent methods",
    "reference": "Reference",
}


@dataclass
class Limits:
    """What a shared page allows (environment variables override the defaults)."""

    max_prompt_tokens: int = int(os.environ.get("KVLAB_MAX_PROMPT_TOKENS", 4096))
    max_new_tokens: int = int(os.environ.get("KVLAB_MAX_NEW_TOKENS", 256))
    allow_model_choice: bool = os.environ.get("KVLAB_ALLOW_MODEL_CHOICE", "0") == "1"
    queue_size: int = int(os.environ.get("KVLAB_QUEUE_SIZE", 16))
