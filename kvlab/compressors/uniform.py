"""Uniform sampling: the first and last tokens plus a uniform random sample of the middle.

The baseline of Han, Kacham, Karbasi, Mirrokni, Zandieh. "BalanceKV: KV Cache Compression through
Discrepancy Theory", arXiv:2502.07861 — Sec. 4.1: keep the first ``n_first`` and the last
``n_last`` prompt tokens, and replace BalanceKV on the middle by sampling the budget's share of the
middle tokens uniformly at random without replacement, independently per layer and KV head. No
re-weighting (the paper's baseline keeps the sampled tokens as they are). Prefill-only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.compressors.base import DenseCompressor, Param, PrefillState
from kvlab.compressors.registry import register


def uniform_middle(shape: tuple[int, ...], n: int, first: int, last: int, m: int, gen: torch.Generator) -> Tensor:
    """Indices [*shape, first + m + last]: 0..first-1, m sorted uniform draws from the middle, then the last tokens."""
    mid = n - first - last
    draws = torch.rand(*shape, mid, generator=gen).argsort(-1)[..., :m].sort(-1).values + first
    ends = [torch.arange(first).expand(*shape, first), draws, torch.arange(n - last, n).expand(*shape, last)]
    return torch.cat(ends, -1)


@register
class Uniform(DenseCompressor):
    name = "uniform"
    title = "Uniform sampling"
    group = "baseline"
    paper = (
        "Han et al., BalanceKV: KV Cache Compression through Discrepancy Theory, Sec. 4.1 baseline (arXiv:2502.07861)"
    )
    summary = "Keeps the first and last tokens and a uniform random sample of the middle of the prompt."
    params = (
        Param("n_first", 256, "first prompt tokens always kept (capped at a quarter of the budget)", minimum=0),
        Param("n_last", 256, "last prompt tokens always kept (capped at a quarter of the budget)", minimum=0),
    )

    def plan(self, n_prompt: int) -> dict:
        self.full = self.budget is None or self.budget.is_full
        self.capacity = self.tokens_for_budget(n_prompt)
        self.first = min(int(self.cfg["n_first"]), self.capacity // 4)
        self.last = min(int(self.cfg["n_last"]), self.capacity // 4)
        self.sampled = self.capacity - self.first - self.last
        return {"capacity": self.capacity, "first": self.first, "last": self.last, "sampled": self.sampled}

    def select(self, state: PrefillState):
        n, (n_layers, hkv) = state.n_tokens, state.keys.shape[:2]
        if self.full or self.capacity >= n:
            return [None] * n_layers
        idx = uniform_middle((n_layers, hkv), n, self.first, self.last, self.sampled, self.generator)
        return idx.to(state.keys.device)
