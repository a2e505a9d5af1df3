"""Boolean arrays as short JSON strings: packed 8 to a byte, zlib-compressed, base64-encoded.

Used for the kept-position snapshots a result records (``kvlab.measure.retention``) and read back by the
views (``kvlab.report.retention_map``)."""

from __future__ import annotations

import base64
import zlib

import numpy as np


def pack(mask: np.ndarray) -> str:
    """A bool array as base64 of its zlib-compressed bits (C order); its shape is the caller's to keep."""
    return base64.b64encode(zlib.compress(np.packbits(np.asarray(mask, dtype=bool).reshape(-1)).tobytes(), 6)).decode(
        "ascii"
    )


def unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    """``pack``'s inverse: a bool array of ``shape`` (``ValueError`` when the text holds fewer bits)."""
    bits = np.unpackbits(np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8))
    size = int(np.prod(shape))
    if bits.size < size:
        raise ValueError(f"a packed mask of {bits.size} bits cannot fill shape {shape}")
    return bits[:size].reshape(shape).astype(bool)


__all__ = ["pack", "unpack"]
