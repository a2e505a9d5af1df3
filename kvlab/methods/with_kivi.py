"""``METHOD+kiviB`` (B in 2, 3, 4), e.g. ``scissorhands+kivi4`` or ``snapkv+kivi2``. Scissorhands
(Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023, arXiv:2305.17118, Sec. 5 / Table 4) shows that eviction
and 4-bit quantization compose; KIVI (Liu et al., arXiv:2402.02750) gives the quantizer: asymmetric
min/scale codes of ``bits`` bits in groups of ``quant_group``. Because eviction removes single
tokens, keys and values are both grouped per token (along head_dim) here; KIVI's per-channel key
groups span several tokens and would not survive an eviction.

The shared store, storage base and wrapper are in ``composed.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from kernels.quant import QuantizedGroups, cat_groups, dequantize_groups
from kvlab.methods.composed import (
    Composition,
    Storage,
    TokenStore,
    composable,
    gather_quantized,
    quantize_tokens,
    quantized_token_bytes,
)
from kvlab.methods.dense import DenseCompressor, KeptTokens
from kvlab.methods.params import Param

SUFFIX = "+kivi"
BITS = (2, 3, 4)


@dataclass
class QuantizedDenseLayer(TokenStore):
    """A ``DenseLayer`` look-alike whose keys and values are stored as per-token quantized codes."""

    k: QuantizedGroups
    v: QuantizedGroups
    bits: int
    group: int

    @classmethod
    def from_dense(cls, layer: KeptTokens, bits: int, group: int) -> QuantizedDenseLayer:
        k, v, _, _ = layer.views()
        return cls(layer.pos, layer.logw, quantize_tokens(k, bits, group), quantize_tokens(v, bits, group), bits, group)

    def dense_kv(self) -> tuple[Tensor, Tensor]:
        return dequantize_groups(self.k), dequantize_groups(self.v)

    def _append_kv(self, k: Tensor, v: Tensor) -> None:
        self.k = cat_groups([self.k, quantize_tokens(k, self.bits, self.group)], dim=-2)
        self.v = cat_groups([self.v, quantize_tokens(v, self.bits, self.group)], dim=-2)

    def _keep_kv(self, idx: Tensor) -> None:
        self.k, self.v = gather_quantized(self.k, idx), gather_quantized(self.v, idx)

    def _kv_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name, q in (("keys", self.k), ("values", self.v)):
            for kind, t in q.tensors():
                yield f"{name}_{kind}", t


class QuantizedStorage(Storage):
    """KIVI-style storage: every kept key and value as per-token ``bits``-bit codes."""

    params = (Param("quant_group", 32, "quantization group along head_dim", minimum=1),)

    def __init__(self, method: DenseCompressor, cfg: dict, bits: int = 4):
        super().__init__(method, cfg)
        self.bits = bits

    def kv_bytes(self) -> int:
        g, info = int(self.cfg["quant_group"]), self.info  # keys and values at their own head sizes (MLA)
        return quantized_token_bytes(info.head_dim, self.bits, g) + quantized_token_bytes(info.v_head_dim, self.bits, g)

    def store(self, layer: int, dense: KeptTokens) -> TokenStore:
        return QuantizedDenseLayer.from_dense(dense, self.bits, int(self.cfg["quant_group"]))

    def knobs(self) -> dict:
        return {"kv_bits": self.bits, "quant_group": int(self.cfg["quant_group"])}


def quantized(inner: type[DenseCompressor], bits: int) -> Composition:
    """``INNER+kiviBITS``: ``inner``'s selection with quantized storage."""
    return Composition(
        inner,
        f"{inner.name}{SUFFIX}{bits}",
        title=f"{inner.title} + KIVI {bits}-bit",
        summary=f"{inner.title}'s token selection; kept keys/values stored as {bits}-bit codes (per token).",
        own_params=QuantizedStorage.params,
        storage=QuantizedStorage,
        storage_args=(("bits", bits),),
    )


def resolve(name: str, lookup: Callable[[str], Any]) -> Composition | None:
    """``METHOD+kiviB`` -> its composition; None for any other name."""
    base, sep, bits = name.rpartition(SUFFIX)
    if not sep or not bits.isdigit() or int(bits) not in BITS:
        return None
    inner = composable(base, lookup)
    return None if inner is None else quantized(inner, int(bits))
