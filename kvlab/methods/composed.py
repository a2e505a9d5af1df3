"""Compositions: an eviction method whose kept tokens are stored compressed.

Any method built on ``DenseCompressor`` (except ``exact``) can be wrapped. The wrapper is a
subclass made on demand (``get("h2o+kivi2")``, ``get("streaming+qjl")``): the method chooses and
evicts tokens exactly as it does alone; its per-layer store is swapped for one that holds the
kept tokens compressed (plus the method's positions / log-weights / scores, as it holds them), and
attention reads them back as dense keys and values, so the method's attention, the probabilities
it scores tokens with and its ``keep(idx)`` evictions work unchanged. The byte budget accounts for
the compressed size of a token, so the method keeps more tokens at the same memory. Budget 1.0 is
no compression (the inner method as it is, i.e. the exact cache).

This module holds what every composition shares: the per-layer store (``TokenStore``), the mixin
that installs it (``ComposedStore``), ``compose`` / ``composable`` (the on-demand class for
``INNER + tag``) and the per-token quantized codes both use. Each composition lives in its own
module with its paper: ``with_kivi.py`` (``METHOD+kiviB``) and ``with_qjl.py`` (``METHOD+qjl``);
each registers a resolver (``registry.add_resolver``) and its named instances on import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import Tensor

from kernels.quant import QuantizedGroups, packed_bytes, quantize_groups
from kernels.tensor_ops import gather_tokens
from kvlab.core.budgets import per_token_bytes
from kvlab.core.semantics import Keys
from kvlab.methods.dense import DenseCompressor, DenseLayer, _Growable
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param, ParamError


# ----- per-token quantized codes (KIVI's keys and values, QJL's values) --------------------------
def quantize_tokens(x: Tensor, bits: int, group: int) -> QuantizedGroups:
    """Per-token groups along head_dim: x [Hkv, n, d]."""
    return quantize_groups(x, bits, min(group, x.shape[-1]), dim=-1)


def gather_quantized(q: QuantizedGroups, idx: Tensor) -> QuantizedGroups:
    """Keep tokens ``idx`` [Hkv, m] of a per-token quantized [Hkv, n, d] tensor."""
    pick = (
        lambda t: (
            gather_tokens(t, idx)
            if t.dim() == idx.dim() + 1
            else torch.gather(  # noqa: E731
                t, 1, idx[..., None, None].expand(*idx.shape, *t.shape[2:])
            )
        )
    )
    return QuantizedGroups(pick(q.codes), pick(q.scale), pick(q.minimum), q.bits, q.group, q.dim, q.length)


def quantized_token_bytes(d: int, bits: int, group: int) -> int:
    """Bytes of one token's [d] vector quantized per token: packed codes + fp16 scale and minimum per group."""
    g = min(group, d)
    return -(-d // g) * (packed_bytes(g, bits) + 4)


# ----- the shared machinery: a per-layer store and the mixin that installs it --------------------
@dataclass
class TokenStore:
    """What every compressed store keeps besides K and V: positions [Hkv, n, 1] and optional log-weights.

    A subclass is a ``DenseLayer`` look-alike (``n``, ``views``, ``append``, ``keep``, ``tensors``):
    it adds its K/V storage through ``dense_kv``, ``_append_kv``, ``_keep_kv`` and ``_kv_tensors``.
    """

    pos: _Growable  # [Hkv, n, 1] int32
    logw: _Growable | None

    @property
    def n(self) -> int:
        return self.pos.n

    def positions(self) -> Tensor:
        return self.pos.view().squeeze(-1)

    def log_weights(self) -> Tensor | None:
        return None if self.logw is None else self.logw.view().squeeze(-1)

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        k, v = self.dense_kv()
        return k, v, self.positions(), self.log_weights()

    def read_views(self) -> tuple[Keys, Tensor, Tensor, Tensor | None]:
        """``views`` as attention reads them: a store whose keys are scored without densifying them
        overrides ``read_kv``."""
        k, v = self.read_kv()
        return k, v, self.positions(), self.log_weights()

    def read_kv(self) -> tuple[Keys, Tensor]:
        return self.dense_kv()

    def append(self, k: Tensor, v: Tensor, pos: int) -> None:
        self._append_kv(k, v)
        self.pos.append(torch.full((k.shape[0], k.shape[1], 1), pos, dtype=torch.int32, device=k.device))
        if self.logw is not None:
            self.logw.append(torch.zeros((k.shape[0], k.shape[1], 1), device=k.device))

    def keep(self, idx: Tensor) -> None:
        self._keep_kv(idx)
        self.pos = _Growable(gather_tokens(self.positions(), idx).unsqueeze(-1))
        lw = self.log_weights()
        if lw is not None:
            self.logw = _Growable(gather_tokens(lw, idx).unsqueeze(-1))

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from self._kv_tensors()
        yield "positions", self.positions()
        lw = self.log_weights()
        if lw is not None:
            yield "log_weights", lw

    # what a store provides
    @classmethod
    def from_dense(cls, layer: DenseLayer, *args: Any, **kwargs: Any) -> TokenStore:
        """The store of a dense layer's kept tokens (keyword arguments: ``ComposedStore.store_args``)."""
        raise NotImplementedError

    def dense_kv(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _append_kv(self, k: Tensor, v: Tensor) -> None:
        raise NotImplementedError

    def _keep_kv(self, idx: Tensor) -> None:
        raise NotImplementedError

    def _kv_tensors(self) -> Iterator[tuple[str, Tensor]]:
        raise NotImplementedError


# The mixin is combined with a DenseCompressor at run time (``compose``); the type checker reads it as one.
if TYPE_CHECKING:
    _MixedInto = DenseCompressor
else:
    _MixedInto = object


class ComposedStore(_MixedInto):
    """Mixin over a ``DenseCompressor``: same selection and eviction, kept tokens held in ``store``.

    A subclass sets ``store`` (a ``TokenStore`` class) and implements ``kv_bytes`` (one token's K and
    V in one layer and KV head, as stored), ``store_args(layer)`` (the keyword arguments of
    ``store.from_dense`` for one layer) and ``store_knobs`` (shown with the plan).
    """

    store: ClassVar[type[TokenStore]]

    def composing(self) -> bool:
        return not self.is_full

    def kv_bytes(self) -> int:
        raise NotImplementedError

    def store_args(self, layer: int) -> dict:
        return {}

    def store_knobs(self) -> dict:
        return {}

    def per_token_bytes(self, with_logw: bool = False) -> int:
        full = super().per_token_bytes(with_logw)
        return full - per_token_bytes(self.info) + self.kv_bytes() if self.composing() else full

    def plan(self, n_prompt: int) -> dict:
        self.fit_store(n_prompt)
        knobs = super().plan(n_prompt)
        return {**knobs, **self.store_knobs()} if self.composing() else knobs

    def fit_store(self, n_prompt: int) -> None:
        """Hook run before the inner method plans: set the store's size knobs for the budget."""

    def compress(self, state: PrefillState) -> None:
        super().compress(state)
        if self.composing():
            self.prepare_store(state)
            stores = [self.store.from_dense(layer, **self.store_args(i)) for i, layer in enumerate(self.layers)]
            self.layers = cast("list[DenseLayer]", stores)  # look-alikes: the layer methods DenseCompressor calls

    def prepare_store(self, state: PrefillState) -> None:
        """Hook run once before the dense layers are converted (e.g. to draw sketches)."""

    def kept_positions(self, layer: int) -> Tensor | None:
        cache = self.layers[layer]  # positions without decoding the keys and values
        return cache.positions() if isinstance(cache, TokenStore) else super().kept_positions(layer)


_MADE: dict[str, type] = {}


def compose(
    inner: type[DenseCompressor],
    mixin: type[ComposedStore],
    tag: str,
    class_tag: str,
    title: str,
    summary: str,
    params: tuple[Param, ...],
    **attrs,
) -> type[DenseCompressor]:
    """The class ``INNER + tag``: ``inner``'s selection with ``mixin``'s storage (made once per name)."""
    name = f"{inner.name}{tag}"
    if name not in _MADE:
        clash = {p.name for p in params} & {p.name for p in inner.params}
        if clash:
            raise TypeError(f"{name}: parameters {sorted(clash)} clash with {inner.name}'s")
        _MADE[name] = type(
            f"{inner.__name__}{class_tag}",
            (mixin, inner),
            {"name": name, "title": title, "summary": summary, "params": inner.params + params, **attrs},
        )
    return _MADE[name]


def composable(base: str, lookup: Callable[[str], type]) -> type[DenseCompressor] | None:
    """The method named ``base`` if a composition can wrap it: dense, not ``exact``, not itself composed.
    Raises ``ParamError`` when the method declares that it cannot be composed (``no_composition``)."""
    try:
        inner = lookup(base)
    except ValueError:
        return None
    if not issubclass(inner, DenseCompressor) or issubclass(inner, ComposedStore) or inner.name == "exact":
        return None
    if inner.no_composition:
        raise ParamError(f"{base} cannot be composed: {inner.no_composition}")
    return inner
