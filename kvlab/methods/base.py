"""The compressor contract: what every KV-cache method implements (docs/design.md §7).

A compressor is one method at one budget for one run. The engine calls, in order:

1. ``plan(n_prompt)``, through ``budget_search.planned`` — map the budget onto the method's knobs
   (returned, and shown with results); a plan that cannot hold the budget even at the method's most
   degraded setting is refused (``BudgetRefused``, naming the smallest budget it honours);
2. ``prefill_needs(n_prompt)`` — what the method needs from the one exact prefill every method
   shares (``handover.PrefillNeeds``: last queries, accumulated attention, query statistics...);
3. ``compress(state)`` — build the compressed cache from that prefill (all layers at once:
   ``state.keys`` is ``[L, Hkv, n, d]``; ``handover.PrefillState``);
4. per decode step and layer: ``append(layer, k, v, pos)`` with the new token's key/value
   ``[Hkv, 1, d]`` (post-RoPE), then ``attend(layer, q)`` with the query ``[Hq, 1, d]``, returning
   the attention output ``[Hq, 1, d]``. Streaming methods evict inside these calls.
   A question asked after compression (the query-agnostic protocol) comes as one chunk of c
   tokens per layer: ``feed(layer, q, k, v, pos)`` (q ``[Hq, c, d]``, k/v ``[Hkv, c, d]`` at true
   positions pos..pos+c-1) returns ``[Hq, c, d]``, exactly what feeding the c tokens one by one
   through ``append`` + ``attend`` gives (the default does just that).
5. ``tensors()`` at any time lists every tensor the method holds; bytes are counted from them.

``compress``, ``append``, ``attend`` and ``tensors`` are required; every other hook has a default.
Capabilities are declared on the class, never probed: ``streaming``, ``wants_probs``, ``attend_many``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.attention_ops import tensor_bytes
from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param, resolve

DEFAULT_HORIZON = 4096  # decode steps a plan holds its budget for when the engine did not say (max_new_tokens' cap)


def _bytes_by_kind(tensors: Iterator[tuple[str, Tensor]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, t in tensors:
        out[kind] = out.get(kind, 0) + tensor_bytes(t)
    return out


class BatchAttend(Protocol):
    """``attend`` for the rows of one class in one call: ``comps`` (R caches of that class), q [R, Hq, 1, d]
    -> R outputs [Hq, 1, d], each what ``comps[i].attend(layer, q[i])`` returns."""

    def __call__(self, comps: list[Any], layer: int, q: Tensor) -> list[Tensor]: ...


class Compressor(ABC):
    """Base class of every method: set the class attributes, implement the four required methods,
    override the optional hooks that the method needs."""

    name: str = ""  # an instance made by a wrapper (``snapkv+kivi2``) carries the wrapper's name and title
    title: str = ""
    group: ClassVar[str] = "baseline"  # "paper": the four papers' methods; "recent": newer methods; "reference": exact
    paper: ClassVar[str] = ""  # citation with link
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()
    streaming: ClassVar[bool] = False  # holds its budget while decoding (else generated tokens are kept)
    # hand each decode step's attention [Hq, 1, n] over the cache to ``after_attend`` (dense caches);
    # a class default that an instance may turn off (an eviction that evicts nothing)
    wants_probs: bool = False
    # optional: a static method attending every row of this class in one lockstep call (QJL, KIVI);
    # None: each row attends through its own ``attend``. A subclass that overrides ``attend`` sets it
    # anew (None, or its own), so that the call always describes the class's ``attend``
    attend_many: ClassVar[BatchAttend | None] = None
    # why this method cannot hold a sliding-window layer ("" : it can; it is then refused on such models)
    no_local_layers: ClassVar[str] = ""
    # why this method needs values of the key's head size ("": it does not; refused on models where they differ)
    no_value_head_size: ClassVar[str] = ""
    # why a composition (``METHOD+kivi2``, ``METHOD+qjl``) cannot wrap this method ("": it can)
    no_composition: ClassVar[str] = ""
    # tokens the cache no longer holds exactly still stand in what it keeps (clusters, merged values, sample
    # weights): the retention map shows them as summarized, not evicted (``kvlab.measure.retention``)
    summarizes: ClassVar[bool] = False

    decode_steps: int | None = None  # decode steps the plan must hold its budget for (the engine sets it)

    def __init__(self, info: ModelInfo, budget: Budget | None = None, params: dict | None = None, seed: int = 0):
        self.info = info
        self.budget = budget
        self.params_given = dict(params or {})
        self.cfg = self.resolve_params(params or {})
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.sem = info.semantics  # per layer: scaling, window, soft-cap, sinks (``kvlab.core.semantics``)
        self.scaling = self.sem[0].scaling
        self.cache_dtype = info.torch_cache_dtype  # full-precision K/V are stored in this (16-bit by default)
        # what made this instance: its class, or the wrapper that holds it (``wrapped.Wrapper``)
        self.made_by: Callable[..., Compressor] = type(self)

    def remade(self, budget: Budget | None) -> Compressor:
        """A fresh copy of this method (same parameters, seed and horizon) at another budget."""
        c = self.made_by(self.info, budget, self.params_given, seed=self.seed)
        c.decode_steps = self.decode_steps
        return c

    @property
    def is_full(self) -> bool:
        """No budget, or a budget of the whole exact cache: the method keeps everything."""
        return self.budget is None or self.budget.is_full

    def as_cached(self, x: Tensor) -> Tensor:
        """``x`` as the cache stores full-precision keys and values: contiguous, in the cache dtype."""
        return x.to(self.cache_dtype).contiguous()

    # ----- configuration -------------------------------------------------------------------
    @classmethod
    def defaults(cls) -> dict:
        return {p.name: p.default for p in cls.params}

    @classmethod
    def resolve_params(cls, overrides: dict) -> dict:
        return resolve(cls.name, cls.params, overrides)

    def plan(self, n_prompt: int) -> dict:
        """Map the budget onto knobs (updating ``self.cfg``); return the knobs chosen.

        A method degrades its knobs (smaller window, sketch, ...) until the plan fits the budget; the
        engine refuses what cannot fit even then (``budget_search.planned``, from ``budget_ratio``)."""
        return {}

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        """After ``plan``: what ``compress`` needs from the prefill of ``n_prompt`` tokens (default: nothing
        beyond the exact keys and values). Called once per prefill; an observer it returns is fresh."""
        return PrefillNeeds()

    def check_semantics(self) -> None:
        """Raise ``UnsupportedAttention`` (one line) when this method cannot compute the model's attention."""
        if self.no_local_layers and self.sem.has_local:
            raise sm.UnsupportedAttention(
                f"{self.name} cannot run on a model with sliding-window layers: {self.no_local_layers}"
            )
        if self.no_value_head_size and self.sem.v_dim != self.sem[0].k_dim:
            raise sm.UnsupportedAttention(
                f"{self.name} cannot run on a model whose value heads differ in size from its key heads: "
                f"{self.no_value_head_size}"
            )

    # ----- holding the budget (checked by ``budget_search``) ---------------------------------
    def horizon(self, n_prompt: int) -> int:
        """Decode steps the plan must hold its budget for: ``decode_steps``, else up to the model's context."""
        steps = DEFAULT_HORIZON if self.decode_steps is None else self.decode_steps
        return max(0, min(steps, self.info.max_positions - n_prompt))

    def reach(self, layer: int, n_prompt: int) -> int:
        """The most tokens per KV head ``layer`` may need to hold for what its queries see, over the plan's
        horizon (``LayerSemantics.reach``): a chunked layer sees only its current block, so a plan gives what
        such a layer cannot use to the others, as it does a sliding window's."""
        return self.sem[layer].reach(n_prompt, self.horizon(n_prompt))

    def allowed(self, n_prompt: int, steps: int = 0) -> float:
        """Bytes the budget allows after ``steps`` decode steps (``Budget.allowed_bytes``)."""
        assert self.budget is not None, f"{self.name} has no budget"
        return self.budget.allowed_bytes(self.info, n_prompt, steps, self.streaming)

    def budget_ratio(self, n_prompt: int) -> float | None:
        """After ``plan``: the largest ratio of the bytes the plan will hold to the bytes its budget
        allows, after prefill and at any decode step up to ``horizon`` (None: not predicted)."""
        return None

    # ----- the cache (required) ------------------------------------------------------------
    @abstractmethod
    def compress(self, state: PrefillState) -> None:
        """Build the cache from the shared exact prefill, vectorized over layers and heads."""

    @abstractmethod
    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        """Take the new tokens k, v [Hkv, m, d] (post-RoPE) at true positions pos..pos+m-1."""

    @abstractmethod
    def attend(self, layer: int, q: Tensor) -> Tensor:
        """The attention output [Hq, 1, d] of the query q [Hq, 1, d] (post-RoPE) over this cache."""

    @abstractmethod
    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor this cache holds, as (kind, tensor); bytes are counted from these."""

    # ----- optional hooks ------------------------------------------------------------------
    def after_attend(self, layer: int, probs: Tensor) -> None:  # noqa: B027 - an optional hook: nothing by default
        """Hook for streaming eviction: ``probs`` [Hq, 1, n] is this step's attention over the cache."""

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c new tokens, causal inside the chunk: q [Hq, c, d], k/v [Hkv, c, d] -> out [Hq, c, d].

        Token i is appended at true position ``pos + i``, then its query attends: the same calls, in
        the same order, as c decode steps, so streaming eviction and running scores stay exact.
        """
        outs = []
        for i in range(q.shape[-2]):
            self.append(layer, k[:, i : i + 1], v[:, i : i + 1], pos + i)
            outs.append(self.attend(layer, q[:, i : i + 1]))
        return torch.cat(outs, dim=-2)

    def kept_positions(self, layer: int) -> Tensor | None:
        """Token positions this layer keeps at full resolution, [Hkv, n] (None if not position-based)."""
        return None

    # ----- measurement --------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for _, t in self.tensors())

    def nbytes_by_kind(self) -> dict[str, int]:
        return _bytes_by_kind(self.tensors())

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Per-model state that one copy of serves every sequence (QJL's random sketches), as (kind, tensor).

        Not part of ``tensors``/``nbytes`` (the bytes a sequence holds) unless the method is told to count
        it per sequence; shown apart as "shared across sequences"."""
        return iter(())

    def shared_nbytes_by_kind(self) -> dict[str, int]:
        return _bytes_by_kind(self.shared_tensors())

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """The method's own attention weights for one query, by token position (for the attention maps).

        q [Hq, 1, d] (post-RoPE). Returns [Hq, n] over positions 0..n-1 (every token seen so far; 0
        where nothing stands for a position), each row summing to 1; None when the cache has no
        per-token estimate.
        """
        return None


__all__ = ["BatchAttend", "Compressor"]
