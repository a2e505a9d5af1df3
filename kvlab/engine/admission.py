"""Admission control: how much work one request may ask for, checked before any model work.

A request is methods x budgets on one prompt. Before the engine starts, kvlab

* merges duplicate budgets (``"0.5, 0.5, 0.50"`` is one budget);
* caps the number of runs and prompt tokens x runs;
* estimates the request's peak memory (``estimate``): the exact prefill's K/V, each run's planned
  cache, the probes' shadow caches and teacher-forced copies, the prefill's activations, and
  compares it with what the machine has free (RAM on the CPU, device memory on CUDA).

A request over a limit is refused with one line that says what to reduce (``AdmissionError``).

Environment (defaults suit a 16 GB CPU Space):

* ``KVLAB_MAX_RUNS`` (24): runs (method x budget pairs) per request;
* ``KVLAB_MAX_TOKEN_RUNS`` (65536): prompt tokens x runs per request;
* ``KVLAB_MEMORY_FRACTION`` (0.7): share of the free memory one request may plan to use;
* ``KVLAB_MAX_REQUEST_BYTES``: a fixed memory limit in bytes instead of the free memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvlab.core.budgets import Budget, exact_bytes
from kvlab.core.model import ModelInfo

GIB = 1024**3


class AdmissionError(ValueError):
    """A request over a limit; the message says which limit, the numbers and what to reduce."""


@dataclass(frozen=True)
class AdmissionLimits:
    max_runs: int = 24
    max_token_runs: int = 65536
    memory_fraction: float = 0.7
    max_request_bytes: int | None = None  # None: derived from the free memory

    @classmethod
    def from_env(cls) -> AdmissionLimits:
        fixed = os.environ.get("KVLAB_MAX_REQUEST_BYTES")
        return cls(
            max_runs=int(os.environ.get("KVLAB_MAX_RUNS", cls.max_runs)),
            max_token_runs=int(os.environ.get("KVLAB_MAX_TOKEN_RUNS", cls.max_token_runs)),
            memory_fraction=float(os.environ.get("KVLAB_MEMORY_FRACTION", cls.memory_fraction)),
            max_request_bytes=int(float(fixed)) if fixed else None,
        )

    def memory_limit(self, device: str | torch.device) -> int:
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return int(self.memory_fraction * free_bytes(device))


def free_bytes(device: str | torch.device) -> int:
    """Memory free for new work: device memory on CUDA, MemAvailable of the host otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 * GIB


def unique_budgets(budgets: Iterable[Budget]) -> list[Budget]:
    """Budgets in their first order, each once (equal fractions or token counts merge)."""
    return list(dict.fromkeys(budgets))


@dataclass
class Estimate:
    """A request's planned peak memory, by part (bytes), and its size."""

    runs: int
    prompt_tokens: int
    new_tokens: int
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    def summary(self) -> str:
        return f"{self.runs} runs on {self.prompt_tokens} prompt tokens, about {_gib(self.peak_bytes)} peak"

    def to_json(self) -> dict:
        return {
            "runs": self.runs,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "peak_bytes": self.peak_bytes,
            "parts": dict(self.parts),
        }


def _gib(b: int) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB / 10 else f"{b / 1024**2:.0f} MiB"


def estimate(
    info: ModelInfo,
    prompt_tokens: int,
    budgets: Sequence[Budget | None],
    new_tokens: int,
    probes: bool = False,
    compute_bytes: int = 4,
) -> Estimate:
    """Planned peak memory of one comparison (bytes), before any model work.

    ``budgets`` has one entry per run (None: an uncompressed run such as exact). A run's cache is
    planned at its budget's share of the exact cache for the prompt, plus its generated tokens at
    full size (methods that keep generated tokens uncompressed do that; streaming methods hold
    less), and 5% over the budget that the engine tolerates. With probes on, every run also gets a
    shadow of its generated K/V and a teacher-forced copy of its cache.
    """
    n, total = prompt_tokens, prompt_tokens + new_tokens
    kv_compute = info.n_layers * info.n_kv_heads * n * info.head_dim * 2 * compute_bytes
    hidden = info.n_heads * info.head_dim
    caches = 0
    for b in budgets:
        share = 1.0 if b is None else b.fraction_of(n)
        caches += int(1.05 * share * exact_bytes(info, n)) + exact_bytes(info, new_tokens)
    parts = {
        # the shared prefill's K/V, kept while the runs compress (and stacked once)
        "prefill_kv": 2 * kv_compute,
        # one layer's activations at a time: hidden states, MLP (~4x hidden), attention chunks
        "prefill_activations": n * hidden * compute_bytes * 12 + 256 * n * info.n_heads * 4,
        "run_caches": caches,
        "logits": (len(budgets) + 1) * 50_000 * 4,
    }
    if probes:
        gen = info.n_layers * info.n_kv_heads * new_tokens * info.head_dim * 2 * compute_bytes
        parts["probe_shadows"] = len(budgets) * gen + kv_compute
        parts["probe_forks"] = caches
        parts["probe_maps"] = len(budgets) * 8 * total * 8
    return Estimate(len(budgets), n, new_tokens, parts)


def admit(est: Estimate, limits: AdmissionLimits, device: str | torch.device) -> None:
    """Raise ``AdmissionError`` when the request is over a limit; the message says what to reduce."""
    if est.runs > limits.max_runs:
        raise AdmissionError(
            f"{est.runs} runs requested (methods x budgets); this page allows {limits.max_runs}: "
            "pick fewer methods or budgets (KVLAB_MAX_RUNS)"
        )
    if est.runs * est.prompt_tokens > limits.max_token_runs:
        raise AdmissionError(
            f"{est.prompt_tokens} prompt tokens x {est.runs} runs = {est.prompt_tokens * est.runs}; this page "
            f"allows {limits.max_token_runs}: shorten the prompt or pick fewer runs (KVLAB_MAX_TOKEN_RUNS)"
        )
    limit = limits.memory_limit(device)
    if est.peak_bytes > limit:
        raise AdmissionError(
            f"{est.summary()} exceeds the {_gib(limit)} this request may use on {torch.device(device).type}: "
            "shorten the prompt, pick fewer runs, or turn the measurements off"
        )
