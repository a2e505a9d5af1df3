"""Quantized storage formats and their torch reference maths: bit packing and group quantization.

The layouts the Triton kernels read, used by QJL (sign bits of the sketched keys, 2-bit values)
and KIVI (per-channel keys, per-token values); ``kvlab.quant`` re-exports them:

* ``pack_signs``: signs packed 8 per byte along the last dim, LSB first — byte ``b`` holds the
  sign of element ``8b + j`` in bit ``j``; bit 1 means the element is ``>= 0``.
* ``pack_codes``: b-bit integer codes packed ``8 // b`` per byte along the last dim, LSB first —
  code ``k * (8 // b) + j`` of a row sits in bits ``[j*b, (j+1)*b)`` of byte ``k``. b in
  {1, 2, 4, 8}; 3-bit codes are stored one per nibble (as if b = 4, so they cost 4 bits each —
  the byte counts say so).
* ``quantize_groups``: asymmetric (min/scale) quantization in groups of ``group`` consecutive
  elements along any dim, with one float16 scale and one float16 minimum per group.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def storage_bits(bits: int) -> int:
    """Bits one code really occupies once packed (3-bit codes take a nibble)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} not supported; allowed: {', '.join(map(str, SUPPORTED_BITS))}")
    return 4 if bits == 3 else bits


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in [0, 2^bits) along the last dim: [..., n] -> uint8 [..., ceil(n / (8 // sb))].

    sb = ``storage_bits(bits)``; the last byte is zero-padded when n is not a multiple of 8 // sb.
    """
    sb = storage_bits(bits)
    per = 8 // sb
    c = _pad_last(codes.to(torch.uint8), per)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    shifts = torch.arange(0, 8, sb, dtype=torch.uint8, device=c.device)
    return (c << shifts).sum(-1, dtype=torch.uint8) if per > 1 else c.squeeze(-1)


@functools.cache
def code_table(bits: int, device: str) -> Tensor:
    """uint8 [256, 8 // sb]: the codes held by every byte value (a lookup is faster than shifting)."""
    sb = storage_bits(bits)
    shifts = torch.arange(0, 8, sb, dtype=torch.int64)
    return ((torch.arange(256).unsqueeze(-1) >> shifts) & ((1 << sb) - 1)).to(torch.uint8).to(device)


@functools.cache
def sign_table(dtype: torch.dtype, device: str) -> Tensor:
    """[256, 8] of ±1: the signs held by every byte value."""
    return (code_table(1, "cpu").to(dtype) * 2 - 1).to(device)


@functools.cache
def code_pair_table(bits: int, device: str) -> Tensor:
    """float32 [65536, 2 * (8 // sb)]: the codes held by every pair of bytes, indexed by the pair read as a
    little-endian uint16 (first byte low): half the lookups of ``code_table`` (2 MiB for 2-bit codes)."""
    t = code_table(bits, "cpu").float()
    return torch.cat([t.repeat(256, 1), t.repeat_interleave(256, 0)], 1).to(device)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of ``pack_codes``: uint8 [..., nbytes] -> uint8 codes [..., n]."""
    c = code_table(bits, str(packed.device))[packed.long()]
    return c.reshape(*packed.shape[:-1], -1)[..., :n]


def pack_signs(x: Tensor) -> Tensor:
    """Signs of ``x`` [..., m] packed LSB first: uint8 [..., ceil(m/8)], bit = 1 where x >= 0."""
    return pack_codes((x >= 0).to(torch.uint8), 1)


def unpack_signs(bits: Tensor, m: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed sign bits uint8 [..., m/8] -> ±1 [..., m] (``m`` defaults to 8 x bytes)."""
    m = bits.shape[-1] * 8 if m is None else m
    table = sign_table(dtype, str(bits.device))  # a row lookup (embedding): ~4x faster than table[idx] on the CPU
    return torch.nn.functional.embedding(bits.int(), table).reshape(*bits.shape[:-1], -1)[..., :m]


@dataclass
class QuantizedGroups:
    """A tensor quantized in groups along one dim.

    Layout: the quantized dim ``dim`` of the original ``shape`` is moved last and split into
    ``n_groups`` groups of ``group`` elements (the last group padded by repeating its final
    element when ``length`` is not a multiple of ``group``). With ``rest`` the other dims in their
    original order: codes uint8 [*rest, n_groups, ceil(group * sb / 8)] (packed, see
    ``pack_codes``), scale and minimum float16 [*rest, n_groups]; x ~= minimum + scale * code.
    """

    codes: Tensor
    scale: Tensor
    minimum: Tensor
    bits: int
    group: int
    dim: int  # the quantized dim of the original tensor (non-negative)
    length: int  # its size in the original tensor

    @property
    def n_groups(self) -> int:
        return self.scale.shape[-1]

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield "codes", self.codes
        yield "scales", self.scale
        yield "zero_points", self.minimum

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    def rest_dim(self, original_dim: int) -> int:
        """Where an original dim other than ``dim`` sits in the leading dims of codes/scale."""
        nd = len(self.scale.shape)  # rest dims + the group dim = original ndim
        d = original_dim % nd
        if d == self.dim:
            raise ValueError("that is the quantized dim")
        return d if d < self.dim else d - 1


def quantize_groups(x: Tensor, bits: int, group: int, dim: int = -1) -> QuantizedGroups:
    """Asymmetric ``bits``-bit quantization of ``x`` in groups of ``group`` along ``dim``.

    Scale = (max - min) / (2^bits - 1) and min are stored in float16 and the codes are computed
    against those rounded values, so the error per element is at most scale / 2 (plus float16
    rounding of min). Returns a ``QuantizedGroups``.
    """
    storage_bits(bits)
    dim = dim % x.dim()
    length = x.shape[dim]
    xm = x.float().movedim(dim, -1)
    pad = (-length) % group
    if pad:
        xm = torch.cat([xm, xm[..., -1:].expand(*xm.shape[:-1], pad)], dim=-1)
    xg = xm.reshape(*xm.shape[:-1], -1, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    levels = (1 << bits) - 1
    minimum = lo.half()
    scale = ((hi - minimum.float()) / levels).half()
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = torch.round((xg - minimum.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, levels)
    return QuantizedGroups(pack_codes(codes, bits), scale, minimum, bits, group, dim, length)


def dequantize_groups(q: QuantizedGroups, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of ``quantize_groups`` (up to the quantization error): a tensor of the original shape."""
    codes = unpack_codes(q.codes, q.bits, q.group).to(dtype)
    x = q.minimum.to(dtype).unsqueeze(-1) + q.scale.to(dtype).unsqueeze(-1) * codes
    x = x.reshape(*x.shape[:-2], -1)[..., : q.length]
    return x.movedim(-1, q.dim)


def weighted_token_sum(weights: Tensor, q: QuantizedGroups) -> Tensor:
    """``weights @ dequantize_groups(q)`` without materializing the dequantized tensor.

    q quantizes x [*lead, n, d] per token (groups along the last dim); weights [*lead, R, n].
    Returns float32 [*lead, R, d]. With x_ic = min_ig + scale_ig * code_ic (g the group of c),
    sum_i w_i x_ic = sum_i (w_i scale_ig) code_ic + sum_i w_i min_ig: the codes are read as floats
    through a lookup table (two bytes per lookup where the groups allow, ``_float_codes``), one
    matmul per group of channels, and the minima enter through one small matmul.
    """
    if q.dim != q.scale.dim() - 1:
        raise ValueError("weighted_token_sum needs values quantized along their last dim (per token)")
    codes = _float_codes(_groups_first(q.codes), q.bits)[..., : q.group]  # [*lead, G, n, group]
    w = weights.float()
    scaled = w.unsqueeze(-3) * q.scale.float().transpose(-1, -2).contiguous().unsqueeze(-2)  # [*lead, G, R, n]
    out = torch.matmul(scaled, codes)  # [*lead, G, R, group]
    out = out + torch.matmul(w, q.minimum.float()).transpose(-1, -2).unsqueeze(-1)
    return out.movedim(-3, -2).flatten(-2)[..., : q.length]


def _groups_first(codes: Tensor) -> Tensor:
    """Packed per-token codes uint8 [*lead, n, G, nbytes] -> contiguous [*lead, G, n, nbytes].

    A group's bytes move as one 8-, 4- or 2-byte word when the layout allows (several times faster
    than moving single bytes)."""
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if codes.stride(-1) == 1 and codes.shape[-1] % size == 0 and codes.storage_offset() % size == 0:
            if all(st % size == 0 for st in codes.stride()[:-1]):
                return codes.view(word).transpose(-3, -2).contiguous().view(torch.uint8)
    return codes.transpose(-3, -2).contiguous()


def _float_codes(codes: Tensor, bits: int) -> Tensor:
    """Packed codes uint8 [..., nbytes] (contiguous) -> float32 [..., nbytes * (8 // sb)], padding codes included.

    Two bytes per lookup (``code_pair_table``) when the rows hold an even number of bytes."""
    sb, dev = storage_bits(bits), str(codes.device)
    if sb == 8:
        return codes.float()
    if codes.shape[-1] % 2 == 0 and sys.byteorder == "little":
        pairs = codes.view(torch.int16).int() & 0xFFFF
        out = torch.nn.functional.embedding(pairs, code_pair_table(bits, dev))
    else:
        out = torch.nn.functional.embedding(codes.int(), code_table(bits, dev).float())
    return out.reshape(*codes.shape[:-1], -1)


def cat_groups(parts: list[QuantizedGroups], dim: int) -> QuantizedGroups:
    """Concatenate quantized tensors along an original dim other than the quantized one.

    All parts must share bits, group, the quantized dim and its length.
    """
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group, p.dim, p.length) != (first.bits, first.group, first.dim, first.length):
            raise ValueError("cannot concatenate quantized tensors with different layouts")
    r = first.rest_dim(dim)
    return QuantizedGroups(
        torch.cat([p.codes for p in parts], r),
        torch.cat([p.scale for p in parts], r),
        torch.cat([p.minimum for p in parts], r),
        first.bits,
        first.group,
        first.dim,
        first.length,
    )


def group_error_bound(q: QuantizedGroups) -> Tensor:
    """Per-element bound on |x - dequantize(x)|, [original shape].

    Half a step, plus the float16 rounding of the minimum and of the scale (a scale rounded down can
    push the group's maximum past the top code by up to ``levels`` x 2^-11 steps).
    """
    levels = (1 << q.bits) - 1
    bound = q.scale.float() * (0.5 + levels * 2**-11) + q.minimum.float().abs() * 2**-11 + 1e-6
    b = bound.unsqueeze(-1).expand(*bound.shape, q.group).reshape(*bound.shape[:-1], -1)[..., : q.length]
    return b.movedim(-1, q.dim)


__all__ = [
    "SUPPORTED_BITS",
    "QuantizedGroups",
    "cat_groups",
    "code_pair_table",
    "code_table",
    "dequantize_groups",
    "group_error_bound",
    "pack_codes",
    "pack_signs",
    "sign_table",
    "quantize_groups",
    "storage_bits",
    "unpack_codes",
    "unpack_signs",
    "weighted_token_sum",
]
