"""One attention call per layer for the lockstep rows whose cache reads as dense tokens.

The engine batches the dense rows only with ``LockstepDecode.dense_together`` (off by default: on
the 2-core CPU measured, the padded copy costs more than the per-row calls it saves); the rows of
a class with ``attend_many`` (QJL, KIVI) always attend in one call per class.

In a lockstep decode step every row (one run) has one query per layer. A row whose cache, for that
layer, is full-precision keys and values with optional per-token log-weights (``exact``,
``streaming``, ``h2o``, ``snapkv``, ``pyramidkv``, ``uniform``, ``balancekv``, ``subgen-kcenter``,
``scissorhands``, the compositions' stores read back as dense keys and values, and any other
method whose ``dense_segments(layer)`` answers) attends together with the others: their keys and
values are copied into one float32 batch padded to the longest row, the padding masked by a -inf
bias, the log-weights added as the bias elsewhere, and one grouped-query softmax attention runs
over the whole batch; the maths is ``kvlab.ops.dense_attention``'s, row by row. Rows of very
different lengths (an exact cache beside a compressed one) go in separate calls
(``length_buckets``): the attention of one decode query is bound by reading the keys and values,
so that padding would cost more than the call saves. Rows whose method wants this step's
probabilities (H2O / Scissorhands eviction, ``wants_probs``) get their own row of them (padding
cut off) through ``after_attend``, as the per-row path hands them.

A class whose caches are quantized or sketched may attend all its rows in one call
(``attend_many``: QJL, which reads a segment that several forks hold once for all of them). Every
other row (``kivi``, ``subgen``) goes through its own ``comp.attend(layer, q)``, the per-row
reference path. On CUDA every row does: a dense row's
``attend`` is then the fused Triton decode kernel.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kernels import use_triton
from kvlab import semantics as sm
from kvlab.ops import group_queries, ungroup
from kvlab.semantics import LayerSemantics


def _unguarded(row: int, fn: Callable, *args: Any) -> Any:
    return fn(*args)


def _attend(row: int, comp, layer: int, q: Tensor) -> Tensor:
    return comp.attend(layer, q)


def _after_attend(comp, layer: int, probs: Tensor) -> bool:
    comp.after_attend(layer, probs)
    return True


MAX_PADDING = 0.5  # a call's padded keys are at most this share above its rows' own (``length_buckets``)


@functools.cache
def stands_for_attend(cls: type, name: str) -> bool:
    """True when ``cls.<name>`` (``dense_segments`` or ``attend_many``) describes ``cls.attend``: both
    come from the same class.

    A subclass that overrides ``attend`` alone (a wrapper, a test fault) attends through its own
    ``attend``, never through the batched call its parent describes."""

    def owner(attr: str) -> type | None:
        return next((c for c in cls.__mro__ if attr in c.__dict__), None)

    return owner(name) is not None and owner("attend") is owner(name)


@dataclass
class DenseRows:
    """The dense rows of one layer: batch row indices and each one's (k, v, logw) views.

    k, v: [Hkv, n_i, d] (any float dtype); logw: [Hkv, n_i] float32 or None.
    """

    rows: list[int]
    segments: list[tuple[Tensor, Tensor, Tensor | None]]

    @classmethod
    def collect(cls, compressors: list, layer: int, guard: Callable = _unguarded) -> DenseRows:
        rows, segments = [], []
        for row, comp in enumerate(compressors):
            if not stands_for_attend(type(comp), "dense_segments"):
                continue
            seg = guard(row, comp.dense_segments, layer)
            if seg is not None:
                rows.append(row)
                segments.append(seg)
        return cls(rows, segments)


class _Workspace(threading.local):
    """Float32 buffers reused by every call of a thread: a new multi-megabyte tensor per layer and
    step would be fresh memory each time, and touching fresh pages costs more than the copy into them."""

    def __init__(self):
        self.buffers: dict[tuple[str, torch.device], Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """A float32 tensor of ``shape`` (uninitialized) over this thread's buffer ``name``."""
        numel = math.prod(shape)
        buf = self.buffers.get((name, device))
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name, device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel].view(shape)


_WORKSPACE = _Workspace()


def padded_batch(segments: list[tuple[Tensor, Tensor, Tensor | None]]) -> tuple[Tensor, Tensor, Tensor]:
    """Rows' keys/values padded to the longest: K, V [R, Hkv, N, d] float32 and the bias [R, Hkv, N]
    (the row's log-weights, 0 without them, -inf on the padding). Padded keys and values are zero,
    so a masked key contributes exactly 0 to the softmax and the output. The three tensors are views
    of this thread's workspace: valid until its next call."""
    k0 = segments[0][0]
    hkv, d = k0.shape[0], k0.shape[-1]
    lengths = [k.shape[-2] for k, _, _ in segments]
    n_max = max(lengths)
    shape = (len(segments), hkv, n_max, d)
    big_k, big_v = (_WORKSPACE.take(name, shape, k0.device) for name in ("keys", "values"))
    bias = _WORKSPACE.take("bias", shape[:-1], k0.device).zero_()
    for i, ((k, v, lw), n) in enumerate(zip(segments, lengths)):
        big_k[i, :, :n].copy_(k)
        big_v[i, :, :n].copy_(v)
        if lw is not None:
            bias[i, :, :n].copy_(lw)
        if n < n_max:
            big_k[i, :, n:].zero_()
            big_v[i, :, n:].zero_()
            bias[i, :, n:].fill_(float("-inf"))
    return big_k, big_v, bias


def batched_dense_attention(
    q: Tensor, segments: list[tuple[Tensor, Tensor, Tensor | None]], scaling: LayerSemantics | float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of R rows, each over its own dense cache, in one call.

    q: [R, Hq, t, d]; segments: R (k, v, logw) as in ``DenseRows``. Returns out [R, Hq, t, d] (q's
    dtype) and probs [R, Hq, t, N] float32 (N the longest row; zero on each row's padding).
    ``scaling`` a ``LayerSemantics``: the layer's soft-cap and sinks as ``semantics.logits`` / ``softmax``.
    """
    if len(segments) == 1:  # nothing to pad: the row's own tensors, widened as ``dense_attention`` does
        k, v, lw = segments[0]
        big_k, big_v, bias = k.float()[None], v.float()[None], None if lw is None else lw.float()[None]
    else:
        big_k, big_v, bias = padded_batch(segments)
    hq, hkv = q.shape[-3], big_k.shape[-3]
    logits = sm.logits(q.float(), big_k, scaling, bias)  # [R, Hq, t, N]
    probs = sm.softmax(logits, scaling)
    out = ungroup(torch.matmul(group_queries(probs, hkv), big_v), hq).to(q.dtype)
    return out, probs


def length_buckets(lengths: list[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Split rows into calls so that padding at most multiplies a call's keys by ``1 + max_padding``.

    lengths: each row's cache length. Returns lists of row indices (longest rows first). Attention over
    a decode step's cache is bound by reading the keys and values, so padding a 400-token row to an
    exact row's 1,900 tokens would cost more than the call it saves; rows of similar lengths share one.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            rows = buckets[-1] + [i]
            padded = len(rows) * lengths[rows[0]]
            if padded <= (1 + max_padding) * sum(lengths[j] for j in rows):
                buckets[-1] = rows
                continue
        buckets.append([i])
    return buckets


def attend_rows(
    compressors: list,
    layer: int,
    query: Tensor,
    guard: Callable = _unguarded,
    attend: Callable = _attend,
    dense_together: bool = True,
) -> list[Tensor]:
    """Each row's attention output [Hq, 1, d] for one layer: query [B, Hq, 1, d], row i through ``compressors[i]``.

    Dense rows attend in ``batched_dense_attention`` calls, one per ``length_buckets`` bucket (those
    that want the probabilities get their row through ``after_attend``); the others through
    ``attend(row, comp, layer, q)`` (``comp.attend``). ``guard(row, fn, *args)`` runs each row's own
    calls (``dense_segments``, ``after_attend``): a fault-isolating guard returns None for a row that
    raised, which then goes to ``attend`` (that answers zeros for a failed row).
    """
    if use_triton(query.device):  # CUDA: each dense row already runs the fused Triton decode kernel
        return [attend(row, comp, layer, query[row]) for row, comp in enumerate(compressors)]
    dense = DenseRows.collect(compressors, layer, guard) if dense_together else DenseRows([], [])
    outs: list[Tensor | None] = [None] * len(compressors)
    lengths = [seg[0].shape[-2] for seg in dense.segments]
    for bucket in length_buckets(lengths):
        rows = [dense.rows[j] for j in bucket]
        out, probs = batched_dense_attention(
            query[rows], [dense.segments[j] for j in bucket], compressors[rows[0]].sem[layer]
        )
        for i, (j, row) in enumerate(zip(bucket, rows)):
            comp = compressors[row]
            outs[row] = out[i]
            if comp.wants_probs and guard(row, _after_attend, comp, layer, probs[i, ..., : lengths[j]]) is None:
                outs[row] = None  # the row failed: ``attend`` answers for it
    for rows in _kinds(compressors, outs, guard):
        outs_k = _attend_many(compressors, rows, layer, query)
        for row, out in zip(rows, outs_k or ()):
            outs[row] = out
    for row, comp in enumerate(compressors):
        if outs[row] is None:
            outs[row] = attend(row, comp, layer, query[row])
    return outs


def _ok(*args: Any) -> bool:
    return True


def _kinds(compressors: list, outs: list, guard: Callable) -> list[list[int]]:
    """The rows left (``outs`` None, not failed) whose class declares a call attending several rows at once
    (``Compressor.attend_many``), by class."""
    by_kind: dict[type, list[int]] = {}
    for row, comp in enumerate(compressors):
        if outs[row] is None and type(comp).attend_many is not None and guard(row, _ok):
            by_kind.setdefault(type(comp), []).append(row)
    return list(by_kind.values())


def _attend_many(compressors: list, rows: list[int], layer: int, query: Tensor) -> list[Tensor] | None:
    """One ``attend_many`` call for ``rows``; None when it raised: each row then attends alone, so that an
    error lands on the row it belongs to (``attend``'s guard)."""
    try:
        return type(compressors[rows[0]]).attend_many([compressors[r] for r in rows], layer, query[rows])
    except Exception:
        return None


__all__ = ["DenseRows", "attend_rows", "batched_dense_attention", "length_buckets", "padded_batch"]
