"""TOVA (Token Omission Via Attention): drop the token the current query attends to least.

Oren, Hassid, Yarden, Adi, Schwartz. "Transformers are Multi-State RNNs", EMNLP 2024,
https://arxiv.org/abs/2401.06104 — the TOVA policy: a layer's cache (its "multi-state") holds at
most ``m`` tokens; at every step, once the cache is over ``m``, the token with the lowest attention
weight from the current query, averaged over all the layer's heads, is dropped. One decision per
layer: every head keeps the same tokens. The prompt is treated the same way: the reference code
(github.com/schwartz-lab-NLP/TOVA, ``TOVACache.reduce``) encodes it in one pass and keeps the
``m`` tokens the last prompt query attends to most (heads averaged).

kvlab specifics (the same policy, step for step):

* kvlab's ``capacity`` counts the token being attended as well, so TOVA's multi-state size is
  ``m = capacity - 1``: the cache never holds more than ``capacity`` tokens, even while attending.
  A step's eviction happens when the next token is appended (before its query attends), from the
  scores the previous query left, with the new token protected; the set each query attends to is
  the reference's, step for step (the test checks it against the reference loop).
* Those scores (the last query's head-averaged attention, one float32 per kept token and KV head)
  are held between steps and counted in the bytes and the budget.
* The prefill keeps the ``m`` best prompt tokens by the last prompt query's attention (through
  ``capacity - 1`` others plus the last prompt token, which the first append may then drop).
"""

from __future__ import annotations

from torch import Tensor

from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.scored import ScoredEvictionCompressor


class TOVA(ScoredEvictionCompressor):
    name = "tova"
    title = "TOVA"
    group = "recent"
    paper = "Oren et al., Transformers are Multi-State RNNs, EMNLP 2024 (arXiv:2401.06104)"
    summary = (
        "Keeps the tokens the current query attends to most (averaged over the layer's heads); "
        "drops the least attended one at every step."
    )

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return PrefillNeeds(query_window=1)  # the last prompt query ranks the prompt

    def plan_tokens(self, n_prompt: int) -> dict:
        self.set_full(self.is_full)
        self.capacity = self.tokens_for_budget(n_prompt)
        self.recent = 1  # the token just appended: it has no attention score yet
        return {"capacity": self.capacity, "multi_state": self.capacity - 1}

    def initial_scores(self, state: PrefillState) -> tuple[Tensor, Tensor]:
        """The last prompt query's attention [L, Hq, n], averaged over all heads, for every KV head."""
        last = state.window_probs(1)[..., -1, :].float().mean(1, keepdim=True)  # [L, 1, n]
        scores = last.expand(-1, self.info.n_kv_heads, -1)
        return scores, scores

    def observe(self, layer: int, attn: Tensor) -> None:
        """This step's attention [Hkv, n] (each KV group's mean) replaces the scores: its mean over all heads."""
        self.scores[layer].copy_(attn.mean(0, keepdim=True).expand_as(attn))
