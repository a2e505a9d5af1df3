"""Fault isolation: one method's exception ends its own run, not the comparison.

While the engine runs a batched forward it opens ``collect()``; the cache and the attention
function send each row's work through ``append`` / ``attend`` (or ``guard`` for any call). An
exception there is recorded (row -> message), the row gets a zero attention output so that the
batched forward goes on, and later calls for that row in the same forward are skipped. After the
forward the engine ends the failed runs (``RunResult.error``, ``finish_reason`` "error"); a method
that fails in ``compress`` is replaced by a ``FailedCompressor`` that holds nothing; one whose
constructor or ``plan`` raises (``made``) ends before the prefill.

Running out of memory is not one row's fault: ``MemoryError`` and ``torch.OutOfMemoryError`` pass
through every guard; the engine frees what the comparison held (``release``) and ends it with
``OutOfMemory``, whose message says what to reduce.

``time_limit_s`` reads the per-request time limit of a shared page: ``KVLAB_TIME_LIMIT_S``
(seconds; 0 or empty: none), else ``SPACE_TIME_LIMIT_S`` (300) when a Hugging Face Space is
detected (``SPACE_ID`` set), else none.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvlab.methods.base import Compressor

OOM = (MemoryError, torch.OutOfMemoryError)
SPACE_TIME_LIMIT_S = 300.0
MAX_MESSAGE = 400


class OutOfMemory(RuntimeError):
    """A comparison ended for lack of memory; what it held is freed and the next request can run."""


@dataclass
class RowFaults:
    """Errors raised by the rows of one batched forward: batch row -> ``describe(exception)``."""

    errors: dict[int, str] = field(default_factory=dict)


_CURRENT: ContextVar[RowFaults | None] = ContextVar("kvlab_row_faults", default=None)


@contextlib.contextmanager
def collect() -> Iterator[RowFaults]:
    """Guard the rows of the forward run inside this block; yields the record of their errors."""
    faults = RowFaults()
    token = _CURRENT.set(faults)
    try:
        yield faults
    finally:
        _CURRENT.reset(token)


def failed(row: int) -> bool:
    """True when ``row`` already failed in the current forward."""
    faults = _CURRENT.get()
    return faults is not None and row in faults.errors


def guard(row: int, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` for batch ``row``; under ``collect()`` an exception is recorded and None returned.

    Out of memory always propagates; outside ``collect()`` every exception does.
    """
    faults = _CURRENT.get()
    if faults is None:
        return fn(*args)
    if row in faults.errors:
        return None
    try:
        return fn(*args)
    except OOM:
        raise
    except Exception as exc:
        faults.errors[row] = describe(exc)
        return None


def error_of(fn: Callable, *args: Any) -> str:
    """Call ``fn(*args)``; return "" or the exception's description (out of memory propagates)."""
    try:
        fn(*args)
    except OOM:
        raise
    except Exception as exc:
        return describe(exc)
    return ""


def made(cls: Callable[..., Compressor], *args: Any, **kwargs: Any) -> Compressor | str:
    """``cls(*args, **kwargs)``, or the description of what its constructor raised (out of memory propagates)."""
    try:
        return cls(*args, **kwargs)
    except OOM:
        raise
    except Exception as exc:
        return describe(exc)


def append(row: int, comp: Compressor, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
    """``comp.append`` for one batch row, guarded."""
    guard(row, comp.append, layer, k, v, pos)


def attend(row: int, comp: Compressor, layer: int, q: Tensor) -> Tensor:
    """``comp.attend`` for one batch row, guarded: q [Hq, 1, d] -> out [Hq, 1, d] (zeros once the row failed)."""
    out = guard(row, comp.attend, layer, q)
    return torch.zeros_like(q) if out is None else out


def feed(row: int, comp: Compressor, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
    """``comp.feed`` for one batch row, guarded: q [Hq, c, d] -> out [Hq, c, d] (zeros once the row failed)."""
    out = guard(row, comp.feed, layer, q, k, v, pos)
    return torch.zeros_like(q) if out is None else out


def describe(exc: BaseException) -> str:
    """One line for a card: the exception's type and message, shortened."""
    text = " ".join(str(exc).split())
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def release() -> None:
    """Free what a failed or cancelled comparison held: unreachable objects, CUDA's cached blocks, and
    (glibc) the freed heap pages the allocator keeps, so that the process's memory goes back down."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def out_of_memory(exc: BaseException) -> OutOfMemory:
    """The message for a comparison that ran out of memory: GPU memory (``torch.OutOfMemoryError``) or RAM."""
    where = "GPU memory" if isinstance(exc, torch.OutOfMemoryError) else "memory (RAM)"
    return OutOfMemory(
        f"out of {where} during the comparison ({type(exc).__name__}); what it held is freed. "
        "Try a shorter prompt, fewer methods or budgets, fewer new tokens, or the measurements off"
    )


def time_limit_s(env: Mapping[str, str] | None = None) -> float | None:
    """The per-request time limit in seconds, or None (see the module's docstring)."""
    names: Mapping[str, str] = os.environ if env is None else env
    raw = names.get("KVLAB_TIME_LIMIT_S", "").strip()
    if raw:
        value = float(raw)
        return value if value > 0 else None
    return SPACE_TIME_LIMIT_S if names.get("SPACE_ID") else None


class FailedCompressor(Compressor):
    """Stands in for a method whose ``compress`` raised: holds nothing, keeps no positions, attends to zeros."""

    def __init__(self, failed: Compressor):  # noqa: D107 - no parameters to resolve: nothing runs
        self.info, self.budget, self.cfg, self.seed = failed.info, failed.budget, dict(failed.cfg), failed.seed
        # the stand-in reports as the method it replaces: its class attributes, on this instance
        self.name, self.streaming = failed.name, failed.streaming  # type: ignore[misc]
        self.scaling = failed.scaling
        self.cache_dtype = failed.cache_dtype

    def compress(self, state) -> None:
        pass

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        pass

    def attend(self, layer: int, q: Tensor) -> Tensor:
        return torch.zeros_like(q)

    def tensors(self):
        return iter(())


__all__ = [
    "OOM",
    "FailedCompressor",
    "OutOfMemory",
    "RowFaults",
    "append",
    "attend",
    "collect",
    "describe",
    "error_of",
    "failed",
    "guard",
    "made",
    "out_of_memory",
    "release",
    "time_limit_s",
]
