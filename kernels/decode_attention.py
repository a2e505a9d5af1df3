"""Fused decode attention over a compressed KV cache: a Triton kernel and its torch reference.

One kernel reads a cache segment in whatever form the method keeps it and never materializes
full-precision keys or values in memory:

* keys dense [Hkv, N, d], or QJL sign bits + norms (+ outliers) — logits from the estimate of
  Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
  Overhead", AAAI 2025 (arXiv:2406.03482), Lemma 3.2;
* values dense, or quantized per token in groups along head_dim (QJL Sec. 4 and KIVI: Liu et al.,
  "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv:2402.02750),
  in kernels.quant's layout (codes packed LSB first, float16 scale and minimum per group);
* per-token log-weights added to the logits (BalanceKV: Han et al., arXiv:2502.07861, and SubGen:
  Zandieh et al., arXiv:2402.06082 — a kept token standing for several);
* a kept-index list (eviction methods: H2O, SnapKV, Scissorhands...) reading rows of a larger buffer.

It is split-K "flash decoding": grid (KV heads, splits), each program runs an online softmax over its
stretch of tokens for all query heads of its KV group at once (any GQA group size: the group's
heads are the rows of one tile), and writes a partial (max, sum, weighted values). ``merge_partials``
combines splits and segments (a layer stored as, say, a quantized body plus a full-precision recent
window is two segments: one launch each, then one merge).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels import _runtime
from kernels.formats import QJLKeys, Segment
from kernels.qjl import qjl_scores_torch, sketch_queries
from kernels.quant import dequantize_groups, storage_bits
from kernels.tensor_ops import gather_tokens, group_queries, ungroup

if _runtime.HAVE_TRITON:
    import triton
    import triton.language as tl

    from kernels.qjl import sign_dot

BLOCK_N = 64
BLOCK_M = 64


# ----- torch reference ------------------------------------------------------------------------
def _n_kv(seg: Segment) -> int:
    return seg.key_rows.shape[0]


def _rows(x: Tensor, index: Tensor | None) -> Tensor:
    """Per-token tensor [Hkv, N, ...] restricted to the attended rows ``index`` [Hkv, n]."""
    return x if index is None else gather_tokens(x, index.long())


def _select_qjl(keys: QJLKeys, index: Tensor | None) -> QJLKeys:
    if index is None:
        return keys
    pick = lambda t: None if t is None else _rows(t, index)  # noqa: E731
    return QJLKeys(
        keys.sketch,
        _rows(keys.bits, index),
        _rows(keys.norms, index),
        keys.out_sketch,
        pick(keys.out_bits),
        pick(keys.out_norms),
    )


def segment_logits_torch(q: Tensor, seg: Segment, scaling: float) -> Tensor:
    """Logits of q [Hq, t, d] over a segment's attended tokens: float32 [Hq, t, n]."""
    hq, hkv = q.shape[0], _n_kv(seg)
    if seg.qjl is not None:
        s = qjl_scores_torch(q, _select_qjl(seg.qjl, seg.index))
    else:
        k = _rows(seg.key_rows, seg.index).float()
        s = ungroup(group_queries(q.float(), hkv) @ k.transpose(-1, -2), hq)
    s = s * scaling
    if seg.log_weights is not None:
        lw = _rows(seg.log_weights, seg.index).float()
        s = ungroup(group_queries(s, hkv) + lw.unsqueeze(-2), hq)
    return s


def segment_values_torch(seg: Segment) -> Tensor:
    """A segment's attended values, float32 [Hkv, n, d]."""
    if seg.qvalues is not None:
        v = dequantize_groups(seg.qvalues)
    else:
        assert seg.values is not None  # Segment.__post_init__: one of the two
        v = seg.values.float()
    return _rows(v, seg.index)


def decode_attention_torch(q: Tensor, segments: list[Segment], scaling: float) -> Tensor:
    """Reference: softmax attention of q [Hq, t, d] over the union of the segments -> [Hq, t, d] (q's dtype)."""
    hq, hkv = q.shape[0], _n_kv(segments[0])
    logits = torch.cat([segment_logits_torch(q, s, scaling) for s in segments], dim=-1)
    values = torch.cat([segment_values_torch(s) for s in segments], dim=-2)
    probs = group_queries(torch.softmax(logits, dim=-1), hkv)
    return ungroup(probs @ values, hq).to(q.dtype)


# ----- merging partial results ----------------------------------------------------------------
def merge_partials(parts: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """Combine online-softmax partials into attention outputs.

    Each part: running max m [Hkv, S, R], sum of exp l [Hkv, S, R], weighted values acc
    [Hkv, S, R, d] (unnormalized, relative to m). Returns float32 [Hkv, R, d].
    """
    m = torch.cat([p[0] for p in parts], dim=1)
    lsum = torch.cat([p[1] for p in parts], dim=1)
    acc = torch.cat([p[2] for p in parts], dim=1)
    top = m.amax(dim=1, keepdim=True)
    w = torch.exp(m - top)
    return (acc * w.unsqueeze(-1)).sum(1) / (lsum * w).sum(1).unsqueeze(-1)


# ----- Triton kernel --------------------------------------------------------------------------
if _runtime.HAVE_TRITON:

    @triton.jit
    def _dequant_tile(
        v_ptr, vs_ptr, vm_ptr, rows, mask_n, offs_d, mask_d, NG,
        VG: tl.constexpr, SB: tl.constexpr, VBPG: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    ):  # fmt: skip
        """Values of ``rows`` from packed codes (kernels.quant layout) -> float32 [BLOCK_N, D_PAD]."""
        per: tl.constexpr = 8 // SB
        grp = offs_d // VG
        mask = mask_n[:, None] & mask_d[None, :]
        if (VG * SB % 8 == 0) and (8 % SB == 0):  # whole codes per byte, groups on byte boundaries: load each byte once
            b = tl.arange(0, D_PAD // per)
            byte = tl.load(
                v_ptr + rows[:, None] * (NG * VBPG) + b[None, :],
                mask=mask_n[:, None] & (b < NG * VBPG)[None, :],
                other=0,
            )
            code = (byte.to(tl.int32)[:, :, None] >> (tl.arange(0, per) * SB)[None, None, :]) & ((1 << SB) - 1)
            code = tl.reshape(code, (BLOCK_N, D_PAD))
        else:  # gather per channel: bits [w*SB, (w+1)*SB) of its group's bytes, which may span two (3-bit codes)
            bit = (offs_d % VG) * SB
            at = rows[:, None] * (NG * VBPG) + (grp * VBPG + bit // 8)[None, :]
            lo = tl.load(v_ptr + at, mask=mask, other=0).to(tl.int32)
            spans = mask & ((bit % 8 + SB > 8) & (bit // 8 + 1 < VBPG))[None, :]
            hi = tl.load(v_ptr + at + 1, mask=spans, other=0).to(tl.int32)
            code = ((lo | (hi << 8)) >> (bit % 8)[None, :]) & ((1 << SB) - 1)
        sm = rows[:, None] * NG + grp[None, :]
        scale = tl.load(vs_ptr + sm, mask=mask, other=0.0).to(tl.float32)
        low = tl.load(vm_ptr + sm, mask=mask, other=0.0).to(tl.float32)
        return low + scale * code.to(tl.float32)

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, kn_ptr, qo_ptr, kob_ptr, kon_ptr,
        v_ptr, vs_ptr, vm_ptr, lw_ptr, idx_ptr,
        m_ptr, l_ptr, acc_ptr,
        n, N, R, D, NG, chunk, n_splits, scaling, coef, coef_out,
        KEY_QJL: tl.constexpr, HAS_OUT: tl.constexpr, M: tl.constexpr, M_OUT: tl.constexpr,
        VAL_Q: tl.constexpr, VG: tl.constexpr, SB: tl.constexpr, VBPG: tl.constexpr,
        HAS_LW: tl.constexpr, HAS_IDX: tl.constexpr,
        R_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (Hkv, n_splits). q: dense queries [Hkv, R, D] or sketched ones [Hkv, R, M] (QJL).

        Per-token tensors are [Hkv, N, ...]; ``idx`` [Hkv, n] picks rows. Writes m, l [Hkv, S, R]
        and acc [Hkv, S, R, D] for split s over tokens [s*chunk, min(n, (s+1)*chunk)).
        """
        h = tl.program_id(0)
        s = tl.program_id(1)
        offs_r = tl.arange(0, R_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask_r, mask_d = offs_r < R, offs_d < D
        if not KEY_QJL:
            q = tl.load(
                q_ptr + (h * R + offs_r)[:, None] * D + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :],
                other=0.0,
            )
            q = q.to(tl.float32)
        m_i = tl.full((R_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((R_PAD,), tl.float32)
        acc = tl.zeros((R_PAD, D_PAD), tl.float32)
        start = s * chunk
        end = tl.minimum(start + chunk, n)
        for t0 in range(start, end, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if HAS_IDX:
                rows = tl.load(idx_ptr + h * n + offs_n, mask=mask_n, other=0).to(tl.int64)
            else:
                rows = offs_n.to(tl.int64)
            rows = h * N + rows
            if KEY_QJL:
                norm = tl.load(kn_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
                logits = (
                    sign_dot(q_ptr + h * R * M, k_ptr, rows, mask_n, offs_r, mask_r, M, R_PAD, BLOCK_N, BLOCK_M)
                    * (norm * coef)[None, :]
                )
                if HAS_OUT:
                    onorm = tl.load(kon_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
                    oest = sign_dot(
                        qo_ptr + h * R * M_OUT, kob_ptr, rows, mask_n, offs_r, mask_r, M_OUT, R_PAD, BLOCK_N, BLOCK_M
                    )
                    logits += oest * (onorm * coef_out)[None, :]
            else:
                k = tl.load(
                    k_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
                )
                logits = tl.dot(q, tl.trans(k.to(tl.float32)))
            logits = logits * scaling
            if HAS_LW:
                logits += tl.load(lw_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            logits = tl.where(mask_n[None, :], logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(logits - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if VAL_Q:
                v = _dequant_tile(v_ptr, vs_ptr, vm_ptr, rows, mask_n, offs_d, mask_d, NG, VG, SB, VBPG, BLOCK_N, D_PAD)
            else:
                v = tl.load(
                    v_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
                )
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out = (h * n_splits + s) * R + offs_r
        tl.store(m_ptr + out, m_i, mask=mask_r)
        tl.store(l_ptr + out, l_i, mask=mask_r)
        tl.store(acc_ptr + out[:, None] * D + offs_d[None, :], acc, mask=mask_r[:, None] & mask_d[None, :])


def _n_splits(n: int, hkv: int, device: torch.device, splits: int | None) -> int:
    """How many programs share a head's tokens: enough to fill the GPU (4 per SM), one per tile at most."""
    tiles = max(1, -(-n // BLOCK_N))
    if splits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = max(1, 4 * sms // hkv)
        else:
            splits = 4
    return max(1, min(splits, tiles))


def _segment_partials_triton(q: Tensor, seg: Segment, scaling: float, splits: int | None):
    """Launch the kernel on one segment: (m, l, acc) partials, see ``merge_partials``."""
    hq, t, d = q.shape
    hkv = _n_kv(seg)
    if d % 16:
        raise ValueError(f"head_dim {d} must be a multiple of 16 for the Triton kernels")
    n, big_n, dev = seg.n, seg.n_rows, q.device
    r = (hq // hkv) * t
    s = _n_splits(n, hkv, dev, splits)
    tiles_per = -(-max(n, 1) // BLOCK_N)
    chunk = -(-tiles_per // s) * BLOCK_N
    s = -(-n // chunk)
    m_out = torch.empty(hkv, s, r, device=dev)
    l_out = torch.empty(hkv, s, r, device=dev)
    acc = torch.empty(hkv, s, r, d, device=dev)
    qk = seg.qjl
    if qk is not None:
        qq, kk, kn = sketch_queries(q, qk.sketch, hkv), qk.bits.contiguous(), qk.norms.contiguous()
        outliers = qk.outliers
        has_out = outliers is not None
        if outliers is not None:
            out_sketch, out_bits, out_norms = outliers
            qo, kob, kon = sketch_queries(q, out_sketch, hkv), out_bits.contiguous(), out_norms.contiguous()
            m_o = out_sketch.shape[0]
        else:
            qo, kob, kon, m_o = qq, kk, kn, 8
        m = qk.m
    else:
        qq = group_queries(q, hkv).contiguous()
        kk = seg.key_rows.contiguous()
        kn = qo = kob = kon = kk
        has_out, m, m_o = False, 8, 8
    qv = seg.qvalues
    if qv is not None:
        sb = storage_bits(qv.bits)
        vv, vs, vm = qv.codes.contiguous(), qv.scale.contiguous(), qv.minimum.contiguous()
        ng, vg, vbpg = qv.n_groups, qv.group, qv.codes.shape[-1]
    else:
        assert seg.values is not None  # Segment.__post_init__: one of the two
        vv = seg.values.contiguous()
        vs = vm = vv
        ng, vg, sb, vbpg = 1, 16, 8, 1
    lw = seg.log_weights.contiguous() if seg.log_weights is not None else kn
    idx = seg.index.to(torch.int32).contiguous() if seg.index is not None else kn
    _decode_kernel[(hkv, s)](
        qq, kk, kn, qo, kob, kon, vv, vs, vm, lw, idx, m_out, l_out, acc,
        n, big_n, r, d, ng, chunk, s, scaling, math.sqrt(math.pi / 2) / m, math.sqrt(math.pi / 2) / m_o,
        KEY_QJL=qk is not None, HAS_OUT=has_out, M=m, M_OUT=m_o,
        VAL_Q=qv is not None, VG=vg, SB=sb, VBPG=vbpg,
        HAS_LW=seg.log_weights is not None, HAS_IDX=seg.index is not None,
        R_PAD=_runtime.next_pow2(r), D_PAD=_runtime.next_pow2(d), BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return m_out, l_out, acc


def decode_attention_triton(q: Tensor, segments: list[Segment], scaling: float, splits: int | None = None) -> Tensor:
    """The kernel path: one launch per non-empty segment, then ``merge_partials``. q [Hq, t, d] -> [Hq, t, d]."""
    parts = [_segment_partials_triton(q, s, scaling, splits) for s in segments if s.n > 0]
    return ungroup(merge_partials(parts), q.shape[0]).to(q.dtype)


def decode_attention(q: Tensor, segments: list[Segment], scaling: float, splits: int | None = None) -> Tensor:
    """Attention of q [Hq, t, d] over a layer's cache segments -> [Hq, t, d]; Triton or torch (see kernels).

    Plain softmax attention with per-token log-weights, values of the key's head size. A layer whose
    ``kvlab.core.semantics.LayerSemantics`` is not plain (sliding window, soft-cap, sinks) or whose value
    heads differ in size is not computed here: ``DenseCompressor.attend`` sends it to the torch path."""
    if _runtime.use_triton(q.device):
        _runtime.check_device(q.device)
        return decode_attention_triton(q, segments, scaling, splits)
    return decode_attention_torch(q, segments, scaling)
