"""Result records of a comparison: plain dataclasses that round-trip through JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

QUERY_AWARE = "query-aware"  # the question is inside the prompt that is prefilled and compressed
QUERY_AGNOSTIC = "query-agnostic"  # the context is compressed alone; the question is fed afterwards
PROTOCOLS = (QUERY_AWARE, QUERY_AGNOSTIC)


def memory_figures(held: list, exact: list, budget_use: float | None = None, shared: dict | None = None) -> dict:
    """Peak and mean of the bytes ``held`` over a run (after prefill and after every step), with the exact
    cache's over the same points (``exact``): ``peak_fraction`` = peak / exact peak, ``mean_fraction`` =
    mean / exact mean; ``budget_use`` and the shared bytes' total are passed through."""
    peak, mean = (max(held), sum(held) / len(held)) if held else (0, 0.0)
    ex_peak, ex_mean = (max(exact), sum(exact) / len(exact)) if exact else (0, 0.0)
    return {
        "peak_bytes": peak,
        "mean_bytes": round(mean, 1),
        "exact_peak_bytes": ex_peak,
        "exact_mean_bytes": round(ex_mean, 1),
        "peak_fraction": round(peak / ex_peak, 4) if ex_peak else None,
        "mean_fraction": round(mean / ex_mean, 4) if ex_mean else None,
        "budget_use": budget_use,
        "shared_bytes": sum((shared or {}).values()),
    }


@dataclass
class RunTimings:
    prefill_s: float = 0.0
    compress_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_s: float = 0.0
    question_s: float = 0.0  # query-agnostic: the chunked forward that fed the question (all runs at once)


@dataclass
class RunResult:
    """One method at one budget. Bytes are counted from the tensors the method holds."""

    method: str
    budget: str | None  # "0.25", "512t", or None for the exact cache
    params: dict
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    kv_bytes: int = 0  # after prefill and compression
    kv_bytes_breakdown: dict = field(default_factory=dict)
    # [0] after compression; then one entry per decode step (query-agnostic: [1] after the question)
    kv_bytes_per_step: list[int] = field(default_factory=list)
    exact_kv_bytes_per_step: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "eos" | "length" | "refused" (the budget cannot be held) | "error"
    timings: RunTimings = field(default_factory=RunTimings)
    metrics: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)  # e.g. kept positions for heatmaps
    health: list = field(default_factory=list)  # flags: [{"flag": name, "detail": text}] (kvlab.measure.health)
    error: str = ""  # why the run ended early (a refusal or the exception), empty when it ran to the end
    # per-model state one copy of which serves every sequence (QJL's sketches), not in kv_bytes: kind -> bytes
    shared_bytes: dict = field(default_factory=dict)
    # mean over the run of the bytes held / the bytes its budget allows at that point (kvlab.measure.health.budget_use)
    budget_use: float | None = None

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"

    @property
    def peak_kv_bytes(self) -> int:
        """The most bytes held at any point of the run (after prefill or any step): what a budget caps."""
        return max(self.kv_bytes_per_step, default=self.kv_bytes)

    @property
    def mean_kv_bytes(self) -> float:
        """The bytes held, averaged over the run (after prefill and after every step)."""
        s = self.kv_bytes_per_step
        return sum(s) / len(s) if s else float(self.kv_bytes)

    @property
    def memory(self) -> dict:
        """The run's two memory figures with the exact cache's (``memory_figures``), written to the JSON."""
        return memory_figures(
            self.kv_bytes_per_step or [self.kv_bytes], self.exact_kv_bytes_per_step, self.budget_use, self.shared_bytes
        )

    @property
    def saving(self) -> float:
        """Fraction of the exact cache's bytes saved after compression."""
        exact = self.exact_kv_bytes_per_step[0] if self.exact_kv_bytes_per_step else 0
        return 1.0 - self.kv_bytes / exact if exact else 0.0


@dataclass
class CompareResult:
    model: dict
    prompt: str
    prompt_tokens: int
    prompt_token_ids: list[int]
    settings: dict
    timings: dict
    runs: list[RunResult]
    protocol: str = QUERY_AWARE  # see PROTOCOLS
    question: str = ""  # query-agnostic: the question fed after compressing the context
    context_tokens: int = 0  # query-agnostic: the prompt's first tokens, compressed without the question

    def to_json(self) -> dict:
        """The result as JSON-ready dicts; each run also gets its ``memory`` figures (derived, not read back)."""
        out = asdict(self)
        for r, d in zip(self.runs, out["runs"]):
            d["memory"] = r.memory
        return out

    def dumps(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_json(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompareResult:
        runs = []
        known = {f.name for f in fields(RunResult)}
        for r in data["runs"]:
            r = {k: v for k, v in r.items() if k in known}
            r["timings"] = RunTimings(**r.get("timings", {}))
            runs.append(RunResult(**r))
        keep = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in keep and k != "runs"}, runs=runs)

    @classmethod
    def load(cls, path: str | Path) -> CompareResult:
        return cls.from_json(json.loads(Path(path).read_text()))

    def run(self, label: str) -> RunResult:
        for r in self.runs:
            if r.label == label:
                return r
        raise KeyError(label)
