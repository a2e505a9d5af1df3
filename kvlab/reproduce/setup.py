"""The model, engine and settings one ``kvlab reproduce`` call shares between reproductions."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model
from kvlab.engine.prefill import prefill
from kvlab.engine.specs import GenerationSettings
from kvlab.methods.handover import PrefillNeeds
from kvlab.reproduce.common import Progress
from kvlab.reproduce.registry import ALSO


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
    models: tuple[str, ...] = ()  # the models the task claims also run on, beside ``model`` (``on``)
    _others: dict = field(default_factory=dict, repr=False)

    def on(self, model: str) -> ReproductionSetup:
        """The same call's settings on ``model``: this setup when it is ``model``, else one that loads it once."""
        if model == self.model:
            return self
        if model not in self._others:
            self._others[model] = ReproductionSetup(self.quick, model, self.device, self.log, None, self.overrides)
        return self._others[model]

    @property
    def all_models(self) -> list[str]:
        """``model``, then each of ``models`` not already it."""
        return list(dict.fromkeys([self.model, *self.models]))

    def progress(self, name: str, settings: dict, *module_files: str) -> Progress:
        """The on-disk progress of reproduction ``name`` on this model with ``settings`` (``Progress.of``)."""
        return Progress.of(self, name, settings, *module_files)

    def each(
        self, name: str, settings: dict, module_file: str, measure: Callable, units: Iterable, what: str = "prompt"
    ) -> list:
        """``measure(self, settings, unit)`` for every unit (a seed, a task and seed, ...), in order: each kept
        on disk as it finishes and read back by a rerun (``progress``), progress written to the log; the
        progress is cleared once every unit has finished."""
        progress = self.progress(name, settings, module_file)
        units = list(units)
        out = [
            progress.value(str(u), measure, self, settings, u, log=self.log,
                           say=f"{name} [{self.label}]: {what} {i + 1} of {len(units)} ({u})")
            for i, u in enumerate(units)
        ]  # fmt: skip
        progress.clear()
        return out

    def on_each_model(self, measure: Callable, *args) -> dict:
        """``measure(ctx, *args, first)`` on ``model`` (``first`` True) and then on each of ``models``, each
        through its own setup: the model's label -> what it returned."""
        return {self.on(m).label: measure(self.on(m), *args, m == self.model) for m in self.all_models}

    def command(self, name: str) -> str:
        """The command that makes this reproduction's table."""
        cmd = f"python -m kvlab reproduce {name}"
        if self.model not in ("embedded", "smollm2-135m"):
            cmd += f" --model {self.model}"
        if tuple(self.models) != ALSO:
            cmd += f" --also {','.join(self.models) or 'none'}"
        return cmd + (" --quick" if self.quick else "")

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

    @property
    def label(self) -> str:
        """The model's short name for tables: "SmolLM2-135M-Instruct"."""
        return str(self.info.id).split("/")[-1].split(" (")[0]

    def prose(self, n_tokens: int, chat: bool = False, seed: int | None = None) -> list[int]:
        """About ``n_tokens`` of real prose (CPython's reference manual, offline) as token ids: its topics in
        name order, or (``seed``) shuffled by that seed, so that each seed gives another prompt."""
        from pydoc_data.topics import topics

        keys = sorted(topics)
        if seed is not None:
            random.Random(f"prose-{seed}").shuffle(keys)
        text = "\n\n".join(topics[k] for k in keys)
        ids = self.loaded.encode(text[: 6 * n_tokens], chat=chat)
        return ids[:n_tokens]

    def compare(self, ids: list[int], runs: list, max_new_tokens: int, probes: list | None = None):
        """One engine comparison (greedy decoding), the way ``kvlab compare`` runs it."""

        return self.engine.compare(ids, runs, GenerationSettings(max_new_tokens=max_new_tokens), probes=probes or [])

    def prefill(self, ids: list[int], window: int):

        with torch.inference_mode():
            state, _ = prefill(self.loaded, ids, PrefillNeeds(query_window=window))
        return state
