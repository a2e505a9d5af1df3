"""TurboQuant decode: logits of TurboQuant-prod keys and the weighted sum of TurboQuant-mse values, straight
from the codes. Triton kernels and their torch references.

Zandieh, Daliri, Hadian, Mirrokni. "TurboQuant: Online Vector Quantization with Near-optimal Distortion
Rate", arXiv:2504.19874 (ICLR 2026). Algorithm 1 (mse: a rotation Pi, then a Lloyd-Max centroid index
per coordinate of Pi u, u = x / ||x||) and Algorithm 2 (prod: b-1 bits of mse, then 1-bit QJL of the
residual r = u - Pi^T c[idx]: sign(S r) and ||r||).

One instance of the method's codes (``kernels.formats.TurboQuantCodes``: one channel set of one layer,
Hkv KV heads, n tokens, m channels). Queries come grouped per KV head (``kernels.tensor_ops.group_queries``):
R = g x t rows per KV head, already restricted to the instance's channels.

* ``turboquant_logits(qg, codes)``: the estimate of <q, k_i> the method attends with (Theorem 2's unbiased
  estimate for prod keys), ||k_i|| (<Pi q, c[idx_i]> + sqrt(pi/2)/m ||r_i|| <S q, sign(S r_i)>); with no
  mse part (1-bit prod keys) the QJL term of the unit key alone (||r|| = 1), with no sign bits (mse keys)
  the first term alone. Pi q and S q are computed once per query; per token the kernel reads only the
  packed codes, the sign bits and the two float16 norms. float32 [Hkv, R, n].
* ``turboquant_values(p, codes)``: sum_i p_i ||v_i|| Pi^T c[idx_i] = (sum_i p_i ||v_i|| c[idx_i]) Pi: the
  weighted sum of codebook entries in the rotated basis, then the inverse rotation applied once to that
  sum (not per token). float32 [Hkv, R, m].

The outlier channels of the method's Sec. 4.3 split are a second instance: its logits are added, its
values concatenated (the method does both). The kernels take any m (padded to a power of two and
masked), any R, and code bits 1-4 (3-bit codes 8 in 3 bytes, ``kernels.quant.pack_codes``).

The Hadamard path (vLLM's TurboQuant presets, kvlab/methods/vllm_turboquant.py): with ``codes.hadamard``, Pi
is the orthonormal Walsh-Hadamard matrix H (``kernels.hadamard``). The logits kernel then takes q itself and
makes H q inside, tile by tile, from H's entries (-1)^popcount(i & j) / sqrt(m) computed from their indices
(no rotation matrix is read); the reference uses the fast transform (``kernels.hadamard.fwht``). With
``codes.norm_correction`` (vLLM's "_nc" presets) the key's centroid vector c[idx] is taken at unit norm:
the kernel sums c[idx]^2 over the channel tiles it already reads and divides the mse term by its root.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels import _runtime
from kernels.formats import TurboQuantCodes
from kernels.hadamard import fwht
from kernels.qjl import _estimate_torch
from kernels.quant import packed_bytes, unpack_codes

if _runtime.HAVE_TRITON:
    import triton
    import triton.language as tl

BLOCK_N = 64  # tokens per tile
BLOCK_M = 64  # channels per tile (fewer when m is smaller: the next power of two >= 16)


def _coef(m: int) -> float:
    return math.sqrt(math.pi / 2) / m


# ----- torch references -----------------------------------------------------------------------
def centroid_rows(codes: TurboQuantCodes) -> Tensor:
    """c[idx] float32 [Hkv, n, m]: the rotated unit vectors' reconstruction (Algorithm 1, line 9)."""
    assert codes.codes is not None, "no mse codes (bits 0)"
    idx = unpack_codes(codes.codes, codes.bits, codes.m)
    return codes.centroids[idx.long()]


def rotated_queries(qg: Tensor, codes: TurboQuantCodes) -> Tensor:
    """(Pi q) as rows, float32 [Hkv, R, m]: the fast Walsh-Hadamard transform for a Hadamard Pi, else a matmul."""
    if codes.hadamard:
        return fwht(qg)
    return torch.matmul(qg.float(), codes.rotation.float().T)


def unit_rows(c: Tensor) -> Tensor:
    """Rows of c [..., m] rescaled to unit norm (vLLM's norm correction: c / sqrt(sum c^2 + 1e-16))."""
    return c * torch.rsqrt(c.pow(2).sum(-1, keepdim=True) + 1e-16)


def turboquant_logits_torch(qg: Tensor, codes: TurboQuantCodes) -> Tensor:
    """Reference of ``turboquant_logits``: qg [Hkv, R, m] -> float32 [Hkv, R, n]."""
    norms = codes.norms.float()
    out = None
    if codes.bits:
        qr = rotated_queries(qg, codes)
        rows = unit_rows(centroid_rows(codes)) if codes.norm_correction else centroid_rows(codes)
        out = torch.matmul(qr, rows.transpose(-1, -2)) * norms.unsqueeze(-2)
    if codes.sketch is not None and codes.signs is not None:
        rn = codes.residual_norms
        gamma = rn.float() * norms if codes.bits and rn is not None else norms
        est = _estimate_torch(torch.matmul(qg.float(), codes.sketch.T), codes.signs, gamma, codes.sketch.shape[0])
        out = est if out is None else out + est
    assert out is not None  # TurboQuantCodes holds codes, signs or both
    return out


def _check_values(codes: TurboQuantCodes) -> None:
    if codes.norm_correction:
        raise ValueError("turboquant_values reads plain mse codes (no norm correction)")


def turboquant_values_torch(p: Tensor, codes: TurboQuantCodes) -> Tensor:
    """Reference of ``turboquant_values``: p [Hkv, R, n] -> float32 [Hkv, R, m]."""
    _check_values(codes)
    pw = p * codes.norms.float().unsqueeze(-2)
    return torch.matmul(torch.matmul(pw, centroid_rows(codes)), codes.rotation)


# ----- Triton kernels -------------------------------------------------------------------------
if _runtime.HAVE_TRITON:

    @triton.jit
    def _codes_tile(
        c_ptr, rows, mask_n, j0, offs_j, mask_j,
        ROW_BYTES: tl.constexpr, B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """The B-bit codes of channels j0 + [0, BLOCK_M) of token ``rows`` (kernels.quant.pack_codes: one
        little-endian bit stream per row, LSB first) -> int32 [BLOCK_N, BLOCK_M] (0 where masked).

        j0 is a multiple of BLOCK_M >= 16, so a tile starts on a byte boundary for every B."""
        per: tl.constexpr = 8 // B
        if 8 % B == 0:  # whole codes per byte: load each byte once, spread it over its 8 / B channels
            b = j0 * B // 8 + tl.arange(0, BLOCK_M // per)
            byte = tl.load(
                c_ptr + rows[:, None] * ROW_BYTES + b[None, :],
                mask=mask_n[:, None] & (b < ROW_BYTES)[None, :],
                other=0,
            )
            code = (byte.to(tl.int32)[:, :, None] >> (tl.arange(0, per) * B)[None, None, :]) & ((1 << B) - 1)
            code = tl.reshape(code, (BLOCK_N, BLOCK_M))
        else:  # 3-bit codes: bits [j B, (j + 1) B) of the row, which may span two bytes
            bit = offs_j * B
            at = rows[:, None] * ROW_BYTES + (bit // 8)[None, :]
            mask = mask_n[:, None] & mask_j[None, :]
            lo = tl.load(c_ptr + at, mask=mask, other=0).to(tl.int32)
            spans = mask & ((bit % 8 + B > 8) & (bit // 8 + 1 < ROW_BYTES))[None, :]
            hi = tl.load(c_ptr + at + 1, mask=spans, other=0).to(tl.int32)
            code = ((lo | (hi << 8)) >> (bit % 8)[None, :]) & ((1 << B) - 1)
        return code

    @triton.jit
    def _hadamard_tile(q_ptr, q_rows, mask_r, offs_j, M: tl.constexpr, LOG2_M: tl.constexpr,
                       R_PAD: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
        """Channels ``offs_j`` of (H q) for the rows ``q_rows`` of q [*, M] (M a power of two): H's entries are
        made from their indices, (-1)^popcount(i & j) / sqrt(M), never loaded -> float32 [R_PAD, BLOCK_M]."""
        acc = tl.zeros((R_PAD, BLOCK_M), dtype=tl.float32)
        for i0 in tl.static_range(0, M, BLOCK_M):
            offs_i = i0 + tl.arange(0, BLOCK_M)
            q = tl.load(q_ptr + q_rows + offs_i[None, :], mask=mask_r[:, None] & (offs_i < M)[None, :], other=0.0)
            both = offs_i[:, None] & offs_j[None, :]
            parity = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.int32)
            for b in tl.static_range(LOG2_M):
                parity = parity ^ ((both >> b) & 1)
            h = (1 - 2 * parity).to(tl.float32)
            acc += tl.dot(q, h, input_precision="ieee")
        return acc / tl.sqrt(M * 1.0)

    @triton.jit
    def _tq_logits_kernel(
        qr_ptr, sq_ptr, codes_ptr, cent_ptr, norms_ptr, rn_ptr, signs_ptr, out_ptr,
        n, R, coef,
        M: tl.constexpr, B: tl.constexpr, CODE_BYTES: tl.constexpr, SIGN_BYTES: tl.constexpr,
        HAS_MSE: tl.constexpr, PROD: tl.constexpr, HADAMARD: tl.constexpr, LOG2_M: tl.constexpr,
        NORM_CORRECTION: tl.constexpr,
        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (Hkv, cdiv(n, BLOCK_N)): Pi q, S q [Hkv, R, M] + one instance's codes -> logits out [Hkv, R, n].

        logit = ||k|| (<Pi q, c[idx]> + coef ||r|| <S q, sign>) (HAS_MSE and PROD), ||k|| <Pi q, c[idx]>
        (HAS_MSE only), ||k|| coef <S q, sign> (PROD only). With HADAMARD, ``qr_ptr`` holds q itself and Pi q
        is made here (Pi the Walsh-Hadamard matrix, ``_hadamard_tile``); with NORM_CORRECTION the mse term
        is divided by ||c[idx]|| (c[idx] taken as a unit vector)."""
        h = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R_PAD)
        mask_n, mask_r = offs_n < n, offs_r < R
        rows = (h * n + offs_n).to(tl.int64)
        norm = tl.load(norms_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
        mse = tl.zeros((R_PAD, BLOCK_N), dtype=tl.float32)
        qjl = tl.zeros((R_PAD, BLOCK_N), dtype=tl.float32)
        csq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        q_rows = (h * R + offs_r)[:, None] * M
        for j0 in tl.static_range(0, M, BLOCK_M):
            offs_j = j0 + tl.arange(0, BLOCK_M)
            mask_j = offs_j < M
            mask_q = mask_r[:, None] & mask_j[None, :]
            if HAS_MSE:
                if HADAMARD:
                    qr = _hadamard_tile(qr_ptr, q_rows, mask_r, offs_j, M, LOG2_M, R_PAD, BLOCK_M)
                else:
                    qr = tl.load(qr_ptr + q_rows + offs_j[None, :], mask=mask_q, other=0.0)
                code = _codes_tile(codes_ptr, rows, mask_n, j0, offs_j, mask_j, CODE_BYTES, B, BLOCK_N, BLOCK_M)
                kc = tl.load(cent_ptr + code, mask=mask_n[:, None] & mask_j[None, :], other=0.0)
                mse += tl.dot(qr, tl.trans(kc), input_precision="ieee")
                if NORM_CORRECTION:
                    csq += tl.sum(kc * kc, axis=1)
            if PROD:
                sq = tl.load(sq_ptr + q_rows + offs_j[None, :], mask=mask_q, other=0.0)
                bit = _codes_tile(signs_ptr, rows, mask_n, j0, offs_j, mask_j, SIGN_BYTES, 1, BLOCK_N, BLOCK_M)
                sign = tl.where(mask_j[None, :], bit.to(tl.float32) * 2.0 - 1.0, 0.0)
                qjl += tl.dot(sq, tl.trans(sign), input_precision="ieee")
        if NORM_CORRECTION:
            mse = mse / tl.sqrt(csq + 1e-16)[None, :]
        if PROD:
            if HAS_MSE:
                gamma = tl.load(rn_ptr + rows, mask=mask_n, other=0.0).to(tl.float32) * coef
                mse += qjl * gamma[None, :]
            else:
                mse += qjl * coef
        out = mse * norm[None, :]
        tl.store(out_ptr + (h * R + offs_r)[:, None] * n + offs_n[None, :], out, mask=mask_r[:, None] & mask_n[None, :])

    @triton.jit
    def _tq_values_kernel(
        p_ptr, codes_ptr, cent_ptr, norms_ptr, acc_ptr,
        n, R, chunk, n_splits,
        M: tl.constexpr, B: tl.constexpr, CODE_BYTES: tl.constexpr,
        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (Hkv, n_splits, cdiv(M, BLOCK_M)): p [Hkv, R, n] + one instance's codes -> partial sums
        acc [Hkv, n_splits, R, M] of p_i ||v_i|| c[idx_i] (the rotated basis) over tokens
        [s chunk, min(n, (s + 1) chunk)), for channels j0 + [0, BLOCK_M)."""
        h = tl.program_id(0)
        s = tl.program_id(1)
        j0 = tl.program_id(2) * BLOCK_M
        offs_r = tl.arange(0, R_PAD)
        offs_j = j0 + tl.arange(0, BLOCK_M)
        mask_r, mask_j = offs_r < R, offs_j < M
        acc = tl.zeros((R_PAD, BLOCK_M), dtype=tl.float32)
        start = s * chunk
        end = tl.minimum(start + chunk, n)
        for t0 in range(start, end, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            rows = (h * n + offs_n).to(tl.int64)
            norm = tl.load(norms_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
            p = tl.load(
                p_ptr + (h * R + offs_r)[:, None] * n + offs_n[None, :],
                mask=mask_r[:, None] & mask_n[None, :],
                other=0.0,
            )
            code = _codes_tile(codes_ptr, rows, mask_n, j0, offs_j, mask_j, CODE_BYTES, B, BLOCK_N, BLOCK_M)
            vc = tl.load(cent_ptr + code, mask=mask_n[:, None] & mask_j[None, :], other=0.0)
            acc += tl.dot(p.to(tl.float32) * norm[None, :], vc, input_precision="ieee")
        out = (h * n_splits + s) * R + offs_r
        tl.store(acc_ptr + out[:, None] * M + offs_j[None, :], acc, mask=mask_r[:, None] & mask_j[None, :])


def _block_m(m: int) -> int:
    return min(BLOCK_M, _runtime.next_pow2(m))


def _n_splits(n: int, hkv: int, device: torch.device, splits: int | None) -> int:
    """Programs sharing a head's tokens in ``turboquant_values``: enough to fill the GPU, one tile each at most."""
    tiles = max(1, -(-n // BLOCK_N))
    if splits is None:
        if device.type == "cuda":
            splits = max(1, 4 * torch.cuda.get_device_properties(device).multi_processor_count // hkv)
        else:
            splits = 4
    return max(1, min(splits, tiles))


def turboquant_logits_triton(qg: Tensor, codes: TurboQuantCodes) -> Tensor:
    """The kernel path of ``turboquant_logits``: qg [Hkv, R, m] -> float32 [Hkv, R, n]."""
    hkv, r, m = qg.shape
    n, dev = codes.n, qg.device
    if m != codes.m:
        raise ValueError(f"queries have {m} channels, the codes {codes.m}")
    q = qg.float()
    out = torch.empty(hkv, r, n, dtype=torch.float32, device=dev)
    if not n:
        return out
    has_mse, prod = codes.bits > 0, codes.prod
    if codes.hadamard or not has_mse:  # a Hadamard Pi q is made inside the kernel
        qr = q.contiguous()
    else:
        qr = torch.matmul(q, codes.rotation.float().T).contiguous()
    sq = torch.matmul(q, codes.sketch.float().T).contiguous() if codes.sketch is not None else qr
    norms = codes.norms.contiguous()
    packed = codes.codes.contiguous() if codes.codes is not None else norms  # placeholders the kernel never reads
    signs = codes.signs.contiguous() if codes.signs is not None else norms
    rn = codes.residual_norms.contiguous() if codes.residual_norms is not None else norms
    _tq_logits_kernel[(hkv, triton.cdiv(n, BLOCK_N))](
        qr, sq, packed, codes.centroids.float().contiguous(), norms, rn, signs, out,
        n, r, _coef(m),
        M=m, B=max(codes.bits, 1), CODE_BYTES=packed_bytes(m, codes.bits) if has_mse else 1,
        SIGN_BYTES=packed_bytes(m, 1), HAS_MSE=has_mse, PROD=prod,
        HADAMARD=codes.hadamard, LOG2_M=max(1, (m - 1).bit_length()), NORM_CORRECTION=codes.norm_correction,
        R_PAD=_runtime.next_pow2(r), BLOCK_N=BLOCK_N, BLOCK_M=_block_m(m),
    )  # fmt: skip
    return out


def turboquant_values_triton(p: Tensor, codes: TurboQuantCodes, splits: int | None = None) -> Tensor:
    """The kernel path of ``turboquant_values``: p [Hkv, R, n] -> float32 [Hkv, R, m].

    The kernel writes per-split partial sums in the rotated basis; they are summed, then rotated back once."""
    _check_values(codes)
    hkv, r, n = p.shape
    m, dev = codes.m, p.device
    if codes.codes is None:
        raise ValueError("turboquant_values needs mse codes (bits >= 1)")
    if not n:
        return torch.zeros(hkv, r, m, dtype=torch.float32, device=dev)
    s = _n_splits(n, hkv, dev, splits)
    tiles = -(-n // BLOCK_N)
    chunk = -(-tiles // s) * BLOCK_N  # whole tiles per split
    s = -(-n // chunk)
    acc = torch.empty(hkv, s, r, m, dtype=torch.float32, device=dev)
    bm = _block_m(m)
    _tq_values_kernel[(hkv, s, triton.cdiv(m, bm))](
        p.float().contiguous(), codes.codes.contiguous(), codes.centroids.float().contiguous(),
        codes.norms.contiguous(), acc,
        n, r, chunk, s,
        M=m, B=codes.bits, CODE_BYTES=packed_bytes(m, codes.bits),
        R_PAD=_runtime.next_pow2(r), BLOCK_N=BLOCK_N, BLOCK_M=bm,
    )  # fmt: skip
    return torch.matmul(acc.sum(1), codes.rotation.float())


# ----- dispatch -------------------------------------------------------------------------------
def turboquant_logits(qg: Tensor, codes: TurboQuantCodes) -> Tensor:
    """Logits (the method's estimate of <q, k>) of grouped queries qg [Hkv, R, m] against one instance's
    keys -> float32 [Hkv, R, n]; Triton or torch (see kernels._runtime)."""
    if _runtime.use_triton(qg.device):
        _runtime.check_device(qg.device)
        return turboquant_logits_triton(qg, codes)
    return turboquant_logits_torch(qg, codes)


def turboquant_values(p: Tensor, codes: TurboQuantCodes) -> Tensor:
    """sum_i p_i v_hat_i of one instance's mse values for weights p [Hkv, R, n] -> float32 [Hkv, R, m];
    Triton or torch (see kernels._runtime)."""
    if _runtime.use_triton(p.device):
        _runtime.check_device(p.device)
        return turboquant_values_triton(p, codes)
    return turboquant_values_torch(p, codes)


__all__ = [
    "centroid_rows",
    "turboquant_logits",
    "turboquant_logits_torch",
    "turboquant_logits_triton",
    "turboquant_values",
    "turboquant_values_torch",
    "turboquant_values_triton",
]
