"""DMS in its dense, threshold form: a prompt-time scorer's tokens below one threshold are evicted, in every
layer and head, a recent sliding window spared.

Łańcucki, Staniszewski, Nawrot, Ponti. "Inference-Time Hyper-Scaling with KV Cache Compression" (Dynamic
Memory Sparsification, DMS), arXiv:2506.05345: a trained per-head predictor decides which tokens to
evict, each eviction delayed until the token leaves a sliding window. kvpress's ``DMSPress`` keeps the
inference rule without the training: any scorer press scores the tokens, and those whose score falls
below a fixed ``threshold`` are evicted once they are older than ``sliding_window_size`` tokens (128). One
threshold for the whole model: layers and heads keep what their scores earn, so their counts differ.

Here it wraps any method that ranks the prompt (``ranks_prompt``; kvpress benchmarks ``DMSPress`` only with
its trained KVzap scorers, out of scope here): ``dms-snapkv`` is registered, ``dms-NAME`` is made on demand.
The scorer plans and ranks (``ranking``); then

1. every head keeps what the scorer always keeps (its sinks, its window) and the last ``sliding_window``
   prompt tokens;
2. the threshold is the budget's: of every other ranked token of every layer and KV head, the best-scored
   are kept until the scorer's total is spent (one global ranking: the score of the last one kept is the
   threshold); a ``threshold`` given keeps no token scored below it, within the same total. A chunked
   layer's share beyond what its last prompt query sees stays its own: its block's tokens while decoding.

The heads then hold different counts (``ragged``: each head's int32 count is held and counted); the total
is the scorer's, so the bytes are its own plus the counts.

Deviations:

* The budget picks the threshold (kvpress's benchmarks set it by hand); a given threshold caps, within
  the budget, what is kept.
* Prefill only: kvpress's ``decoding`` option (re-score and evict while generating) is not implemented;
  generated tokens are all kept.
* The sliding window shrinks to the scorer's per-head capacity (less the tokens it always keeps at the
  start) when the budget holds fewer tokens than it.
* Scores are compared across layers as the scorer gives them (SnapKV's votes are attention mass, alike in
  every layer; a scorer whose scale changes with the layer gives its layers uneven shares).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillState
from kvlab.methods.held_scorer import HeldScorer, ScorerWrapper, scorer_resolver
from kvlab.methods.params import Param
from kvlab.methods.ragged import RaggedCompressor

PREFIX = "dms-"
PAPER = "Łańcucki et al., Inference-Time Hyper-Scaling with KV Cache Compression (DMS), 2025 (arXiv:2506.05345)"
PARAMS = (
    Param("sliding_window", 128, "last prompt tokens never evicted (kvpress's sliding_window_size)", minimum=0),
    Param(
        "threshold",
        None,
        "no token scored below it is kept (none: the budget's threshold, one for all layers and heads)",
        kind=float,
    ),
)


def global_top(scores: Tensor, total: int) -> Tensor:
    """[...] bool: the ``total`` best of ``scores`` (any shape; -inf never kept), one ranking over all of them."""
    flat = scores.flatten()
    k = min(total, int(torch.isfinite(flat).sum()))
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if k > 0:
        keep[torch.sort(flat, descending=True, stable=True).indices[:k]] = True
    return keep.view(scores.shape)


class DMS(RaggedCompressor, HeldScorer):
    """DMS's threshold over a prompt-time scorer it holds (``scorer``; see the module docstring).
    ``thresholded(Inner)`` is the wrapper the registry lists for ``dms-NAME``."""

    params = PARAMS

    def window(self, n_prompt: int, head: int = 0) -> int:
        """The sliding window: ``sliding_window``, at most the scorer's per-head capacity less ``head``."""
        return max(0, min(int(self.cfg["sliding_window"]), self.scorer.planned_tokens(n_prompt) - head, n_prompt))

    def own_knobs(self, n_prompt: int) -> dict:
        return {"sliding_window": self.window(n_prompt), "threshold": self.cfg["threshold"]}

    caps: list[int] | None = None  # set by keep_mask: each layer's tokens per head, as the scorer planned them

    def layer_plan(self, keep: Tensor) -> list[int]:
        """Each layer's share as the scorer planned it (a head's count differs from it by the threshold)."""
        return super().layer_plan(keep) if self.caps is None else self.caps

    def keep_mask(self, state: PrefillState) -> Tensor | None:
        rank = self.scorer.ranking(state)
        if rank is None:
            self.caps = None
            return None
        n, n_layers, h = state.n_tokens, state.keys.shape[0], self.info.n_kv_heads
        dev = state.keys.device
        w = max(rank.tail, self.window(n, rank.head))
        pos = torch.arange(n, device=dev)
        protected = (pos < rank.head) | (pos >= n - w)  # [n]
        firsts = torch.tensor([self.sem[i].visible_from(n - 1) for i in range(n_layers)], device=dev)
        visible = pos[None, :] >= firsts[:, None]  # [L, n]
        held = (protected[None] & visible).sum(-1)  # [L]: protected tokens each layer's heads hold
        caps = torch.tensor([rank.head + b + rank.tail for b in rank.budgets], device=dev)
        self.caps = caps.tolist()
        # the scorer's total less what every head keeps anyway; a local layer's share beyond what its last query
        # sees is its growth inside its block while decoding (``layer_plan``), not the other layers'
        usable = caps.minimum(n - firsts)
        total = max(0, int((h * (usable - held)).sum()))
        m = rank.scores.shape[-1]
        span = pos[rank.start : rank.start + m]
        candidate = ~protected[span][None] & visible[:, span]  # [L, m]
        scores = rank.scores.float().masked_fill(~candidate[:, None, :], -math.inf)
        if self.cfg["threshold"] is not None:
            scores = scores.masked_fill(scores < float(self.cfg["threshold"]), -math.inf)
        keep = protected[None, None, :].expand(n_layers, h, n).clone()
        keep[..., rank.start : rank.start + m] |= global_top(scores, total)
        return keep


def thresholded(inner: type[DenseCompressor], **inner_defaults: Any) -> ScorerWrapper:
    """``dms-NAME``: ``inner``'s scores under one threshold for all layers and heads, a sliding window spared."""
    return ScorerWrapper(
        inner,
        PREFIX + inner.name,
        title=f"DMS-{inner.title}",
        summary=f"{inner.title}'s scores against one threshold over all layers and KV heads (set by the budget), "
        "the last 128 prompt tokens spared; heads keep what their scores earn.",
        own_params=PARAMS,
        group="recent",
        paper=PAPER,
        inner_defaults=tuple(inner_defaults.items()),
        cache=DMS,
    )


# ``dms-NAME`` for a method that ranks the prompt -> its wrapper; else None
resolve = scorer_resolver(PREFIX, thresholded)
