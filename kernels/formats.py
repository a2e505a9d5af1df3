"""The compressed-cache layouts the kernels read (plain dataclasses, no Triton).

Kept apart from the kernel modules so that code describing a cache (the compressors) need not
import Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kernels.quant import QuantizedGroups


@dataclass
class QJLKeys:
    """One layer's keys in the QJL format (n tokens, Hkv KV heads, sketch size m, head_dim d)."""

    sketch: Tensor  # float32 [m, d]
    bits: Tensor  # uint8 [Hkv, n, m/8], LSB first, bit 1 = (S k) >= 0
    norms: Tensor  # float16 [Hkv, n], norm of the sketched (inlier) part
    out_sketch: Tensor | None = None  # float32 [m_out, d]
    out_bits: Tensor | None = None  # uint8 [Hkv, n, m_out/8]
    out_norms: Tensor | None = None  # float16 [Hkv, n]
    out_idx: Tensor | None = None  # uint8 [Hkv, n_groups, n_outliers]
    group: int = 32  # tokens per outlier group

    def __post_init__(self) -> None:
        if len({x is None for x in (self.out_sketch, self.out_bits, self.out_norms)}) > 1:
            raise ValueError("QJL outliers need out_sketch, out_bits and out_norms together (or none of them)")

    @property
    def m(self) -> int:
        return self.sketch.shape[0]

    @property
    def n(self) -> int:
        return self.bits.shape[1]

    @property
    def has_outliers(self) -> bool:
        return self.out_bits is not None

    @property
    def outliers(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """(out_sketch [m_out, d], out_bits [Hkv, n, m_out/8], out_norms [Hkv, n]), None without outliers."""
        if self.out_sketch is None or self.out_bits is None or self.out_norms is None:
            return None
        return self.out_sketch, self.out_bits, self.out_norms


@dataclass
class Segment:
    """One stretch of a layer's cache, in one storage format, for ``decode_attention``.

    Keys: dense ``keys`` [Hkv, N, d] or ``qjl`` (QJLKeys over N tokens). Values: dense ``values``
    [Hkv, N, d] or ``qvalues`` (kernels.quant.QuantizedGroups of [Hkv, N, d] along dim -1, i.e. per
    token in groups along head_dim). ``index`` int [Hkv, n] picks the rows attended (kept-index
    caches of eviction methods; all N rows when None). ``log_weights`` float [Hkv, N] is added to
    the logits of each row (a kept token standing for exp(w) tokens).
    """

    keys: Tensor | None = None
    values: Tensor | None = None
    qjl: QJLKeys | None = None
    qvalues: QuantizedGroups | None = None
    index: Tensor | None = None
    log_weights: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.keys is None) == (self.qjl is None):
            raise ValueError("a segment has either dense keys or QJL keys")
        if (self.values is None) == (self.qvalues is None):
            raise ValueError("a segment has either dense values or quantized values")
        if self.qvalues is not None and self.qvalues.dim != 2:
            raise ValueError("quantized values must be grouped along head_dim (dim -1 of [Hkv, N, d])")

    @property
    def key_rows(self) -> Tensor:
        """The tensor holding one row per key token: dense ``keys`` [Hkv, N, d] or QJL bits [Hkv, N, m/8]."""
        if self.keys is not None:
            return self.keys
        assert self.qjl is not None  # __post_init__: one of the two
        return self.qjl.bits

    @property
    def n_rows(self) -> int:
        return self.key_rows.shape[1]

    @property
    def n(self) -> int:
        """Tokens attended."""
        return self.n_rows if self.index is None else self.index.shape[1]
