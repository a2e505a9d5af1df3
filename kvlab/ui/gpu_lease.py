"""The dashboard's GPU path on a ZeroGPU Space: where the models are placed, and a GPU lease sized to the work.

ZeroGPU as documented now (huggingface.co/docs/hub/spaces-zerogpu; the ``spaces`` package 0.51):

* its cards are NVIDIA RTX Pro 6000 Blackwell (sm_120); ``spaces.GPU(size=...)`` asks for ``"large"``
  (half a card, 48 GB, the default) or ``"xlarge"`` (the whole card, 96 GB, twice the quota);
* ``spaces.GPU(duration=...)`` takes seconds or a callable given the function's own arguments; the
  visitor's quota is checked against it before the function starts;
* models are placed on ``cuda`` at import, at module level: outside a decorated function ZeroGPU
  emulates CUDA (the tensors stay in host memory, operations run on the CPU), and it moves everything
  placed on ``cuda`` to the real card when a lease starts; moving or loading a model inside the decorated
  function is discouraged;
* an ``async`` function cannot be decorated (``spaces.GPU`` raises ``NotImplementedError``);
* torch from 2.8 on (the page lists 2.8.0 to 2.11.0; requirements.txt allows 2.8 to 2.13,
  docs/torch-versions.md).

So kvlab, on ZeroGPU (``zero_gpu()``): loads the page's model and every model of the page's fixed list at
import with ``device="cuda"`` (``placement_device``; the load-time self-check then runs under the
emulation, on the CPU), never inside a lease; wraps the comparison in ``spaces.GPU`` with the size of
``KVLAB_GPU_SIZE`` (``gpu_size``) and a duration derived from the request, prompt tokens x runs x new
tokens (``WorkSize``: a fixed duration either refuses short requests from visitors with little quota left
or cuts long ones off); refuses a coroutine function everywhere, so that the CPU tests catch it. Everywhere
else (no ``spaces`` package, or not on ZeroGPU) ``gpu`` returns the function unchanged and models load on
the device ``load_model`` picks.

The function that runs on the GPU must hand back nothing CUDA-resident: ZeroGPU runs it in a
worker process and pickles what it returns. ``host_only`` checks that and moves tensors to the
CPU.

Environment: ``KVLAB_GPU_SIZE`` (``large``, the default, or ``xlarge``); ``KVLAB_GPU_MAX_SECONDS`` (default
300) caps a lease; ``KVLAB_GPU_SECONDS_SCALE`` (default 1.0) scales the estimate for a slower or faster
GPU. The cost model's seconds are estimates for one H200 slice, not measured on a Blackwell card.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping
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


GPU_SIZES = ("large", "xlarge")  # ZeroGPU's sizes: half a Blackwell card (the default), the whole card


def gpu_size(env: Mapping[str, str] = os.environ) -> str:
    """The lease size to ask for: ``KVLAB_GPU_SIZE`` (default ``large``); ``ValueError`` naming the allowed ones."""
    size = env.get("KVLAB_GPU_SIZE", "").strip().lower() or "large"
    if size not in GPU_SIZES:
        raise ValueError(f"KVLAB_GPU_SIZE={size!r} is not a ZeroGPU size; allowed: {', '.join(GPU_SIZES)}")
    return size


def placement_device() -> str | None:
    """Where models are loaded: ``"cuda"`` on ZeroGPU (placed at import, under its CUDA emulation), else None
    (``load_model`` picks: CUDA when there is one, else the CPU)."""
    return "cuda" if zero_gpu() else None


def refuse_async(fn: Callable) -> None:
    """``TypeError`` for a coroutine or async generator function: ZeroGPU cannot run one in a lease."""
    inner = inspect.unwrap(fn)
    if inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner):
        raise TypeError(
            f"{getattr(fn, '__name__', fn)!r} is an async function; ZeroGPU's spaces.GPU runs plain functions and "
            "generators only"
        )


def zero_gpu() -> bool:
    """True on a ZeroGPU Space (the ``spaces`` package is there and says so)."""
    try:
        import spaces
        import spaces.config
    except ImportError:
        return False
    return bool(getattr(spaces.config.Config, "zero_gpu", False))


def gpu(fn: Callable, work: Callable[..., WorkSize], size: str | None = None) -> Callable:
    """``fn`` under ``spaces.GPU`` with a duration from ``work(*args, **kwargs)`` and the lease ``size``
    (default ``gpu_size()``); ``fn`` itself elsewhere. A coroutine function is refused (``TypeError``) everywhere.

    ``work`` receives the same arguments as ``fn`` and returns the request's ``WorkSize``; it must
    be cheap (no model work) since ZeroGPU calls it before a GPU is attached. What ``fn`` returns
    or yields passes through ``host_only``.
    """
    refuse_async(fn)
    size = size or gpu_size()
    if size not in GPU_SIZES:
        raise ValueError(f"GPU size {size!r}; allowed: {', '.join(GPU_SIZES)}")
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

    return spaces.GPU(duration=duration, size=size)(on_host)


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
