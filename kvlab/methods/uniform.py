"""Uniform sampling: the first and last tokens plus a reweighted uniform random sample of the middle.

The baseline of Han, Kochetkova, Kapralov, Sheth, Zandieh. "BalanceKV: KV Cache Compression through
Discrepancy Theory", arXiv:2502.07861 — Sec. 4.1: the first and last prompt tokens are kept, and
BalanceKV on the middle is replaced by "sampling a 2^{-T} fraction of key and value embeddings ...
uniformly at random". Here the budget's share of the middle is sampled without replacement,
independently per layer and KV head. Prefill-only.

Reweighting (``reweight``, on by default, as the authors' uniform baseline does): each kept middle
token stands for the ``n_middle / kept`` middle tokens it replaces, i.e. carries the log-weight
``log(n_middle / kept)`` on its logit (BalanceKV's halvings give the same 2^T). Every middle token
is kept with probability ``kept / n_middle``, so the weighted sums over the kept tokens,
``sum w exp(<q, k>)`` and ``sum w exp(<q, k>) v``, are unbiased estimates of the middle's softmax
denominator and numerator. Without the weights the middle's softmax mass is under-counted by that
factor. ``reweight=false`` gives the unweighted sample. The paper does not say how many first and
last tokens are kept beyond Sec. 4.1's 256 / 256 (``n_first`` / ``n_last``, capped at a quarter of
the budget each on short prompts).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param


def uniform_middle(shape: tuple[int, ...], n: int, first: int, last: int, m: int, gen: torch.Generator) -> Tensor:
    """Indices [*shape, first + m + last]: 0..first-1, m sorted uniform draws from the middle, then the last tokens."""
    mid = n - first - last
    draws = torch.rand(*shape, mid, generator=gen).argsort(-1)[..., :m].sort(-1).values + first
    ends = [torch.arange(first).expand(*shape, first), draws, torch.arange(n - last, n).expand(*shape, last)]
    return torch.cat(ends, -1)


class Uniform(DenseCompressor):
    name = "uniform"
    title = "Uniform sampling"
    group = "baseline"
    window_capped = True  # one capacity; a window keeps less of it, the global layers more
    paper = (
        "Han, Kochetkova, Kapralov, Sheth, Zandieh. BalanceKV: KV Cache Compression through Discrepancy "
        "Theory, Sec. 4.1 baseline (arXiv:2502.07861)"
    )
    summary = (
        "Keeps the first and last tokens and a uniform random sample of the middle of the prompt, each sample "
        "weighted by the number of middle tokens it stands for."
    )
    params = (
        Param("n_first", 256, "first prompt tokens always kept (capped at a quarter of the budget)", minimum=0),
        Param("n_last", 256, "last prompt tokens always kept (capped at a quarter of the budget)", minimum=0),
        Param("reweight", True, "each kept middle token stands for n_middle / kept tokens (log-weight on its logit)"),
    )

    capacity: int  # set by plan: tokens per layer and KV head kept
    full: bool  # set by plan: no budget, nothing compressed

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        self.capacity = self.tokens_for_budget(n_prompt, with_logw=self.cfg["reweight"])
        if not self.full:  # on a model with local layers, the global layers take what the windows leave
            self.capacity = self.capacity_over_windows(n_prompt, self.capacity)
        self.first = min(int(self.cfg["n_first"]), self.capacity // 4)
        self.last = min(int(self.cfg["n_last"]), self.capacity // 4)
        self.sampled = self.capacity - self.first - self.last
        knobs: dict[str, float] = {
            "capacity": self.capacity,
            "first": self.first,
            "last": self.last,
            "sampled": self.sampled,
        }
        if self.cfg["reweight"] and not self.full and self.capacity < n_prompt:
            knobs["middle_weight"] = round((n_prompt - self.first - self.last) / max(1, self.sampled), 4)
        return knobs

    def planned_logw(self) -> bool:
        return bool(self.cfg["reweight"]) and not self.full

    def _compressing(self, n: int) -> bool:
        return not self.full and self.capacity < n

    def select(self, state: PrefillState):
        n, (n_layers, hkv) = state.n_tokens, state.keys.shape[:2]
        if not self._compressing(n):
            return [None] * n_layers
        idx = uniform_middle((n_layers, hkv), n, self.first, self.last, self.sampled, self.generator)
        return idx.to(state.keys.device)

    def log_weights(self, state: PrefillState, idx: list[Tensor]) -> list[Tensor] | None:
        n = state.n_tokens
        if not self.cfg["reweight"] or not self._compressing(n):
            return None
        w = math.log((n - self.first - self.last) / max(1, self.sampled))
        lw = torch.zeros(self.first + self.sampled + self.last, device=state.keys.device)
        lw[self.first : self.first + self.sampled] = w
        return [lw.expand(i.shape[0], -1) for i in idx]
