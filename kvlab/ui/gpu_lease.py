"""The dashboard's GPU path on a ZeroGPU Space: a GPU lease sized to the requested work.

On a ZeroGPU Space, ``spaces.GPU(duration=...)`` reserves a GPU for at most ``duration`` seconds
and checks the visitor's quota against that number before the function starts. A fixed duration
either refuses short requests from visitors with little quota left or cuts long ones off, so
kvlab derives it from the request: prompt tokens x runs x new tokens (``WorkSize``). Everywhere
else (no ``spaces`` package, or not on ZeroGPU) ``gpu`` returns the function unchanged.

The function that runs on the GPU must hand back nothing CUDA-resident: ZeroGPU runs it in a
worker process and pickles what it returns. ``host_only`` checks that and moves tensors to the
CPU.

Environment: ``KVLAB_GPU_MAX_SECONDS`` (default 300) caps a lease; ``KVLAB_GPU_SECONDS_SCALE``
(default 1.0) scales the estimate for a slower or faster GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: Lease floor and the cost model's terms, in seconds on one ZeroGPU slice. Conservative: the
#: lease only reserves quota, and ZeroGPU charges the time actually used.
BASE_S = 15.0  # worker start, moving the model to the GPU, tokenizing, drawing figures
PREFILL_S_PER_1K_TOKENS = 0.5  # one exact prefill, shared by every run
COMPRESS_S_PER_1K_TOKENS_RUN = 0.5  # each run compresses its copy of the prompt's cache
STEP_S_PER_RUN = 0.03  # one lockstep decode step, per row (dominated by per-layer attention calls)
PROBES_FACTOR = 1.6  # shadow attention, teacher-forced rows, maps


@dataclass(frozen=True)
class WorkSize:
    """What one comparison asks for: prompt tokens, runs (methods x budgets) and new tokens."""

    prompt_tokens: int
    runs: int
    new_tokens: int
    probes: bool = True

    def seconds(self) -> float:
        """Estimated GPU seconds for this work (before the cap)."""
        k = self.prompt_tokens / 1000
        s = PREFILL_S_PER_1K_TOKENS * k + COMPRESS_S_PER_1K_TOKENS_RUN * k * self.runs
        s += STEP_S_PER_RUN * self.runs * self.new_tokens
        if self.probes:
            s *= PROBES_FACTOR
        return BASE_S + s * float(os.environ.get("KVLAB_GPU_SECONDS_SCALE", "1.0"))


def max_seconds() -> int:
    return int(os.environ.get("KVLAB_GPU_MAX_SECONDS", "300"))


def lease_seconds(work: WorkSize) -> int:
    """The duration to ask ZeroGPU for: the estimate rounded up, capped at ``max_seconds()``."""
    return min(max_seconds(), math.ceil(work.seconds()))


def zero_gpu() -> bool:
    """True on a ZeroGPU Space (the ``spaces`` package is there and says so)."""
    try:
        import spaces
        import spaces.config
    except ImportError:
        return False
    return bool(getattr(spaces.config.Config, "zero_gpu", False))


def gpu(fn: Callable, work: Callable[..., WorkSize]) -> Callable:
    """``fn`` under ``spaces.GPU`` with a duration from ``work(*args, **kwargs)``; ``fn`` itself elsewhere.

    ``work`` receives the same arguments as ``fn`` and returns the request's ``WorkSize``; it must
    be cheap (no model work) since ZeroGPU calls it before a GPU is attached. What ``fn`` returns
    or yields passes through ``host_only``.
    """
    if not zero_gpu():
        return fn
    import spaces

    def duration(*args, **kwargs) -> int:
        try:
            return lease_seconds(work(*args, **kwargs))
        except Exception:  # a bad request: fn itself reports it, on the smallest lease
            return math.ceil(BASE_S)

    if inspect.isgeneratorfunction(inspect.unwrap(fn)):

        @functools.wraps(fn)
        def on_host(*args, **kwargs):
            for out in fn(*args, **kwargs):
                yield host_only(out)

    else:

        @functools.wraps(fn)
        def on_host(*args, **kwargs):
            return host_only(fn(*args, **kwargs))

    return spaces.GPU(duration=duration)(on_host)


def host_only(obj: Any) -> Any:
    """``obj`` with every tensor inside it moved to the CPU (lists, tuples, dicts, dataclasses).

    What a GPU function returns crosses a process boundary on ZeroGPU; a CUDA tensor there hangs
    or fails. Plain values are returned as they are.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: host_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [host_only(v) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: host_only(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def tensor_paths(obj: Any, _seen: set[int] | None = None) -> list[str]:
    """Where ``obj`` holds tensors (on any device): a list of paths, empty when none."""
    if isinstance(obj, torch.Tensor):
        return [f"<tensor on {obj.device}>"]
    seen = _seen if _seen is not None else set()
    if id(obj) in seen:  # a container met twice (or a cycle)
        return []
    seen.add(id(obj))
    items: Iterable[tuple[object, Any]]  # (key, value) pairs
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    else:
        return []
    return [f"{k}/{p}" for k, v in items for p in tensor_paths(v, seen)]
