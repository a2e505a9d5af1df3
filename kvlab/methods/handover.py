"""What the exact prefill hands a method: the needs it declares and the state it compresses from.

A method says what it needs from the prefill in ``Compressor.prefill_needs(n_prompt)`` (a
``PrefillNeeds``): the last prompt queries, the attention each key received, an observer of the
prefill's attention of its last queries, statistics of the last queries before RoPE, or access to
the model for a forward pass of its own. One prefill serves every method of a comparison: it
merges all their needs and computes each thing once, only when some method asks for it
(``kvlab.engine.prefill``). ``compress(state)`` then gets a ``PrefillState`` with what was asked.

Shapes: L layers, Hq query heads, Hkv KV heads, n prompt tokens, d head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from kvlab.core.attention_ops import causal_window_probs
from kvlab.core.semantics import ModelSemantics


class WindowObserver(Protocol):
    """Sees the prefill's attention of the last ``rows`` prompt queries, one block of rows at a time."""

    rows: int

    def __call__(self, layer: int, probs: Tensor, first_pos: int) -> None:
        """probs [Hq, r, e]: queries at positions first_pos..first_pos+r-1 over keys 0..e-1 (causal)."""


@dataclass(frozen=True)
class PrefillNeeds:
    """What a method needs from the prefill (the default: nothing beyond the exact keys and values).

    query_window: ``state.queries`` holds (at least) the last w prompt queries, post-RoPE [L, Hq, w, d];
    acc_attn: ``state.acc_attn``, the attention each key received summed over all queries [L, Hq, n];
    observer: sees the prefill's attention of the last ``observer.rows`` queries as it is computed;
    query_stats: ``state.query_stats`` over the last w prompt queries, before RoPE;
    model_access: ``state.model``, a forward pass of the method's own through the model;
    out_proj: ``state.out_proj``, each layer's attention output projection W_o, read from the model.
    """

    query_window: int = 0
    acc_attn: bool = False
    observer: WindowObserver | None = None
    query_stats: int = 0
    model_access: bool = False
    out_proj: bool = False

    def __post_init__(self) -> None:
        if self.query_window < 0 or self.query_stats < 0:
            raise ValueError(
                f"prefill needs: query_window={self.query_window} and query_stats={self.query_stats} must be >= 0"
            )


@dataclass
class QueryStats:
    """Statistics of the last ``n`` prompt queries, before RoPE (positions first_pos..first_pos+n-1).

    mean: [L, Hq, d] float32; cov: [L, Hq, d, d] float32, their covariance (normalised by n).
    """

    mean: Tensor
    cov: Tensor
    n: int
    first_pos: int


class ModelAccess(Protocol):
    """The model, for a method that runs a forward pass of its own while it compresses (KVzip)."""

    prompt_ids: list[int]  # the compressed prompt's (context's) tokens

    def encode(self, text: str) -> list[int]:
        """``text`` through the model's tokenizer, no special tokens added."""
        ...

    def chat_wrap(self, user: str) -> tuple[list[int], list[int]]:
        """The chat template around a user turn whose content is ``user``: the ids (before, after) it,
        the assistant's marker included in ``after``; both empty when the model has no template."""
        ...

    def extend(self, ids: list[int], observe: Callable[[int, Tensor, Tensor], None]) -> None:
        """Run ``ids`` after the prompt on the exact prefill cache (which stays unchanged), at positions
        n..n+c-1. Per layer calls observe(layer, q [Hq, c, d] post-RoPE, k [Hkv, n + c, d] post-RoPE)
        before that layer's attention."""
        ...

    @property
    def owner(self) -> object:
        """The loaded model itself, one object per model: a key for what a method computes once per model
        (held weakly)."""
        ...

    def prefill(self, ids: list[int], needs: PrefillNeeds) -> PrefillState:
        """The exact prefill of another text ``ids`` (a calibration text, not the prompt), with ``needs``
        captured as for a prompt; its ``state.model`` (with ``model_access``) extends that text."""
        ...


@dataclass
class PrefillState:
    """What one exact prefill hands to every compressor.

    keys, values: [L, Hkv, n, d] post-RoPE; queries: [L, Hq, w, d], the last w prompt queries
    (post-RoPE; w the largest ``query_window`` asked); acc_attn: [L, Hq, n] attention each key
    received summed over all prompt queries; query_stats, model: see ``PrefillNeeds`` (each None
    unless a method asked for it); out_proj: per layer, the attention's output projection as a view of
    the model's weight, [hidden, Hq, dv] (query head h's block W_o[:, h] maps its output [dv] into the
    residual stream), when a method asked for it and the model has one kvlab can read (else None).
    ``query_stats`` is over the largest window asked; ``query_stats_by_window`` holds one ``QueryStats``
    per distinct window asked (read it through ``stats_over(w)``): two methods asking for different
    windows each get their own.

    ``next_position``: None after a prefill (the next token is at position n). A state built from a
    running cache while decoding (``decoding-NAME``, ``kvlab.methods.decoding``) sets it to the true
    position of the next token: its n kept tokens are then not positions 0..n-1, and its
    ``query_stats`` are over the queries it holds, however many (``stats_over`` returns them).
    ``memo`` holds what methods computed from this prefill independently of their budget
    (``PromptScored.shared``).
    """

    keys: Tensor
    values: Tensor
    queries: Tensor
    scaling: float
    acc_attn: Tensor | None = None
    semantics: ModelSemantics | None = None  # per layer: window, soft-cap, sinks (None: plain attention)
    query_stats: QueryStats | None = None
    model: ModelAccess | None = None
    query_stats_by_window: dict[int, QueryStats] = field(default_factory=dict)
    next_position: int | None = None
    out_proj: tuple[Tensor, ...] | None = None
    # what a method computed from this prefill that its budget does not change, by a key naming the method and
    # what the result depends on (``PromptScored.shared``): a comparison's budgets compute it once
    memo: dict[tuple, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[-2]

    @property
    def next_pos(self) -> int:
        """The true position of the next token: n after a prefill, ``next_position`` on a running state."""
        return self.n_tokens if self.next_position is None else self.next_position

    def stats_over(self, w: int) -> QueryStats:
        """The query statistics over exactly the last ``w`` prompt queries (``PrefillNeeds.query_stats=w``):
        each distinct window a method asked for is computed on its own. Raises when the prefill computed
        none over that window, so a method never reads statistics of another window than its own. A running
        state (``next_position`` set) returns the statistics of the queries it holds."""
        if self.next_position is not None and self.query_stats is not None:
            return self.query_stats
        stats = self.query_stats_by_window.get(w)
        if stats is None and self.query_stats is not None and self.query_stats.n == w:
            stats = self.query_stats  # a state built by hand with one window
        if stats is None or stats.n != w or stats.first_pos != self.n_tokens - w:
            have = sorted(self.query_stats_by_window) or ([self.query_stats.n] if self.query_stats else [])
            raise LookupError(
                f"the prefill computed no query statistics over the last {w} prompt queries "
                f"(windows computed: {have or 'none'}); ask for them in prefill_needs (query_stats={w})"
            )
        return stats

    def window_probs(self, w: int | None = None) -> Tensor:
        """Causal attention of the last ``w`` prompt queries over the prompt: [L, Hq, w, n]."""
        q = self.queries if w is None else self.queries[..., -w:, :]
        return causal_window_probs(q, self.keys, self.semantics or self.scaling)


__all__ = ["ModelAccess", "PrefillNeeds", "PrefillState", "QueryStats", "WindowObserver"]
