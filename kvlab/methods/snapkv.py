"""SnapKV: prompt tokens scored by the attention of the prompt's last window of queries.

Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen. "SnapKV: LLM Knows What You are
Looking for Before Generation", NeurIPS 2024, https://arxiv.org/abs/2404.14469 — Sec. 4
(Algorithm / Listing 1): the last ``window`` prompt queries (the observation window) vote for the
prefix tokens with their attention weights, summed over the window; the votes are smoothed with a
1-D pooling of kernel ``kernel`` (max-pool, kernel 7 in the paper) so that the neighbours of a
selected token come along; the top ``capacity - window`` prefix tokens per KV head are kept
together with the window itself. With grouped-query attention the votes of the query heads of
a KV group are summed (the cache is per KV head). Prefill-only: generated tokens are all kept.
"""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from kvlab.core.attention_ops import pool_heads
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored


def snap_scores(state: PrefillState, window: int, kernel: int, pooling: str, n_kv_heads: int) -> Tensor:
    """SnapKV votes of the last ``window`` queries for every prefix token: [L, Hkv, n - window].

    Attention [L, Hq, w, n] (causal, softmax over the whole prompt) -> ``window_votes``.
    """
    probs = state.window_probs(window)  # [L, Hq, w, n]
    return window_votes(probs, state.n_tokens - window, kernel, pooling, n_kv_heads)


def window_votes(probs: Tensor, n_prefix: int, kernel: int, pooling: str, n_kv_heads: int) -> Tensor:
    """Votes of an observation window for the first ``n_prefix`` keys: [L, Hkv, n_prefix].

    probs [L, Hq, w, m] (m >= n_prefix keys) -> the prefix columns -> sum over the window -> 1-D
    pooling along tokens (stride 1, same length) -> sum over each GQA group.
    """
    votes = probs[..., :n_prefix].sum(-2)  # [L, Hq, n_prefix]
    if kernel > 1:
        lead = votes.shape[:-1]
        flat = votes.reshape(-1, 1, votes.shape[-1])
        pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
        # odd kernels keep the length with padding k//2; even ones need one column trimmed
        flat = pool(flat, kernel, stride=1, padding=kernel // 2)[..., : votes.shape[-1]]
        votes = flat.reshape(*lead, -1)
    return pool_heads(votes, n_kv_heads, head_dim=-2)


class SnapKV(PromptScored):
    name = "snapkv"
    title = "SnapKV"
    group = "baseline"
    paper = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024 (arXiv:2404.14469)"
    summary = "Keeps the prompt tokens the last window of prompt queries attends to most (pooled), plus that window."
    params: ClassVar[tuple[Param, ...]] = (
        Param("window", 32, "observation window: the last prompt queries that vote (kept as well)", minimum=1),
        Param("kernel", 7, "1-D pooling kernel over the votes (1: no pooling)", minimum=1),
        Param("pooling", "max", "pooling of the votes", choices=("max", "avg")),
    )

    capacity: int  # set by plan: tokens per layer and KV head kept (window included)
    full: bool  # set by plan: no budget, every token kept

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        """The observation window: the last ``window`` prompt queries."""
        return PrefillNeeds(query_window=int(self.cfg["window"]))

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n - window] votes of the observation window for the prefix tokens."""
        c = self.cfg
        return snap_scores(state, self.window, int(c["kernel"]), c["pooling"], self.info.n_kv_heads)
