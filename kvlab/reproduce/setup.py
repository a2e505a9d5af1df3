"""The model, engine and settings one ``kvlab reproduce`` call shares between reproductions."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model
from kvlab.engine.prefill import prefill
from kvlab.engine.specs import GenerationSettings
from kvlab.methods.handover import PrefillNeeds


@dataclass
class ReproductionSetup:
    """What every reproduction of one call shares: the size of its settings (``quick``), the model (loaded
    once, ``lm``), where progress is written, and per-reproduction setting overrides (tests)."""

    quick: bool = False
    model: str = "embedded"
    device: str = "auto"
    log: Callable[[str], None] = field(default=lambda m: print(f"[kvlab] {m}", file=sys.stderr))
    lm: object = None
    overrides: dict = field(default_factory=dict)  # reproduction name -> settings to replace (tests)

    def command(self, name: str) -> str:
        """The command that makes this reproduction's table."""
        return f"python -m kvlab reproduce {name}" + (" --quick" if self.quick else "")

    def settings(self, name: str, full: dict, quick: dict) -> dict:
        """The settings a reproduction runs with: full or quick, then any overrides for ``name``."""
        return {**(quick if self.quick else full), **self.overrides.get(name, {})}

    @cached_property
    def loaded(self):
        if self.lm is None:
            self.lm = load_model(self.model, self.device)
        return self.lm

    @cached_property
    def engine(self):

        return Engine(self.loaded)

    @property
    def info(self):
        return self.loaded.info

    def prose(self, n_tokens: int, chat: bool = False) -> list[int]:
        """About ``n_tokens`` of real prose (CPython's reference manual, offline) as token ids."""
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        ids = self.loaded.encode(text[: 6 * n_tokens], chat=chat)
        return ids[:n_tokens]

    def compare(self, ids: list[int], runs: list, max_new_tokens: int, probes: list | None = None):
        """One engine comparison (greedy decoding), the way ``kvlab compare`` runs it."""

        return self.engine.compare(ids, runs, GenerationSettings(max_new_tokens=max_new_tokens), probes=probes or [])

    def prefill(self, ids: list[int], window: int):

        with torch.inference_mode():
            state, _ = prefill(self.loaded, ids, PrefillNeeds(query_window=window))
        return state
