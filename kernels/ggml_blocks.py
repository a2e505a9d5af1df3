"""ggml's block quantization formats q8_0, q5_0 and q4_0, the KV-cache types of llama.cpp and Ollama
(``--cache-type-k`` / ``--cache-type-v``): torch encoders and decoders, byte for byte ggml's layout and rounding.

Every format cuts a row into blocks of 32 numbers and stores, per block, one float16 scale d and 32 codes;
x ~= d * q. The scale and the rounding are ggml's reference quantizers (``quantize_row_*_ref`` in
ggml-quants.c, the ones llama.cpp's CPU and CUDA cache writes follow), computed in float32:

* **q8_0** (34 bytes a block, 8.5 bits a number): d = amax / 127, q = round(x / d) rounded half away from
  zero (C's ``roundf``) with x / d computed as x * (1 / d), stored as int8. Bytes: d (float16, little
  endian), then the 32 int8 codes.
* **q4_0** (18 bytes, 4.5 bits): m = the block's number of largest magnitude, with its sign (the first one
  on a tie); d = m / -8; q = min(15, trunc(x * (1 / d) + 8.5)), so that m itself maps to code 0 and the
  codes stand for q - 8 in [-8, 7]. Bytes: d, then 16 bytes: byte j holds the code of number j in its low
  nibble and the code of number j + 16 in its high nibble.
* **q5_0** (22 bytes, 5.5 bits): as q4_0 with d = m / -16, q = min(31, trunc(x * (1 / d) + 16.5)), codes
  standing for q - 16. Bytes: d, then 4 bytes (a little-endian uint32 whose bit j is bit 4 of code j),
  then 16 bytes of low nibbles as q4_0's.

A d of 0 (a block of zeros) quantizes with 1 / d taken as 0. ``ggml_quantize`` / ``ggml_dequantize`` equal
the ``gguf`` package's ``gguf.quants.quantize`` / ``dequantize`` bit for bit on float32 input
(tests/test_ggml_cache.py). ggml's SIMD quantizers for q8_0 (x86 AVX) round ties to even with a scale of
127 / amax and can differ from the reference in the last bit of a code; they are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32  # numbers per block (QK8_0 = QK5_0 = QK4_0)


@dataclass(frozen=True)
class BlockType:
    name: str
    block_bytes: int  # bytes per block of 32 numbers
    levels: int  # q4_0: 8 (d = m / -8), q5_0: 16, q8_0: 127 (d = amax / 127)

    @property
    def bits(self) -> float:
        """Bits per number the blocks hold (scales included): 8.5, 5.5, 4.5."""
        return 8 * self.block_bytes / BLOCK

    def row_bytes(self, d: int) -> int:
        """Bytes of a row of ``d`` numbers (a multiple of 32)."""
        if d % BLOCK:
            raise ValueError(f"{self.name} needs rows that are a multiple of {BLOCK} numbers, not {d}")
        return d // BLOCK * self.block_bytes


TYPES: dict[str, BlockType] = {
    "q8_0": BlockType("q8_0", 34, 127),
    "q5_0": BlockType("q5_0", 22, 16),
    "q4_0": BlockType("q4_0", 18, 8),
}


def block_type(name: str) -> BlockType:
    try:
        return TYPES[name]
    except KeyError:
        raise ValueError(f"unknown ggml cache type {name!r}; allowed: {', '.join(TYPES)}") from None


def _blocks(x: Tensor) -> Tensor:
    """x [..., d] -> float32 [..., d / 32, 32]."""
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"ggml blocks need rows that are a multiple of {BLOCK} numbers, not {d}")
    return x.float().reshape(*x.shape[:-1], d // BLOCK, BLOCK)


def _inverse(d: Tensor) -> Tensor:
    """1 / d in float32, 0 where d is 0 (ggml: ``id = d ? 1.0f/d : 0.0f``)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _half_bytes(d: Tensor) -> Tensor:
    """float32 scales [..., nb, 1] -> their float16 bytes, little endian, uint8 [..., nb, 2]."""
    return d.half().contiguous().view(torch.uint8)


def round_away(x: Tensor) -> Tensor:
    """C's ``roundf`` (halves away from zero), exactly: floor(|x|) + floor(2 (|x| - floor(|x|))) with x's sign."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def _signed_max(b: Tensor) -> Tensor:
    """The number of largest magnitude of each block, with its sign (the first one on a tie): [..., nb, 1]."""
    return torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))


def quantize_q8_0(x: Tensor) -> Tensor:
    b = _blocks(x)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = round_away(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_half_bytes(d), q], -1).flatten(-2)


def _nibble_pack(q: Tensor) -> Tensor:
    """Codes [..., nb, 32] (< 16 after masking) -> [..., nb, 16]: number j low, number j + 16 high."""
    q = q.to(torch.uint8)
    return (q[..., :16] & 0x0F) | (q[..., 16:] << 4)


def quantize_q4_0(x: Tensor) -> Tensor:
    b = _blocks(x)
    d = _signed_max(b) / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp_(0, 15)
    return torch.cat([_half_bytes(d), _nibble_pack(q)], -1).flatten(-2)


def quantize_q5_0(x: Tensor) -> Tensor:
    b = _blocks(x)
    d = _signed_max(b) / -16
    q = torch.trunc(b * _inverse(d) + 16.5).clamp_(0, 31).to(torch.int64)
    high = ((q >> 4) & 1) << torch.arange(BLOCK, dtype=torch.int64, device=q.device)
    qh = high.sum(-1, keepdim=True)  # the uint32 of bit 4 of every code
    qh_bytes = ((qh >> torch.arange(0, 32, 8, device=q.device)) & 0xFF).to(torch.uint8)
    return torch.cat([_half_bytes(d), qh_bytes, _nibble_pack(q)], -1).flatten(-2)


def _scales(blocks: Tensor) -> Tensor:
    """Bytes [..., nb, block_bytes] -> the float32 scales [..., nb, 1]."""
    return blocks[..., :2].contiguous().view(torch.float16).float()


def _nibbles(packed: Tensor) -> Tensor:
    """[..., nb, 16] -> int64 codes [..., nb, 32] (low nibbles first, then the high ones)."""
    p = packed.to(torch.int64)
    return torch.cat([p & 0x0F, p >> 4], -1)


def _as_blocks(data: Tensor, kind: BlockType) -> Tensor:
    return data.reshape(*data.shape[:-1], data.shape[-1] // kind.block_bytes, kind.block_bytes)


def dequantize_q8_0(data: Tensor) -> Tensor:
    b = _as_blocks(data, TYPES["q8_0"])
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return (_scales(b) * q).flatten(-2)


def dequantize_q4_0(data: Tensor) -> Tensor:
    b = _as_blocks(data, TYPES["q4_0"])
    return (_scales(b) * (_nibbles(b[..., 2:]) - 8).float()).flatten(-2)


def dequantize_q5_0(data: Tensor) -> Tensor:
    b = _as_blocks(data, TYPES["q5_0"])
    qh = b[..., 2:6].to(torch.int64)
    word = (qh << torch.arange(0, 32, 8, device=b.device)).sum(-1, keepdim=True)
    high = (word >> torch.arange(BLOCK, device=b.device)) & 1
    q = _nibbles(b[..., 6:]) | (high << 4)
    return (_scales(b) * (q - 16).float()).flatten(-2)


_QUANTIZE = {"q8_0": quantize_q8_0, "q5_0": quantize_q5_0, "q4_0": quantize_q4_0}
_DEQUANTIZE = {"q8_0": dequantize_q8_0, "q5_0": dequantize_q5_0, "q4_0": dequantize_q4_0}


def ggml_quantize(x: Tensor, kind: str) -> Tensor:
    """x [..., d] (d a multiple of 32) -> uint8 [..., d / 32 * block_bytes]: ggml's blocks of type ``kind``."""
    return _QUANTIZE[block_type(kind).name](x)


def ggml_dequantize(data: Tensor, kind: str) -> Tensor:
    """uint8 [..., d / 32 * block_bytes] of type ``kind`` -> float32 [..., d]: d * (q - offset) per number."""
    return _DEQUANTIZE[block_type(kind).name](data)


__all__ = ["BLOCK", "TYPES", "BlockType", "block_type", "ggml_dequantize", "ggml_quantize", "round_away"]
