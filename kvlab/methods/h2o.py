"""H2O: heavy hitters plus a recent window, scored by accumulated attention.

Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Ré, Barrett, Wang, Chen. "H2O: Heavy-Hitter
Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023,
https://arxiv.org/abs/2306.14048 — the greedy eviction policy (Sec. 4, Algorithm 1): each token's
score is the attention it has received, summed over every query so far; the cache keeps the
``recent`` most recent tokens plus the highest-scoring others (the heavy hitters), and while
decoding it evicts one token per new token, the lowest-scoring one outside the recent window,
after adding each step's attention to the scores. The paper splits the budget half heavy hitters,
half recent tokens.

kvlab specifics: with grouped-query attention the score of a token in one KV head is the sum over
that group's query heads, at prefill and at every decode step. Scores are float32, one per kept token, and count
towards the bytes and the budget.
"""

from __future__ import annotations

from kvlab.core.attention_ops import pool_heads
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import ScoredEvictionCompressor


class H2O(ScoredEvictionCompressor):
    name = "h2o"
    title = "H2O"
    group = "baseline"
    paper = (
        "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, "
        "NeurIPS 2023 (arXiv:2306.14048)"
    )
    summary = (
        "Keeps the tokens with the most accumulated attention (heavy hitters) plus a recent window; "
        "evicts one per new token."
    )
    params = (
        Param(
            "heavy_ratio",
            0.5,
            "share of the token budget given to heavy hitters (the rest: recent window)",
            minimum=0.0,
            maximum=1.0,
        ),
    )

    def plan_tokens(self, n_prompt: int) -> dict:
        self.set_full(self.is_full)
        self.capacity = self.tokens_for_budget(n_prompt)
        heavy = int(round(self.cfg["heavy_ratio"] * self.capacity))
        self.recent = self.capacity - heavy
        return {"capacity": self.capacity, "heavy": heavy, "recent": self.recent}

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        """The attention each prompt token received, summed over every prompt query (the initial scores)."""
        return PrefillNeeds(acc_attn=True)

    def initial_scores(self, state: PrefillState):
        """Accumulated prompt attention summed over each KV group ([L, Hq, n] -> [L, Hkv, n]), twice:
        it both ranks the prompt tokens and is what the survivors keep accumulating onto."""
        if state.acc_attn is None:
            raise ValueError(f"{self.name} needs the prefill's accumulated attention (needs_acc_attn)")
        acc = pool_heads(state.acc_attn.float(), self.info.n_kv_heads, head_dim=-2, reduce="sum")
        return acc, acc

    def observe(self, layer: int, attn) -> None:
        self.scores[layer] += attn * self.info.group_size
