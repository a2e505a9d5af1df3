"""Compositions: an eviction method whose kept tokens are stored compressed.

Any method built on ``DenseCompressor`` (except ``exact``) can be wrapped: ``snapkv+kivi2``,
``streaming+qjl``. A composition (``Composition``, a ``wrapped.Wrapper``) holds the inner method and
a storage (``Storage``); the instance it makes is the inner method holding that storage as its
``TokenStorage``. The method chooses and evicts tokens exactly as it does alone; after it compresses,
its dense layers go to the storage, which holds the kept tokens compressed (plus the method's
positions / log-weights, as it holds them) and reads them back as dense keys and values, so the
method's attention, the probabilities it scores tokens with and its ``keep(idx)`` evictions work
unchanged. The byte budget pays for the stored size of a token (``DenseCompressor.per_token_bytes``
asks the storage), so the method keeps more tokens at the same memory. Budget 1.0 is no compression
(the inner method as it is, i.e. the exact cache).

This module holds what every composition shares: the per-layer store (``TokenStore``), the storage
base (``Storage``), the wrapper (``Composition``), ``composable`` and the per-token quantized codes.
Each storage lives in its own module with its paper: ``with_kivi.py`` (``METHOD+kiviB``) and
``with_qjl.py`` (``METHOD+qjl``); each has a resolver the registry lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from kernels.quant import QuantizedGroups, packed_bytes, quantize_groups
from kernels.tensor_ops import gather_tokens
from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.core.semantics import Keys
from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor, KeptTokens, _Growable
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param, ParamError
from kvlab.methods.wrapped import Wrapper


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


# ----- the shared machinery: a per-layer store, the storage that makes it, the wrapper ------------
@dataclass
class TokenStore:
    """What every compressed store keeps besides K and V: positions [Hkv, n, 1] and optional log-weights.

    A subclass holds the same tokens as a ``DenseLayer`` (``KeptTokens``: ``n``, ``views``, ``append``,
    ``keep``, ``tensors``): it adds its K/V storage through ``dense_kv``, ``_append_kv``, ``_keep_kv``
    and ``_kv_tensors``.
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
    def dense_kv(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _append_kv(self, k: Tensor, v: Tensor) -> None:
        raise NotImplementedError

    def _keep_kv(self, idx: Tensor) -> None:
        raise NotImplementedError

    def _kv_tensors(self) -> Iterator[tuple[str, Tensor]]:
        raise NotImplementedError


class Storage:
    """A composition's storage of one method instance's kept tokens (the method's ``TokenStorage``).

    A subclass sets ``params`` (its own, beside the method's) and implements ``kv_bytes`` (one token's K
    and V in one layer and KV head, as stored), ``store(layer, dense)`` (the ``TokenStore`` of one
    compressed dense layer) and ``knobs``; optionally ``fit`` (size knobs for the budget, before the
    method plans), ``prepare`` (once before the layers are stored), ``fixed_bytes`` and the tensors.
    """

    params: ClassVar[tuple[Param, ...]] = ()

    def __init__(self, method: DenseCompressor, cfg: dict, **args: Any):
        self.method, self.cfg, self.info = method, cfg, method.info

    def fit(self, n_prompt: int) -> None:
        """Before the method plans: set the storage's size knobs for the budget."""

    def kv_bytes(self) -> int:
        raise NotImplementedError

    def fixed_bytes(self) -> float:
        return 0.0

    def knobs(self) -> dict:
        return {}

    def prepare(self, state: PrefillState) -> None:
        """Once before the method's dense layers are stored (e.g. to draw sketches)."""

    def store(self, layer: int, dense: KeptTokens) -> TokenStore:
        raise NotImplementedError

    def stored(self, state: PrefillState, layers: list[KeptTokens]) -> list[KeptTokens]:
        self.prepare(state)
        return [self.store(i, dense) for i, dense in enumerate(layers)]

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())


@dataclass(frozen=True)
class Composition(Wrapper):
    """``INNER + tag``: the inner dense method's selection, its kept tokens held by ``storage``."""

    storage: type[Storage] = Storage
    storage_args: tuple[tuple[str, Any], ...] = ()  # fixed arguments of the storage (e.g. KIVI's bits)

    def make(self, info: ModelInfo, budget: Budget | None, params: dict, own: dict, seed: int) -> Compressor:
        comp = self.inner(info, budget, params, seed=seed)
        assert isinstance(comp, DenseCompressor)  # ``composable`` admits dense methods only
        comp.name = self.name  # the storage's messages name the composition
        comp.storage = self.storage(comp, own, **dict(self.storage_args))
        return comp


def composable(base: str, lookup: Callable[[str], Any]) -> type[DenseCompressor] | None:
    """The method named ``base`` if a composition can wrap it: dense, not ``exact``, not itself a wrapper.
    Raises ``ParamError`` when the method declares that it cannot be composed (``no_composition``)."""
    try:
        inner = lookup(base)
    except ValueError:
        return None
    if inner.no_composition:
        raise ParamError(f"{base} cannot be composed: {inner.no_composition}")
    if not isinstance(inner, type) or not issubclass(inner, DenseCompressor) or inner.name == "exact":
        return None
    return inner
