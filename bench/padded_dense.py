"""The padded dense attention, kept for the A/B of ``bench.decode_step``: one attention call per layer
for the lockstep rows whose cache reads as dense tokens, against each row attending alone.

Measured on a 2-core CPU, the padded copy costs more than the per-row calls it saves (bench/README.md,
"A decode step against the forward alone"), so the engine attends every dense row alone; this module
is what the benchmark swaps in (``schedule("padded")``) to measure that schedule again.

A row whose compressor is a ``DenseCompressor`` attending through its own ``attend`` (``exact``,
``streaming``, ``h2o``, ``snapkv``, ``pyramidkv``, ``uniform``, ``balancekv``, ``subgen-kcenter``,
``scissorhands``, the compositions' stores read back as dense keys and values) has its visible keys,
values and log-weights copied into one float32 batch padded to the longest row, the padding masked
by a -inf bias, the log-weights added as the bias elsewhere; one grouped-query softmax attention runs
over the whole batch (``kvlab.core.semantics.attend``'s maths, row by row). Rows of very different
lengths go in separate calls (``length_buckets``). Rows whose method wants this step's
probabilities (``wants_probs``) get their own row of them (padding cut off) through
``after_attend``. Every other row goes through ``kvlab.engine.batched_attention.attend_rows``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kernels import use_triton
from kernels.tensor_ops import group_queries, ungroup
from kvlab.core import semantics as sm
from kvlab.core.semantics import LayerSemantics
from kvlab.engine.batched_attention import attend_each, attend_rows
from kvlab.engine.rows import DecodePaths
from kvlab.methods import Compressor
from kvlab.methods.dense import DenseCompressor

MAX_PADDING = 0.5  # a call's padded keys are at most this share above its rows' own (``length_buckets``)

Segment = tuple[Tensor, Tensor, Tensor | None]  # k, v [Hkv, n, d] (any float dtype); logw [Hkv, n] float32 or None


def _unguarded(row: int, fn: Callable, *args: Any) -> Any:
    return fn(*args)


def _attend(row: int, comp: Compressor, layer: int, q: Tensor) -> Tensor:
    return comp.attend(layer, q)


def _after_attend(comp: Compressor, layer: int, probs: Tensor) -> bool:
    comp.after_attend(layer, probs)
    return True


def dense_segment(comp: Compressor, layer: int) -> Segment | None:
    """This layer's cache as dense tokens, when its ``attend`` is the dense store's: (k, v, logw)."""
    if not isinstance(comp, DenseCompressor) or type(comp).attend is not DenseCompressor.attend:
        return None  # a wrapper or another cache attends through its own ``attend``
    k, v, _, lw = comp.visible(layer)
    if not isinstance(k, Tensor):  # scored keys (QJL sketches): no dense keys to pad
        return None
    return k, v, lw


@dataclass
class DenseRows:
    """The dense rows of one layer: batch row indices and each one's (k, v, logw) views."""

    rows: list[int]
    segments: list[Segment]

    @classmethod
    def collect(cls, compressors: list[Compressor], layer: int, guard: Callable = _unguarded) -> DenseRows:
        rows, segments = [], []
        for row, comp in enumerate(compressors):
            seg = guard(row, dense_segment, comp, layer)
            if seg is not None:
                rows.append(row)
                segments.append(seg)
        return cls(rows, segments)


class _Workspace(threading.local):
    """Float32 buffers reused by every call of a thread: a new multi-megabyte tensor per layer and
    step would be fresh memory each time, and touching fresh pages costs more than the copy into them."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device], Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """A float32 tensor of ``shape`` (uninitialized) over this thread's buffer ``name``."""
        numel = math.prod(shape)
        buf = self.buffers.get((name, device))
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name, device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel].view(shape)


_WORKSPACE = _Workspace()


def padded_batch(segments: list[Segment]) -> tuple[Tensor, Tensor, Tensor]:
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
    q: Tensor, segments: list[Segment], scaling: LayerSemantics | float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of R rows, each over its own dense cache, in one call.

    q: [R, Hq, t, d]; segments: R (k, v, logw) as in ``DenseRows``. Returns out [R, Hq, t, d] (q's
    dtype) and probs [R, Hq, t, N] float32 (N the longest row; zero on each row's padding).
    ``scaling`` a ``LayerSemantics``: the layer's soft-cap and sinks as ``semantics.logits`` / ``softmax``.
    """
    if len(segments) == 1:  # nothing to pad: the row's own tensors, widened as ``semantics.attend`` does
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


def attend_padded(
    compressors: list[Compressor],
    layer: int,
    query: Tensor,
    guard: Callable = _unguarded,
    attend: Callable = _attend,
) -> list[Tensor]:
    """Each row's attention output [Hq, 1, d] for one layer: query [B, Hq, 1, d], row i through ``compressors[i]``.

    Dense rows attend in ``batched_dense_attention`` calls, one per ``length_buckets`` bucket (those
    that want the probabilities get their row through ``after_attend``); the others as the engine
    attends them (``kvlab.engine.batched_attention.attend_rows``). ``guard(row, fn, *args)`` runs each row's
    own calls: a fault-isolating guard returns None for a row that raised, which then goes to
    ``attend`` (that answers zeros for a failed row).
    """
    if use_triton(query.device):  # CUDA: each dense row runs the fused Triton decode kernel
        return attend_rows(compressors, layer, query, guard, attend)
    dense = DenseRows.collect(compressors, layer, guard)
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
    return attend_rows(compressors, layer, query, guard, attend, outs=outs)


def paths(name: str) -> DecodePaths:
    """The engine's decode paths with the rows attending by schedule ``name``: "padded" (the dense rows
    in padded calls, the others as the engine does), "per_row" (every row through its own ``attend``)
    or "engine" (the engine's own)."""
    rows = {"padded": attend_padded, "per_row": attend_each, "engine": attend_rows}.get(name)
    if rows is None:
        raise ValueError(f"unknown schedule {name!r}; allowed: padded, per_row, engine")
    return DecodePaths(row_attention=rows)


__all__ = ["DenseRows", "attend_padded", "batched_dense_attention", "dense_segment", "length_buckets", "paths"]
