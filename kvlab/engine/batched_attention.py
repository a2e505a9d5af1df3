"""One attention call per layer for the lockstep rows of a class that attends several rows at once.

In a lockstep decode step every row (one run) has one query per layer. A class whose caches are
quantized or sketched may attend all its rows in one call (``attend_many``: QJL and KIVI, which read
a segment that several forks hold once for all of them). Every other row goes through its own
``comp.attend(layer, q)``: a dense row attends alone (measured on a 2-core CPU, padding the dense
rows into one call cost more than the per-row calls it saved: ``bench/padded_dense.py`` keeps that
schedule for the A/B of ``bench/decode_step.py``). On CUDA every row attends through its own
``attend``: a dense row's is then the fused Triton decode kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from kernels import use_triton
from kvlab.methods import Compressor

# how a decode step's rows attend: (compressors, layer, query [B, Hq, 1, d], guard, attend) -> B outputs
RowAttention = Callable[..., list[Tensor]]


def _unguarded(row: int, fn: Callable, *args: Any) -> Any:
    return fn(*args)


def _attend(row: int, comp: Compressor, layer: int, q: Tensor) -> Tensor:
    return comp.attend(layer, q)


def attend_rows(
    compressors: list[Compressor],
    layer: int,
    query: Tensor,
    guard: Callable = _unguarded,
    attend: Callable = _attend,
    outs: list[Tensor | None] | None = None,
) -> list[Tensor]:
    """Each row's attention output [Hq, 1, d] for one layer: query [B, Hq, 1, d], row i through ``compressors[i]``.

    The rows of a class with ``attend_many`` attend in one call per class, the others through
    ``attend(row, comp, layer, q)`` (``comp.attend``). ``guard(row, fn, *args)`` tells a failed row
    (a fault-isolating guard returns None for a row that raised): it goes to ``attend``, which
    answers zeros for it. ``outs``: rows another schedule already attended (None where not), kept.
    """
    outs = [None] * len(compressors) if outs is None else list(outs)
    if not use_triton(query.device):  # CUDA: each dense row already runs the fused Triton decode kernel
        for rows in _kinds(compressors, outs, guard):
            outs_k = _attend_many(compressors, rows, layer, query)
            for row, out in zip(rows, outs_k or ()):
                outs[row] = out
    return [
        out if out is not None else attend(row, comp, layer, query[row])
        for row, (comp, out) in enumerate(zip(compressors, outs))
    ]


def attend_each(
    compressors: list[Compressor],
    layer: int,
    query: Tensor,
    guard: Callable = _unguarded,
    attend: Callable = _attend,
) -> list[Tensor]:
    """Every row through its own ``attend``, one at a time: the path ``attend_rows``' batched calls must equal."""
    return [attend(row, comp, layer, query[row]) for row, comp in enumerate(compressors)]


def _ok(*args: Any) -> bool:
    return True


def _kinds(compressors: list[Compressor], outs: list[Tensor | None], guard: Callable) -> list[list[int]]:
    """The rows left (``outs`` None, not failed) whose class attends several rows in one call (``attend_many``),
    by class."""
    by_kind: dict[type, list[int]] = {}
    for row, comp in enumerate(compressors):
        if outs[row] is None and type(comp).attend_many is not None and guard(row, _ok):
            by_kind.setdefault(type(comp), []).append(row)
    return list(by_kind.values())


def _attend_many(compressors: list[Compressor], rows: list[int], layer: int, query: Tensor) -> list[Tensor] | None:
    """One ``attend_many`` call for ``rows``; None when it raised: each row then attends alone, so that an
    error lands on the row it belongs to (``attend``'s guard)."""
    cls: Any = type(compressors[rows[0]])  # a class that declares ``attend_many``
    try:
        return cls.attend_many([compressors[r] for r in rows], layer, query[rows])
    except Exception:
        return None


__all__ = ["RowAttention", "attend_each", "attend_rows"]
