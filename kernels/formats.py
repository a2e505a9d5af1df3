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


@dataclass
class TurboQuantCodes:
    """One TurboQuant instance (one channel set of one layer's keys or values; kvlab/methods/turboquant.py)
    over n tokens, Hkv KV heads and m channels, as the method holds it.

    A vector x is stored as ||x|| and, for u = x / ||x||, the index of the nearest centroid of every
    coordinate of Pi u (TurboQuant-mse, ``bits`` bits per coordinate; none when ``bits`` is 0). Keys
    through TurboQuant-prod add the residual r = u - Pi^T c[idx] as 1-bit QJL: sign(S r) and ||r||.
    vLLM's presets (kvlab/methods/vllm_turboquant.py) use a Walsh-Hadamard Pi (``hadamard``) and may
    rescale c[idx] to a unit vector before use (``norm_correction``).
    """

    norms: Tensor  # float16 [Hkv, n]: ||x||
    rotation: Tensor  # float32 [m, m]: Pi (the rotated unit vector is Pi u)
    centroids: Tensor  # float32 [2^bits]: the codebook
    bits: int  # bits per mse code: 1-4, or 0 (a prod key with no mse part)
    codes: Tensor | None = None  # uint8 [Hkv, n, ceil(m * bits / 8)], kernels.quant.pack_codes' layout
    sketch: Tensor | None = None  # float32 [m, m]: S, i.i.d. N(0, 1) (prod)
    signs: Tensor | None = None  # uint8 [Hkv, n, ceil(m / 8)]: sign(S r), LSB first, bit 1 = (S r) >= 0 (prod)
    residual_norms: Tensor | None = None  # float16 [Hkv, n]: ||r|| (prod with an mse part)
    hadamard: bool = False  # Pi is the orthonormal Walsh-Hadamard matrix (kernels.hadamard), applied by its transform
    norm_correction: bool = False  # c[idx] rescaled to unit norm before use (vLLM's "_nc" presets)

    def __post_init__(self) -> None:
        if (self.codes is None) != (self.bits == 0):
            raise ValueError("TurboQuant codes: packed codes go with bits >= 1, none with bits 0")
        if (self.sketch is None) != (self.signs is None):
            raise ValueError("TurboQuant-prod needs the sketch and the sign bits together")
        if self.signs is not None and self.bits and self.residual_norms is None:
            raise ValueError("TurboQuant-prod with an mse part needs the residual norms")
        if self.codes is None and self.signs is None:
            raise ValueError("TurboQuant codes hold mse codes, QJL signs or both")
        if self.hadamard and self.m & (self.m - 1):
            raise ValueError(f"a Hadamard rotation needs a power-of-two channel count, not {self.m}")
        if self.norm_correction and self.prod:
            raise ValueError("norm correction applies to mse codes alone (no QJL residual)")

    @property
    def m(self) -> int:
        return self.rotation.shape[-1]

    @property
    def n(self) -> int:
        return self.norms.shape[1]

    @property
    def prod(self) -> bool:
        return self.signs is not None
