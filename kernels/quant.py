"""Quantized storage formats and their torch reference maths: bit packing and group quantization.

The layouts the Triton kernels read, used by QJL (sign bits of the sketched keys, 2-bit values)
and KIVI (per-channel keys, per-token values):

* ``pack_signs``: signs packed 8 per byte along the last dim, LSB first — byte ``b`` holds the
  sign of element ``8b + j`` in bit ``j``; bit 1 means the element is ``>= 0``.
* ``pack_codes``: b-bit integer codes packed along the last dim as one little-endian bit stream,
  LSB first — code ``i`` of a row sits in bits ``[i*b, (i+1)*b)`` of the row's bytes read as one
  little-endian integer. b in {1, 2, 3, 4, 8}; a row of n codes takes ``packed_bytes(n, b)`` =
  ceil(n b / 8) bytes. For b = 1, 2, 4, 8 that is ``8 // b`` codes per byte (code
  ``k * (8 // b) + j`` in bits ``[j*b, (j+1)*b)`` of byte ``k``); for b = 3 it is 8 codes in 3
  bytes (a 24-bit word per 8 codes, the last word cut to the bytes its codes reach), so 3-bit
  codes cost 3 bits.
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
    """Bits one code occupies once packed: ``bits`` itself (3-bit codes are packed 8 in 3 bytes)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} not supported; allowed: {', '.join(map(str, SUPPORTED_BITS))}")
    return bits


def packed_bytes(n: int, bits: int) -> int:
    """Bytes ``pack_codes`` uses for a row of ``n`` ``bits``-bit codes: ceil(n * bits / 8)."""
    return -(-n * storage_bits(bits) // 8)


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in [0, 2^bits) along the last dim: [..., n] -> uint8 [..., packed_bytes(n, bits)].

    The last byte is zero-padded when n * bits is not a multiple of 8.
    """
    sb = storage_bits(bits)
    if sb == 3:
        return _pack_3bit(codes)
    per = 8 // sb
    c = _pad_last(codes.to(torch.uint8), per)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    shifts = torch.arange(0, 8, sb, dtype=torch.uint8, device=c.device)
    return (c << shifts).sum(-1, dtype=torch.uint8) if per > 1 else c.squeeze(-1)


_SHIFTS_3 = tuple(range(0, 24, 3))  # bit offsets of the 8 codes in a 24-bit word


def _pack_3bit(codes: Tensor) -> Tensor:
    """3-bit codes [..., n] -> uint8 [..., ceil(3n / 8)]: each 8 codes form a 24-bit little-endian word."""
    n = codes.shape[-1]
    c = _pad_last(codes.to(torch.int32), 8)
    c = c.reshape(*c.shape[:-1], -1, 8)
    word = (c << torch.tensor(_SHIFTS_3, dtype=torch.int32, device=c.device)).sum(-1, dtype=torch.int32)
    byte_shifts = torch.tensor((0, 8, 16), dtype=torch.int32, device=c.device)
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)  # [..., words, 3]
    return out.reshape(*out.shape[:-2], -1)[..., : packed_bytes(n, 3)]


def _words_3bit(packed: Tensor) -> Tensor:
    """Packed 3-bit rows uint8 [..., nbytes] -> int32 [..., ceil(nbytes / 3)]: the 24-bit words (zero-padded)."""
    b = _pad_last(packed, 3).to(torch.int32)
    b = b.reshape(*b.shape[:-1], -1, 3)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)


@functools.cache
def code_table(bits: int, device: str) -> Tensor:
    """uint8 [256, 8 // sb]: the codes held by every byte value (a lookup is faster than shifting).

    For 3-bit codes: uint8 [4096, 4], the codes held by every 12-bit half of a 24-bit word."""
    sb = storage_bits(bits)
    if sb == 3:
        shifts = torch.tensor(_SHIFTS_3[:4], dtype=torch.int64)
        return ((torch.arange(4096).unsqueeze(-1) >> shifts) & 7).to(torch.uint8).to(device)
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


def _unpack_3bit(packed: Tensor, table: Tensor) -> Tensor:
    """Packed 3-bit rows uint8 [..., nbytes] -> codes [..., 8 * ceil(nbytes / 3)] (padding codes included),
    looked up in ``table`` ([4096, 4]: the codes of every 12-bit half word) as its dtype."""
    w = _words_3bit(packed)
    halves = torch.stack([w & 0xFFF, w >> 12], -1)  # [..., words, 2]
    return torch.nn.functional.embedding(halves, table).reshape(*packed.shape[:-1], -1)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of ``pack_codes``: uint8 [..., nbytes] -> uint8 codes [..., n]."""
    if storage_bits(bits) == 3:
        return _unpack_3bit(packed, code_table(3, str(packed.device)))[..., :n]
    c = code_table(bits, str(packed.device))[packed.long()]
    return c.reshape(*packed.shape[:-1], -1)[..., :n]


def pack_signs(x: Tensor) -> Tensor:
    """Signs of ``x`` [..., m] packed LSB first: uint8 [..., ceil(m/8)], bit = 1 where x >= 0."""
    return pack_codes((x >= 0).to(torch.uint8), 1)


@functools.cache
def sign_words(dtype: torch.dtype, device: str) -> Tensor:
    """complex128 [256]: ``sign_table`` of a 2-byte dtype, each byte value's 8 signs (16 bytes) as one element."""
    return sign_table(dtype, device).contiguous().view(torch.complex128).reshape(256)


def unpack_signs(bits: Tensor, m: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed sign bits uint8 [..., m/8] -> ±1 [..., m] (``m`` defaults to 8 x bytes).

    A 2-byte dtype reads each byte's 8 signs as one 16-byte element of ``sign_words`` (one index per byte,
    2-6x faster on the CPU than a row lookup); others by a row lookup (``embedding``: ~4x faster than
    table[idx] on the CPU)."""
    m = bits.shape[-1] * 8 if m is None else m
    if dtype.itemsize == 2:
        words = sign_words(dtype, str(bits.device)).index_select(0, bits.reshape(-1).int())
        return words.view(dtype).reshape(*bits.shape[:-1], -1)[..., :m]
    table = sign_table(dtype, str(bits.device))
    return torch.nn.functional.embedding(bits.int(), table).reshape(*bits.shape[:-1], -1)[..., :m]


@dataclass
class QuantizedGroups:
    """A tensor quantized in groups along one dim.

    Layout: the quantized dim ``dim`` of the original ``shape`` is moved last and split into
    ``n_groups`` groups of ``group`` elements (the last group padded by repeating its final
    element when ``length`` is not a multiple of ``group``). With ``rest`` the other dims in their
    original order: codes uint8 [*rest, n_groups, packed_bytes(group, bits)] (packed, see
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
    # a minimum rounded up past the group's maximum (a group of one value, or of equal ones) leaves scale 0
    scale = ((hi - minimum.float()).clamp_min(0) / levels).half()
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = torch.round((xg - minimum.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, levels)
    return QuantizedGroups(pack_codes(codes, bits), scale, minimum, bits, group, dim, length)


def dequantize_groups(q: QuantizedGroups, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of ``quantize_groups`` (up to the quantization error): a tensor of the original shape.

    The codes are read as floats by ``_float_codes`` (two bytes per lookup where the groups allow: 2.5-8x
    faster on the CPU than unpacking to uint8 codes first, the same values)."""
    codes = _float_codes(q.codes.contiguous(), q.bits)[..., : q.group].to(dtype)
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
    """Packed codes uint8 [..., nbytes] (contiguous) -> float32 [..., >= nbytes * 8 // bits], padding codes included.

    Two bytes per lookup (``code_pair_table``) when the rows hold an even number of bytes; 3-bit codes
    twelve bits per lookup."""
    sb, dev = storage_bits(bits), str(codes.device)
    if sb == 8:
        return codes.float()
    if sb == 3:
        return _unpack_3bit(codes, _float_table_3bit(dev))
    if codes.shape[-1] % 2 == 0 and sys.byteorder == "little":
        pairs = codes.view(torch.int16).int() & 0xFFFF
        words = code_pair_words(bits, dev)
        if words is not None:  # one element per pair: the fast 1-D gather
            out = words.index_select(0, pairs.reshape(-1)).view(torch.bfloat16).float()
        else:
            out = torch.nn.functional.embedding(pairs, code_pair_table(bits, dev))
    else:
        out = torch.nn.functional.embedding(codes.int(), code_table(bits, dev).float())
    return out.reshape(*codes.shape[:-1], -1)


_WORDS = {8: torch.int64, 16: torch.complex128}  # a pair's codes in bfloat16 (exact: codes < 256), bytes -> dtype


@functools.cache
def code_pair_words(bits: int, device: str) -> Tensor | None:
    """``code_pair_table`` with each pair's codes in bfloat16 as ONE element (8 or 16 bytes: 4- and 2-bit
    codes): [65536]. A 1-D gather of whole words runs several times faster on the CPU than gathering rows
    of floats. None where a pair's codes fill no such word (1-bit codes)."""
    table = code_pair_table(bits, "cpu").to(torch.bfloat16)
    word = _WORDS.get(table.shape[1] * 2)
    return None if word is None else table.contiguous().view(word).reshape(-1).to(device)


@functools.cache
def _float_table_3bit(device: str) -> Tensor:
    return code_table(3, "cpu").float().to(device)


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
    push the group's maximum past the top code by up to ``levels`` roundings of the scale). A float16
    rounding is at most half a unit in the last place: 2^-11 of the value, and 2^-25 where the value is
    subnormal (below 2^-14: a group whose range is under about 2^-14 x levels). The float32 arithmetic
    adds 2^-22 of the magnitudes involved.
    """
    levels = (1 << q.bits) - 1
    scale, minimum = q.scale.float(), q.minimum.float()

    def half_ulp(v: Tensor) -> Tensor:
        return (v.abs() * 2**-11).clamp_min(2**-25)

    bound = scale * 0.5 + levels * half_ulp(scale) + half_ulp(minimum) + (minimum.abs() + levels * scale) * 2**-22
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
    "packed_bytes",
    "sign_table",
    "quantize_groups",
    "storage_bits",
    "unpack_codes",
    "unpack_signs",
    "weighted_token_sum",
]
