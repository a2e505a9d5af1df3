"""CaM: the value of each token leaving the cache merged into the values of the tokens after it.

Zhang, Du, Luo, Zhong, Zhang, Liu, Ji. "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML
2024, PMLR 235:58840-58850, https://proceedings.mlr.press/v235/zhang24n.html (OpenReview LCTmppB165;
the authors' code: github.com/zyxxmu/cam). Evicting a token perturbs every later attention output;
CaM lowers the perturbation by merging the evicted token's value into the values that stay. The cache
is the one the authors' code builds CaM on, StreamingLLM's: the first tokens (``start``) and a recent
window. At each decode step, once the cache is full, the oldest token of the window is the next to go:

1. its merge set M is the ``merge_budget`` (m) tokens right after it (the window's oldest ones);
2. per KV head, it is merged with probability p = clamp(A_e / mean_{j in M} A_j, 0, 1), where A is
   the attention the current query paid (each KV group's query heads averaged): a token attended as
   much as its neighbours is always merged, one they outweigh seldom;
3. if it is (a Bernoulli draw of p, from the run's seeded generator), each value of M takes 1/|M| of
   its value: v_j <- v_j + v_e / |M|; then the token is evicted as StreamingLLM evicts it.

Keys are never merged: a merged token is still found by its neighbours' keys. The decision of a step
uses that step's attention, so it is taken right after the step's query attended and the values of M
change then; the token itself leaves when the next token is appended (the cache holds ``capacity``
tokens while the next query attends, as StreamingLLM's). The first such token after the prefill is
decided with the last prompt query's attention.

Defaults are the authors': m = 32 (``utils_hh/modify_llama_cam.py``), the cache split equally
between the start and the window (their runs set ``start_ratio`` = ``recent_ratio``).

Deviations:

* The authors' code merges one token per step and divides its value by m whatever the size of M
  (near the end of the window M can be shorter); here by |M|, so the value's whole mass is merged.
  kvpress's ``CAMPress`` also divides by the tokens M really has.
* Their code averages the attention over the window after the evicted token for p (the per-step
  version) or over M with attention accumulated since the prompt (the streaming version, m = 16);
  here over M with the current query's attention, the paper's description.
* The prompt's tokens between the start and the window are dropped at prefill without merging, as the
  authors' code does (its merge runs from the first decode step); kvpress's ``CAMPress`` merges only
  while decoding too.
* Positions are kept (kvlab never re-assigns them); the authors' streaming runs shift positions.

Bytes: StreamingLLM's (keys, values, the two counts); nothing is held between steps for the merge.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import pooled_step_attention
from kvlab.methods.streaming import StreamingLLM


def merge_probability(attn: Tensor, evicted: int, merge_set: slice) -> Tensor:
    """[Hkv] p = clamp(A_e / mean(A over the merge set), 0, 1) from one query's attention ``attn`` [Hkv, n];
    0 where both are 0, 1 where the set got no attention and the evicted token some."""
    mean = attn[:, merge_set].float().mean(-1)
    p = attn[:, evicted].float() / mean
    return torch.nan_to_num(p, nan=0.0, posinf=1.0).clamp(0.0, 1.0)


class CaM(StreamingLLM):
    name = "cam"
    title = "CaM"
    group = "recent"
    summarizes = True  # an evicted token's value is merged into the tokens after it
    paper = (
        "Zhang et al., CaM: Cache Merging for Memory-efficient LLMs Inference, ICML 2024 "
        "(proceedings.mlr.press/v235/zhang24n)"
    )
    summary = (
        "StreamingLLM's start and recent window; the value of each token leaving the window is merged, with a "
        "probability from its attention, into the values of the m tokens after it."
    )
    params = (
        Param("start_share", 0.5, "share of the cache kept for the first tokens (authors' runs: start = recent)",
              minimum=0.0, maximum=1.0),
        Param("merge_budget", 32, "m: tokens after the evicted one its value is merged into (authors: 32)", minimum=1),
    )  # fmt: skip

    def plan_tokens(self, n_prompt: int) -> dict:
        cap = self.tokens_for_budget(n_prompt)
        sink = min(int(float(self.cfg["start_share"]) * cap), cap - 1) if cap > 1 else 0
        self.cfg["n_sink"], self.cfg["window"] = sink, cap - sink
        self.capacity, self.full = cap, self.is_full
        self.wants_probs = not self.full and cap - sink > 1  # a window of one token has no neighbour to merge into
        return {"start": sink, "window": cap - sink, "merge_budget": int(self.cfg["merge_budget"])}

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return PrefillNeeds(query_window=1)  # the last prompt query decides the first merge

    def compress_tokens(self, state: PrefillState) -> None:
        super().compress_tokens(state)
        if not self.wants_probs:
            return
        last = state.window_probs(1)[..., -1, :]  # [L, Hq, n]: the last prompt query over the prompt
        for layer, cache in enumerate(self.layers):
            kept = cache.positions().long()  # [Hkv, C]
            attn = pooled_step_attention(last[layer].unsqueeze(-2), self.info.n_kv_heads)  # [Hkv, n]
            self.merge_next(layer, attn.gather(-1, kept))

    def after_attend(self, layer: int, probs: Tensor) -> None:
        self.merge_next(layer, pooled_step_attention(probs, self.info.n_kv_heads))

    def merge_next(self, layer: int, attn: Tensor) -> None:
        """When ``layer``'s cache is full, merge the value of the token the next append evicts (the window's
        oldest) into the m after it, per KV head with ``merge_probability`` (``attn`` [Hkv, C]: this query's
        attention over the cache)."""
        cache = self.layers[layer]
        if cache.n < self.capacity:
            return
        e = int(self.cfg["n_sink"])
        merge_set = slice(e + 1, min(e + 1 + int(self.cfg["merge_budget"]), cache.n))
        size = merge_set.stop - merge_set.start
        if size < 1:
            return
        p = merge_probability(attn, e, merge_set)
        draw = torch.bernoulli(p.cpu(), generator=self.generator).to(attn.device)  # [Hkv]
        values = cache.views()[1]  # [Hkv, C, dv]: a view of the cache's own storage
        share = (values[:, e].float() * (draw / size)[:, None]).to(values.dtype)  # [Hkv, dv]
        values[:, merge_set] += share[:, None, :]
