"""Stopping model work where it runs: a cancel or the time limit ends it between layers, not at the end.

A ``Token`` is set by whoever may stop the work (the page's Cancel button, from another thread)
and may carry a deadline (the per-request time limit). The code doing the work calls
``checkpoint()``: when the current token was cancelled it raises ``Cancelled``; past the
deadline, ``TimeLimit``. Both derive from ``BaseException``, so the ``except Exception`` that
isolates one method's fault (``kvlab.engine.faults``) never swallows them.

Where the checks are:

* every decoder layer of the model and each of its parts, by forward pre-hooks (``install``; no
  model code is patched): the prefill, each decode step, the question fed after compression and
  the probes' work inside the layers all stop within one matmul or attention call;
* between the methods' compressions (``Engine``) and inside the methods that loop over layers.

The current token lives in a ``ContextVar``. A generator's body runs a piece at a time, each
``next`` possibly in another thread (Gradio runs a streaming callback in a thread pool), so
``scoped`` sets the token around each ``next`` of the generator it wraps.

    token = Token()
    for event in scoped(engine.stream(ids, runs), token):   # token.cancel() from any thread
        ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

T = TypeVar("T")


class Cancelled(BaseException):  # noqa: N818 - like asyncio.CancelledError: a stop, not an error
    """The work was stopped by a cancel; nothing of it is kept."""


class TimeLimit(Cancelled):
    """The work reached its time limit (the message says which limit)."""


class Token:
    """A cancel flag, a deadline (``time.perf_counter()`` seconds, None: none) and the token it nests in.

    ``busy``: True while the work runs (from ``working()`` until ``paused()`` or ``finished()``);
    ``wait_idle`` waits for the piece in progress to end (after ``cancel``, within a layer).
    """

    def __init__(self, deadline: float | None = None, why: str = "", parent: Token | None = None):
        self.deadline, self.why, self.parent = deadline, why, parent
        self._cancelled = threading.Event()
        self._idle = threading.Event()
        self._idle.set()

    @classmethod
    def within(cls, seconds: float | None, why: str) -> Token:
        """A token nested in the current one, with a deadline ``seconds`` from now (None: the parent's only)."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        return cls(deadline, why, current())

    def cancel(self) -> None:
        self._cancelled.set()

    def limit_handled(self) -> None:
        """The work met its deadline and ended itself there (keeping what it had): later checks look
        for a cancel only."""
        self.deadline = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set() or (self.parent is not None and self.parent.cancelled)

    def check(self) -> None:
        """Raise ``Cancelled`` when cancelled (here or in a parent), ``TimeLimit`` past a deadline."""
        if self.cancelled:
            raise Cancelled("cancelled")
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise TimeLimit(self.why or "stopped at the time limit")
        if self.parent is not None:
            self.parent.check()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def working(self) -> None:
        """The work is running (a callback started, or resumed after handing back a partial result)."""
        self._idle.clear()

    def finished(self) -> None:
        """The work ended (or waits for its caller): nothing runs under this token."""
        self._idle.set()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not busy inside the block: a generator hands back a result here (``yield`` inside the block)."""
        self.finished()
        try:
            yield
        finally:
            self.working()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no piece of work runs under this token; False when ``timeout`` s passed first."""
        return self._idle.wait(timeout)


_CURRENT: ContextVar[Token | None] = ContextVar("kvlab_cancel_token", default=None)


def current() -> Token | None:
    return _CURRENT.get()


def checkpoint() -> None:
    """Stop here when the current token says so (no token: nothing to check)."""
    token = _CURRENT.get()
    if token is not None:
        token.check()


@contextmanager
def scope(token: Token | None) -> Iterator[None]:
    """Make ``token`` current inside the block."""
    ctx = _CURRENT.set(token)
    try:
        yield
    finally:
        _CURRENT.reset(ctx)


def scoped(items: Iterator[T], token: Token | None) -> Iterator[T]:
    """``items`` with ``token`` current while each item is computed, in whichever thread asks for it.

    The token is checked before each piece too: a cancel between two items stops before the next.
    """
    while True:
        with scope(token):
            checkpoint()
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


def decoder_layers(model: torch.nn.Module, n_layers: int) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: its first ``ModuleList`` of ``n_layers`` modules."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return module
    raise ValueError(f"no stack of {n_layers} decoder layers found in {type(model).__name__}")


def _check_before(module, args) -> None:
    checkpoint()


def install(model: torch.nn.Module, n_layers: int) -> None:
    """Check the current token before every decoder layer of ``model`` and each of its parts (norms,
    projections, MLP): a 4k-token prefill stops within one matmul. Once per model; a check costs
    about a microsecond (a few hundred per forward)."""
    if getattr(model, "_kvlab_checkpoints", False):
        return
    for layer in decoder_layers(model, n_layers):
        for module in layer.modules():
            module.register_forward_pre_hook(_check_before)
    model._kvlab_checkpoints = True  # type: ignore[assignment]  # torch types Module attributes as tensors


__all__ = ["Cancelled", "TimeLimit", "Token", "checkpoint", "current", "install", "scope", "scoped"]
