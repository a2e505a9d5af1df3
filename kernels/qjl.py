"""QJL key quantization and score estimation: Triton kernels and their torch references.

Zandieh, Daliri, Han. "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
Overhead", AAAI 2025, https://arxiv.org/abs/2406.03482 — Sec. 3 (Definition 3.1: key -> sign(S k)
plus ||k||; Lemma 3.2: the unbiased inner-product estimate sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>)
and Sec. 4 (outlier channels sketched separately, per group of tokens).

Storage format (shared with kvlab/methods/qjl.py; packing by kernels/quant.py):

* sign bits uint8 [Hkv, n, m/8], 8 per byte along the sketch dim, LSB first, bit 1 = (S k) >= 0;
* key norms float16 [Hkv, n] of the part sketched;
* sketch S float32 [m, d]; outliers: S_out [m_out, d] on the outlier channels of each key (the
  others zeroed), bits [Hkv, n, m_out/8], norms [Hkv, n], channel indices uint8
  [Hkv, n_groups, n_outliers] per group of ``group`` tokens; the inlier part uses S.
* the score of query head h against key i of its KV group g is the sum of the two estimates.

Kernels (any head_dim that is a multiple of 16, any GQA group size, any m that is a multiple of 8):
``qjl_quantize`` (sketch, sign, pack, norms, outlier split) and ``qjl_scores`` (estimates straight
from the packed bits for all query heads of a KV group at once). Each has a ``*_torch`` reference
computing the same maths with kernels.quant's helpers; the public functions dispatch (see
kernels/_runtime.py).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kernels import _runtime, compiled
from kernels.formats import QJLKeys
from kernels.quant import pack_signs, sign_table, unpack_signs
from kernels.tensor_ops import group_queries, ungroup

if _runtime.HAVE_TRITON:
    import triton
    import triton.language as tl

BLOCK_N = 64  # tokens per tile
BLOCK_M = 64  # sketch coordinates per tile


# ----- helpers shared by both paths -----------------------------------------------------------
def make_sketch(n_layers: int, m: int, d: int, generator: torch.Generator, orthogonalize: bool = True) -> Tensor:
    """Sketch matrices [n_layers, m, d] float32 (QJL Definition 3.1, Sec. 4.1).

    Gaussian entries drawn from ``generator``; with ``orthogonalize`` each block of d rows is
    replaced by the orthonormal factor of its QR decomposition (sign-corrected so that it is Haar
    distributed) times sqrt(d), so rows keep the Gaussian's expected squared norm d.
    """
    n_blocks = -(-m // d)
    g = torch.randn(n_layers, n_blocks, d, d, generator=generator)
    if orthogonalize:
        q, r = torch.linalg.qr(g)
        g = (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).transpose(-1, -2) * math.sqrt(d)
    return g.reshape(n_layers, n_blocks * d, d)[:, :m].contiguous()


def outlier_channels(k: Tensor, group: int, n_out: int) -> Tensor:
    """QJL Sec. 4.1: the ``n_out`` channels of largest norm in each group of ``group`` tokens.

    k: [..., n, d]; a last partial group is padded with zeros. Returns uint8 [..., ceil(n / group), n_out].
    """
    *lead, n, d = k.shape
    kf = k.float()
    pad = (-n) % group
    if pad:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
    mag = kf.reshape(*lead, (n + pad) // group, group, d).norm(dim=-2)
    return mag.topk(n_out, dim=-1).indices.to(torch.uint8)


def outlier_mask(idx: Tensor, d: int, group: int, n: int | None = None) -> Tensor:
    """Channel mask per token from per-group outlier indices: [..., n_groups, n_out] -> bool [..., n, d].

    ``n`` defaults to n_groups x ``group`` (every group full).
    """
    mask = torch.zeros(*idx.shape[:-1], d, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, idx.long(), True)
    mask = mask.repeat_interleave(group, dim=-2)
    return mask if n is None else mask[..., :n, :]


def sketch_queries(q: Tensor, sketch: Tensor, n_kv_heads: int) -> Tensor:
    """S q for every query head, grouped per KV head: q [Hq, t, d] -> float32 [Hkv, g*t, m]."""
    return group_queries(q.float() @ sketch.T, n_kv_heads).contiguous()


_NEED_OUT_SKETCH = "outlier indices (out_idx) need the outlier sketch (out_sketch [m_out, d])"


def _estimate_coef(m: int) -> float:
    return math.sqrt(math.pi / 2) / m


# ----- torch references -----------------------------------------------------------------------
def qjl_quantize_torch(
    keys: Tensor, sketch: Tensor, out_sketch: Tensor | None = None, out_idx: Tensor | None = None, group: int = 32
) -> QJLKeys:
    """Reference of ``qjl_quantize``: keys [Hkv, n, d] -> QJLKeys."""
    k = keys.float()
    if out_idx is None:
        return QJLKeys(sketch, pack_signs(k @ sketch.T), k.norm(dim=-1).half(), group=group)
    if out_sketch is None:
        raise ValueError(_NEED_OUT_SKETCH)
    mask = outlier_mask(out_idx, k.shape[2], group, k.shape[1])
    inl, out = k.masked_fill(mask, 0.0), k.masked_fill(~mask, 0.0)
    return QJLKeys(
        sketch,
        pack_signs(inl @ sketch.T),
        inl.norm(dim=-1).half(),
        out_sketch,
        pack_signs(out @ out_sketch.T),
        out.norm(dim=-1).half(),
        out_idx,
        group,
    )


@functools.lru_cache(maxsize=64)
def _lut_offsets(hkv: int, nb: int, device: str) -> Tensor:
    """int32 [Hkv, 1, nb]: where each (KV head, byte slot)'s 256-row block starts in the lookup table."""
    return (torch.arange(hkv * nb, dtype=torch.int32) * 256).view(hkv, 1, nb).to(device)


def _estimate_torch(sq: Tensor, bits: Tensor, norms: Tensor, m: int) -> Tensor:
    """sqrt(pi/2)/m * norm * <S q, signs>: sq [Hkv, R, m], bits [Hkv, n, m/8], norms [Hkv, n] -> [Hkv, R, n].

    <S q, signs> is read straight from the packed bytes with a lookup table: for every byte slot b
    and every byte value, lut[b, value] = <sq[8b:8b+8], signs of value> ([Hkv * m/8 * 256, R]), and a
    key's score is the sum of one table row per byte (``embedding_bag`` over int32 row numbers),
    8x fewer operations than unpacking every bit. Sketch sizes that are not a multiple of 8 fall
    back to unpacking.
    """
    hkv, r, n = sq.shape[0], sq.shape[1], bits.shape[1]
    if m % 8 or n == 0:
        dots = torch.matmul(sq, unpack_signs(bits, m).transpose(-1, -2))
        return dots * (norms.float().unsqueeze(-2) * _estimate_coef(m))
    nb = m // 8
    table = sign_table(torch.float32, str(bits.device))  # [256, 8]
    lut = torch.matmul(sq.reshape(hkv, r, nb, 8) * _estimate_coef(m), table.T).permute(0, 2, 3, 1).reshape(-1, r)
    rows = (bits + _lut_offsets(hkv, nb, str(bits.device))).view(hkv * n, nb)  # [Hkv*n, nb] table rows
    dots = torch.nn.functional.embedding_bag(rows, lut, mode="sum").view(hkv, n, r)
    return (dots * norms.unsqueeze(-1)).transpose(1, 2)


def qjl_scores_torch(q: Tensor, keys: QJLKeys) -> Tensor:
    """Reference of ``qjl_scores``: estimates of <q_h, k_i>, q [Hq, t, d] -> float32 [Hq, t, n]."""
    hkv = keys.bits.shape[0]
    est = _estimate_torch(sketch_queries(q, keys.sketch, hkv), keys.bits, keys.norms, keys.m)
    outliers = keys.outliers
    if outliers is not None:
        out_sketch, out_bits, out_norms = outliers
        sqo = sketch_queries(q, out_sketch, hkv)
        est = est + _estimate_torch(sqo, out_bits, out_norms, out_sketch.shape[0])
    return ungroup(est, q.shape[0])


# ----- Triton kernels -------------------------------------------------------------------------
if _runtime.HAVE_TRITON:

    @triton.jit
    def sign_dot(
        sq_ptr,
        bits_ptr,
        rows,
        mask_n,
        offs_r,
        mask_r,
        M: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """<sq[r], sign[row]> for a tile: sq_ptr -> [R, M] f32 (one KV head), rows [BLOCK_N] -> [R_PAD, BLOCK_N]."""
        acc = tl.zeros((R_PAD, BLOCK_N), dtype=tl.float32)
        for j0 in range(0, M, BLOCK_M):
            j = j0 + tl.arange(0, BLOCK_M)
            mask_j = j < M
            sq = tl.load(sq_ptr + offs_r[:, None] * M + j[None, :], mask=mask_r[:, None] & mask_j[None, :], other=0.0)
            b = j0 // 8 + tl.arange(0, BLOCK_M // 8)  # each byte loaded once, then spread to 8 lanes
            byte = tl.load(
                bits_ptr + rows[:, None] * (M // 8) + b[None, :], mask=mask_n[:, None] & (b < M // 8)[None, :], other=0
            )
            bit = (byte.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
            bit = tl.reshape(bit, (BLOCK_N, BLOCK_M))
            sign = tl.where(mask_j[None, :], bit.to(tl.float32) * 2.0 - 1.0, 0.0)
            acc += tl.dot(sq, tl.trans(sign))
        return acc

    @triton.jit
    def _sketch_sign_store(
        x,
        s_ptr,
        bits_ptr,
        norms_ptr,
        offs_n,
        mask_n,
        offs_d,
        mask_d,
        D,
        M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Store sign(S x) packed LSB first and ||x|| (f16) for a tile x [BLOCK_N, D_PAD] of one KV head."""
        tl.store(norms_ptr + offs_n, tl.sqrt(tl.sum(x * x, axis=1)).to(tl.float16), mask=mask_n)
        weights = 1 << tl.arange(0, 8)
        for j0 in range(0, M, BLOCK_M):
            j = j0 + tl.arange(0, BLOCK_M)
            s = tl.load(s_ptr + j[:, None] * D + offs_d[None, :], mask=(j < M)[:, None] & mask_d[None, :], other=0.0)
            proj = tl.dot(x, tl.trans(s), input_precision="ieee")
            bit = (proj >= 0).to(tl.int32)
            packed = tl.sum(tl.reshape(bit, (BLOCK_N, BLOCK_M // 8, 8)) * weights[None, None, :], axis=2)
            b = j0 // 8 + tl.arange(0, BLOCK_M // 8)
            tl.store(
                bits_ptr + offs_n[:, None] * (M // 8) + b[None, :],
                packed.to(tl.uint8),
                mask=mask_n[:, None] & (b < M // 8)[None, :],
            )

    @triton.jit
    def _qjl_quantize_kernel(
        k_ptr, s_ptr, bits_ptr, norms_ptr, so_ptr, obits_ptr, onorms_ptr, oidx_ptr,
        n, n_groups, D,
        M: tl.constexpr, M_OUT: tl.constexpr, GROUP: tl.constexpr, N_OUT: tl.constexpr, HAS_OUT: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (Hkv, cdiv(n, BLOCK_N)): keys [Hkv, n, D] -> bits [Hkv, n, M/8], norms [Hkv, n] (+ outliers)."""
        h = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        mask_n, mask_d = offs_n < n, offs_d < D
        x = tl.load(
            k_ptr + (h * n + offs_n)[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
        )
        x = x.to(tl.float32)
        rows = h * n + offs_n
        if HAS_OUT:
            is_out = tl.zeros((BLOCK_N, D_PAD), dtype=tl.int1)
            base = oidx_ptr + (h * n_groups + offs_n // GROUP) * N_OUT
            for j in tl.static_range(N_OUT):
                ch = tl.load(base + j, mask=mask_n, other=0).to(tl.int32)
                is_out = is_out | (offs_d[None, :] == ch[:, None])
            _sketch_sign_store(
                tl.where(is_out, x, 0.0),
                so_ptr,
                obits_ptr,
                onorms_ptr,
                rows,
                mask_n,
                offs_d,
                mask_d,
                D,
                M_OUT,
                BLOCK_N,
                BLOCK_M,
            )
            x = tl.where(is_out, 0.0, x)
        _sketch_sign_store(x, s_ptr, bits_ptr, norms_ptr, rows, mask_n, offs_d, mask_d, D, M, BLOCK_N, BLOCK_M)

    @triton.jit
    def _qjl_scores_kernel(
        sq_ptr, bits_ptr, norms_ptr, sqo_ptr, obits_ptr, onorms_ptr, out_ptr,
        n, R, coef, coef_out, n_groups,
        M: tl.constexpr, M_OUT: tl.constexpr, HAS_OUT: tl.constexpr, SPLIT: tl.constexpr,
        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (Hkv, cdiv(n, BLOCK_N)): sq [Hkv, R, M] + packed keys -> estimates out [Hkv, R, n].

        With SPLIT, sq is [Hkv, n_groups, R, M] (the queries restricted to each token group's
        channels, then sketched) and BLOCK_N is the group size: tile j reads group j's queries.
        """
        h = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R_PAD)
        mask_n, mask_r = offs_n < n, offs_r < R
        rows = h * n + offs_n
        norm = tl.load(norms_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
        if SPLIT:
            sq_base = sq_ptr + (h * n_groups + tl.program_id(1)) * R * M
        else:
            sq_base = sq_ptr + h * R * M
        est = (
            sign_dot(sq_base, bits_ptr, rows, mask_n, offs_r, mask_r, M, R_PAD, BLOCK_N, BLOCK_M)
            * (norm * coef)[None, :]
        )
        if HAS_OUT:
            onorm = tl.load(onorms_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
            oest = sign_dot(
                sqo_ptr + h * R * M_OUT, obits_ptr, rows, mask_n, offs_r, mask_r, M_OUT, R_PAD, BLOCK_N, BLOCK_M
            )
            est += oest * (onorm * coef_out)[None, :]
        tl.store(out_ptr + (h * R + offs_r)[:, None] * n + offs_n[None, :], est, mask=mask_r[:, None] & mask_n[None, :])


def _check_dims(d: int, m: int) -> None:
    if d % 16:
        raise ValueError(f"head_dim {d} must be a multiple of 16 for the Triton kernels")
    if m % 8:
        raise ValueError(f"sketch size {m} must be a multiple of 8")


def _qjl_quantize_triton(
    keys: Tensor, sketch: Tensor, out_sketch: Tensor | None, out_idx: Tensor | None, group: int
) -> QJLKeys:
    hkv, n, d = keys.shape
    m = sketch.shape[0]
    _check_dims(d, m)
    has_out = out_idx is not None
    if out_idx is None:  # the kernel's outlier arguments are placeholders it never reads
        so, m_out, n_groups, n_out = sketch, 8, 1, 1
    elif out_sketch is None:
        raise ValueError(_NEED_OUT_SKETCH)
    else:
        so, m_out = out_sketch.float().contiguous(), out_sketch.shape[0]
        n_groups, n_out = out_idx.shape[1], out_idx.shape[2]
    dev = keys.device
    bits = torch.empty(hkv, n, m // 8, dtype=torch.uint8, device=dev)
    norms = torch.empty(hkv, n, dtype=torch.float16, device=dev)
    obits = torch.empty(hkv, n, m_out // 8, dtype=torch.uint8, device=dev) if has_out else bits
    onorms = torch.empty(hkv, n, dtype=torch.float16, device=dev) if has_out else norms
    if n:
        grid = (hkv, triton.cdiv(n, BLOCK_N))
        _qjl_quantize_kernel[grid](
            keys.contiguous(), sketch.float().contiguous(), bits, norms,
            so, obits, onorms,
            out_idx.contiguous() if out_idx is not None else bits,
            n, n_groups, d,
            M=m, M_OUT=m_out, GROUP=group, N_OUT=n_out, HAS_OUT=has_out,
            D_PAD=_runtime.next_pow2(d), BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
        )  # fmt: skip
    if not has_out:
        return QJLKeys(sketch, bits, norms, group=group)
    return QJLKeys(sketch, bits, norms, out_sketch, obits, onorms, out_idx, group)


def _qjl_scores_triton(q: Tensor, keys: QJLKeys) -> Tensor:
    hkv, n, _ = keys.bits.shape
    _check_dims(q.shape[-1], keys.m)
    sq = sketch_queries(q, keys.sketch, hkv)
    r = sq.shape[1]
    out = torch.empty(hkv, r, n, dtype=torch.float32, device=q.device)
    outliers = keys.outliers
    has_out = outliers is not None
    if outliers is not None:
        out_sketch, out_bits, out_norms = outliers
        m_out, sqo = out_sketch.shape[0], sketch_queries(q, out_sketch, hkv)
        obits, onorms = out_bits.contiguous(), out_norms.contiguous()
    else:  # placeholders the kernel never reads
        m_out, sqo, obits, onorms = 8, sq, keys.bits, keys.norms
    if n:
        grid = (hkv, triton.cdiv(n, BLOCK_N))
        _qjl_scores_kernel[grid](
            sq, keys.bits.contiguous(), keys.norms.contiguous(),
            sqo, obits, onorms, out,
            n, r, _estimate_coef(keys.m), _estimate_coef(m_out), 1,
            M=keys.m, M_OUT=m_out, HAS_OUT=has_out, SPLIT=False,
            R_PAD=_runtime.next_pow2(r), BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
        )  # fmt: skip
    return ungroup(out, q.shape[0])


def _qjl_scores_split_triton(sqg: Tensor, bits: Tensor, norms: Tensor, group: int) -> Tensor:
    """Split estimates from per-group sketched queries sqg [Hkv, n_groups, R, m]: one tile per token group."""
    hkv, ng, r, m = sqg.shape
    n = bits.shape[1]
    _check_dims(16, m)
    out = torch.empty(hkv, r, n, dtype=torch.float32, device=sqg.device)
    if n:
        _qjl_scores_kernel[(hkv, ng)](
            sqg.contiguous(), bits.contiguous(), norms.contiguous(), sqg, bits, norms, out,
            n, r, _estimate_coef(m), _estimate_coef(m), ng,
            M=m, M_OUT=8, HAS_OUT=False, SPLIT=True,
            R_PAD=_runtime.next_pow2(r), BLOCK_N=group, BLOCK_M=BLOCK_M,
        )  # fmt: skip
    return out


# ----- dispatch -------------------------------------------------------------------------------
def qjl_quantize(
    keys: Tensor, sketch: Tensor, out_sketch: Tensor | None = None, out_idx: Tensor | None = None, group: int = 32
) -> QJLKeys:
    """Quantize keys [Hkv, n, d] (post-RoPE) to the QJL format; outliers when ``out_idx`` is given."""
    if _runtime.use_triton(keys.device):
        _runtime.check_device(keys.device)
        return _qjl_quantize_triton(keys, sketch, out_sketch, out_idx, group)
    return qjl_quantize_torch(keys, sketch, out_sketch, out_idx, group)


def qjl_scores(q: Tensor, keys: QJLKeys) -> Tensor:
    """Estimated <q_h, k_i> for every query head: q [Hq, t, d] -> float32 [Hq, t, n] (unscaled)."""
    if _runtime.use_triton(q.device):
        _runtime.check_device(q.device)
        return _qjl_scores_triton(q, keys)
    return qjl_scores_torch(q, keys)


def qjl_estimate(q: Tensor, sketch: Tensor, bits: Tensor, norms: Tensor) -> Tensor:
    """``qjl_scores`` for one sketch passed as tensors: q [Hq, t, d], S [m, d], bits [Hkv, n, m/8],
    norms [Hkv, n] -> float32 [Hq, t, n] (the signature of kvlab.methods.qjl.estimate_scores)."""
    return qjl_scores(q, QJLKeys(sketch, bits, norms))


def split_sketch_queries(qg: Tensor, sketch: Tensor, out_idx: Tensor, outliers: bool) -> Tensor:
    """S (q restricted to each token group's inlier or outlier channels): qg [Hkv, R, d],
    out_idx uint8 [Hkv, n_groups, n_out] -> float32 [Hkv, n_groups, R, m]."""
    mask = torch.zeros(*out_idx.shape[:-1], qg.shape[-1], dtype=torch.bool, device=qg.device)
    mask.scatter_(-1, out_idx.long(), True)
    keep = mask if outliers else ~mask
    return torch.matmul(qg.float().unsqueeze(1) * keep.unsqueeze(-2), sketch.float().T).contiguous()


def split_query_parts(qg: Tensor, sketch: Tensor, out_sketch: Tensor, out_idx: Tensor) -> tuple[Tensor, Tensor]:
    """``split_sketch_queries`` of both sketches at once: qg [Hkv, R, d], S [m, d], S_out [m_out, d], out_idx
    uint8 [Hkv, n_groups, n_out] -> (S q_in float32 [Hkv, n_groups, R, m], S_out q_out [Hkv, n_groups, R, m_out]).

    Only each group's n_out outlier channels O enter a product: with C = [S; S_out] restricted to the
    columns O, S_out q_out = C[m:] q_O and S q_in = S q - C[:m] q_O (an n_out-wide product per group
    instead of a d-wide one; equal to the masked projection up to float rounding).
    """
    hkv, r, d = qg.shape
    ng, n_out = out_idx.shape[1], out_idx.shape[2]
    m, q, idx = sketch.shape[0], qg.float(), out_idx.long()
    both = torch.cat([sketch, out_sketch]).float().T.contiguous()  # [d, m + m_out]
    cols = both.index_select(0, idx.view(-1)).view(hkv, ng, n_out, -1)  # the outlier columns of each group
    q_out = torch.gather(q, 2, idx.view(hkv, 1, ng * n_out).expand(hkv, r, ng * n_out))  # [Hkv, R, ng * n_out]
    parts = torch.matmul(q_out.view(hkv, r, ng, n_out).transpose(1, 2), cols)  # [Hkv, ng, R, m + m_out]
    return torch.matmul(q, sketch.float().T).unsqueeze(1) - parts[..., :m], parts[..., m:]


def _split_dots(sqg: Tensor, bits: Tensor, norms: Tensor, group: int, products: torch.dtype = torch.float32) -> Tensor:
    """sqrt(pi/2)/m * ||k_i|| * <sq_j, sign_i> per token group j: sqg [Hkv, n_groups, R, m], bits [Hkv, n, m/8],
    norms [Hkv, n] -> float32 [Hkv, n_groups, R, group] (tokens still per group).

    ``products``: the dtype of the signs and sketched queries in the product. ±1 is exact in any dtype;
    bfloat16 rounds S q to 8 significant bits (relative error <= 2^-9, far below the estimator's own
    ~1/sqrt(m)) and halves the bytes the unpacked signs take, the step's main cost on the CPU.
    """
    hkv, ng, r, m = sqg.shape
    signs = unpack_signs(bits, m, dtype=products).reshape(hkv, ng, group, m)
    dots = torch.matmul(sqg.to(products), signs.transpose(-1, -2)).float()
    return dots * (norms.float().view(hkv, ng, 1, group) * _estimate_coef(m))


def _tokens_last(est: Tensor) -> Tensor:
    """[Hkv, n_groups, R, group] -> [Hkv, R, n_groups * group]."""
    hkv, ng, r, group = est.shape
    return est.permute(0, 2, 1, 3).reshape(hkv, r, ng * group)


def _estimate_split_torch(sqg: Tensor, bits: Tensor, norms: Tensor, group: int) -> Tensor:
    """Reference of the split estimate: sqg [Hkv, n_groups, R, m], bits [Hkv, n, m/8] -> [Hkv, R, n]."""
    return _tokens_last(_split_dots(sqg, bits, norms, group))


def _split_on_triton(device: torch.device, group: int) -> bool:
    """The split kernel takes one tile per token group: a power of two >= 16 tokens."""
    if _runtime.use_triton(device) and group >= 16 and group & (group - 1) == 0:
        _runtime.check_device(device)
        return True
    return False


def qjl_estimate_split_grouped(
    qg: Tensor, sketch: Tensor, bits: Tensor, norms: Tensor, out_idx: Tensor, group: int, outliers: bool
) -> Tensor:
    """The ``split_query`` estimate of one sketch: the query restricted to the channels that sketch
    encoded in each token group (the inliers for S, the outliers for S_out), as the authors' score
    kernel does. <q, k_part> = <q_part, k_part>, so the estimate stays unbiased while its variance
    drops from ~||q||^2 ||k_part||^2 to ~||q_part||^2 ||k_part||^2.

    qg [Hkv, R, d] (grouped queries), S [m, d], bits [Hkv, n, m/8], norms [Hkv, n], out_idx uint8
    [Hkv, n / group, n_out] (n a multiple of ``group``). Returns float32 [Hkv, R, n]. Triton on CUDA
    when ``group`` is a power of two >= 16 (one tile per token group), the torch reference elsewhere.
    """
    sqg = split_sketch_queries(qg, sketch, out_idx, outliers)
    if _split_on_triton(qg.device, group):
        return _qjl_scores_split_triton(sqg, bits, norms, group)
    return _estimate_split_torch(sqg, bits, norms, group)


def qjl_estimate_split_pair(
    qg: Tensor,
    sketch: Tensor,
    bits: Tensor,
    norms: Tensor,
    out_sketch: Tensor,
    out_bits: Tensor,
    out_norms: Tensor,
    out_idx: Tensor,
    group: int,
    products: torch.dtype = torch.float32,
) -> Tensor:
    """The score QJL attends with under ``split_query``: the inlier estimate (S) plus the outlier estimate
    (S_out), i.e. ``qjl_estimate_split_grouped`` over both sketches, summed. Shapes as there (out_bits
    [Hkv, n, m_out/8], out_norms [Hkv, n]); returns float32 [Hkv, R, n].

    Triton as ``qjl_estimate_split_grouped``; on the CPU the compiled fused loop once warmed up
    (``kernels.compiled``), else the torch path, which projects both parts' queries at once
    (``split_query_parts``) and sums the parts before the one reordering to [Hkv, R, n]. ``products``: the
    torch path's product dtype (``_split_dots``); the Triton and compiled paths compute in float32.
    """
    if _split_on_triton(qg.device, group):
        est = qjl_estimate_split_grouped(qg, sketch, bits, norms, out_idx, group, False)
        return est + qjl_estimate_split_grouped(qg, out_sketch, out_bits, out_norms, out_idx, group, True)
    if compiled.SPLIT_PAIR.ready:  # the fused C++ loop once the background warm-up compiled it
        return compiled.SPLIT_PAIR(qg, sketch, bits, norms, out_sketch, out_bits, out_norms, out_idx)
    sq_in, sq_out = split_query_parts(qg, sketch, out_sketch, out_idx)
    est = _split_dots(sq_in, bits, norms, group, products)
    est.add_(_split_dots(sq_out, out_bits, out_norms, group, products))
    return _tokens_last(est)


def qjl_estimate_grouped(qg: Tensor, sketch: Tensor, bits: Tensor, norms: Tensor) -> Tensor:
    """``qjl_estimate`` with the queries already grouped per KV head (kernels.tensor_ops.group_queries):
    qg [Hkv, R, d] -> float32 [Hkv, R, n]. Saves the regrouping on the per-step decode path."""
    hkv, r, d = qg.shape
    if _runtime.use_triton(qg.device):
        return group_queries(qjl_estimate(qg.reshape(hkv * r, 1, d), sketch, bits, norms), hkv)
    return _estimate_torch(torch.matmul(qg.float(), sketch.T), bits, norms, sketch.shape[0])
