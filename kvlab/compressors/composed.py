"""Composition: an eviction method whose kept tokens are stored KIVI-style quantized.

Scissorhands (Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
LLM KV Cache Compression at Test Time", NeurIPS 2023, arXiv:2305.17118, Sec. 5 / Table 4) shows
that eviction and 4-bit quantization compose; KIVI (Liu et al., arXiv:2402.02750) gives the
quantizer: asymmetric min/scale codes of ``bits`` bits in groups of ``quant_group``. Any method
built on ``DenseCompressor`` can be wrapped: ``METHOD+kiviB`` (B in 2, 3, 4), e.g.
``scissorhands+kivi4`` or ``snapkv+kivi2``. The wrapper is a subclass made on demand: the method
chooses and evicts tokens exactly as it does alone; its per-layer store is swapped for one that
holds packed codes, float16 scales and minimums (plus the method's positions / weights / scores),
and attention reads the dequantized tokens. Because eviction removes single tokens, keys and
values are both grouped per token (along head_dim) here; KIVI's per-channel key groups span
several tokens and would not survive an eviction. The byte budget accounts for the quantized
size, so the method keeps more tokens at the same memory. Budget 1.0 is no compression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from kvlab.budgets import per_token_bytes
from kvlab.compressors.base import DenseCompressor, DenseLayer, Param, PrefillState, _Growable
from kvlab.compressors.registry import add_resolver, get, register
from kvlab.ops import gather_tokens
from kvlab.quant import QuantizedGroups, cat_groups, dequantize_groups, quantize_groups, storage_bits

SUFFIX = "+kivi"
BITS = (2, 3, 4)


def quantize_tokens(x: Tensor, bits: int, group: int) -> QuantizedGroups:
    """Per-token groups along head_dim: x [Hkv, n, d]."""
    return quantize_groups(x, bits, min(group, x.shape[-1]), dim=-1)


def gather_quantized(q: QuantizedGroups, idx: Tensor) -> QuantizedGroups:
    """Keep tokens ``idx`` [Hkv, m] of a per-token quantized [Hkv, n, d] tensor."""
    pick = lambda t: gather_tokens(t, idx) if t.dim() == idx.dim() + 1 else torch.gather(  # noqa: E731
        t, 1, idx[..., None, None].expand(*idx.shape, *t.shape[2:])
    )
    return QuantizedGroups(pick(q.codes), pick(q.scale), pick(q.minimum), q.bits, q.group, q.dim, q.length)


@dataclass
class QuantizedDenseLayer:
    """A ``DenseLayer`` look-alike whose keys and values are stored as per-token quantized codes."""

    k: QuantizedGroups
    v: QuantizedGroups
    pos: _Growable  # [Hkv, n, 1] int32
    logw: _Growable | None
    bits: int
    group: int

    @classmethod
    def from_dense(cls, layer: DenseLayer, bits: int, group: int) -> "QuantizedDenseLayer":
        k, v, _, _ = layer.views()
        return cls(quantize_tokens(k, bits, group), quantize_tokens(v, bits, group), layer.pos, layer.logw, bits, group)

    @property
    def n(self) -> int:
        return self.pos.n

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        lw = None if self.logw is None else self.logw.view().squeeze(-1)
        return dequantize_groups(self.k), dequantize_groups(self.v), self.pos.view().squeeze(-1), lw

    def append(self, k: Tensor, v: Tensor, pos: int) -> None:
        self.k = cat_groups([self.k, quantize_tokens(k, self.bits, self.group)], dim=-2)
        self.v = cat_groups([self.v, quantize_tokens(v, self.bits, self.group)], dim=-2)
        self.pos.append(torch.full((k.shape[0], k.shape[1], 1), pos, dtype=torch.int32, device=k.device))
        if self.logw is not None:
            self.logw.append(torch.zeros((k.shape[0], k.shape[1], 1), device=k.device))

    def keep(self, idx: Tensor) -> None:
        self.k, self.v = gather_quantized(self.k, idx), gather_quantized(self.v, idx)
        self.pos = _Growable(gather_tokens(self.pos.view().squeeze(-1), idx).unsqueeze(-1))
        if self.logw is not None:
            self.logw = _Growable(gather_tokens(self.logw.view().squeeze(-1), idx).unsqueeze(-1))

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name, q in (("keys", self.k), ("values", self.v)):
            for kind, t in q.tensors():
                yield f"{name}_{kind}", t
        yield "positions", self.pos.view().squeeze(-1)
        if self.logw is not None:
            yield "log_weights", self.logw.view().squeeze(-1)


class QuantizedStore:
    """Mixin over a ``DenseCompressor``: same selection and eviction, KIVI-style quantized storage."""

    kv_bits: int = 4

    def quantizing(self) -> bool:
        return not (self.budget is None or self.budget.is_full)

    def quantized_kv_bytes(self) -> int:
        """Bytes of one token's K and V in one layer and KV head once quantized."""
        d = self.info.head_dim
        g = min(int(self.cfg["quant_group"]), d)
        n_groups = -(-d // g)
        return 2 * n_groups * (-(-g * storage_bits(self.kv_bits) // 8) + 4)

    def per_token_bytes(self, with_logw: bool = False) -> int:
        full = super().per_token_bytes(with_logw)
        return full - per_token_bytes(self.info) + self.quantized_kv_bytes() if self.quantizing() else full

    def plan(self, n_prompt: int) -> dict:
        knobs = super().plan(n_prompt)
        return {**knobs, "kv_bits": self.kv_bits, "quant_group": int(self.cfg["quant_group"])}

    def compress(self, state: PrefillState) -> None:
        super().compress(state)
        if self.quantizing():
            g = int(self.cfg["quant_group"])
            self.layers = [QuantizedDenseLayer.from_dense(layer, self.kv_bits, g) for layer in self.layers]


_MADE: dict[str, type] = {}


def quantized(inner: type[DenseCompressor], bits: int) -> type[DenseCompressor]:
    """The class ``INNER+kiviBITS``: ``inner``'s selection with quantized storage (made once)."""
    name = f"{inner.name}{SUFFIX}{bits}"
    if name not in _MADE:
        _MADE[name] = type(
            f"{inner.__name__}Kivi{bits}",
            (QuantizedStore, inner),
            {
                "name": name,
                "title": f"{inner.title} + KIVI {bits}-bit",
                "summary": f"{inner.title}'s token selection; kept keys/values stored as {bits}-bit codes (per token).",
                "kv_bits": bits,
                "params": inner.params + (Param("quant_group", 32, "quantization group along head_dim", minimum=1),),
            },
        )
    return _MADE[name]


def resolve(name: str) -> type | None:
    """``METHOD+kiviB`` -> its composed class; None for any other name."""
    base, sep, bits = name.rpartition(SUFFIX)
    if not sep or not bits.isdigit() or int(bits) not in BITS:
        return None
    try:
        inner = get(base)
    except ValueError:
        return None
    if not issubclass(inner, DenseCompressor) or inner.name == "exact":
        return None
    return quantized(inner, int(bits))


add_resolver(resolve)

# Listed with the methods: the Scissorhands paper's own combination (Table 4) and a prefill one.
from kvlab.compressors.scissorhands import Scissorhands  # noqa: E402
from kvlab.compressors.snapkv import SnapKV  # noqa: E402

register(quantized(Scissorhands, 4))
register(quantized(SnapKV, 2))
