"""LU-KV: a prompt-time scorer's budget spread over layers and KV heads by their long-horizon utility
curves, profiled here for the loaded model.

Tang, Jiao, Chen, Liu, Li, Chen. "Predicting Future Utility: Global Combinatorial Optimization for
Task-Agnostic KV Cache Eviction" (LU-KV), ICML 2026, https://arxiv.org/abs/2602.08585. A scorer (SnapKV,
Expected Attention, ...) ranks each head's tokens; heads differ in how well that ranking predicts what
later queries use. LU-KV measures, offline on calibration texts, each head's eviction loss when it keeps
its top-k by the scorer: the oracle importance (the most attention any later query pays the token) of
what it evicts. The loss curves, made convex (the lower convex hull: non-increasing marginal gains),
give a greedy allocation that is optimal for them: the budget goes, token by token, to the head whose
next token saves the most. kvpress's ``LUKVPress`` applies curves precomputed by the authors for one
model (Llama-3.1-8B with ``ExpectedAttentionPress(epsilon=2e-2)``, sink 4, window 1: its benchmarked
``lukv``); kvlab computes them for the loaded model and the wrapped scorer:

1. profile (once per model and scorer setting, kept while the model is loaded): ``calib_texts``
   consecutive pieces of ``calib_tokens`` tokens of CPython's reference manual (``pydoc_data``, topics the
   built-in prompts do not use); each piece's first part is the context, its last ``future`` tokens the
   later queries. The scorer ranks the context (its own prefill of it); the later queries run on the
   exact cache (``ModelAccess.extend``); per layer and KV head, the oracle importance of a context token is
   the largest attention any later query of its group pays it, and the loss at kept fraction g / ``grid``
   is the importance of what the ranking evicts there, averaged over the pieces;
2. allocation: the curves' lower convex hulls give each head's marginal gains; the prompt's budget for the
   ranked tokens (the scorer's, all global layers together) goes to the ``grid``-steps of largest gain over
   all heads; each head keeps its fraction of the ranked tokens (rounded by largest remainder to the total)
   by the scorer's order, plus what the scorer always keeps (its window, its sinks).

The heads then hold different counts (``ragged``: each head's int32 count is held and counted); the total
is the scorer's, so the bytes are its own plus the counts. ``lukv-expected-attention`` (epsilon 2e-2,
kvpress's benchmarked pairing) is registered; ``lukv-NAME`` is made on demand for any scorer.

Deviations:

* The curves are profiled here on a few pieces of CPython's reference manual with the loaded model (the
  authors profile LongBench-like data offline, per model and scorer); the oracle is the next ``future``
  tokens of the text rather than a generated answer.
* The greedy allocation runs at the prompt's own budget (kvpress's curves are tabulated at 99 ratios).
* Sliding-window layers keep the scorer's own per-layer budget; LU-KV spreads the budget of the global
  layers (a window would waste a head's share on tokens it no longer sees).
* kvpress's LU-KV also protects the first 4 and the last token; here the scorer's own protected tokens
  stand (Expected Attention keeps its 4 sinks; SnapKV its window).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from pydoc_data.topics import topics
from typing import Any

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget
from kvlab.methods.adakv import ranked_keep
from kvlab.methods.dense import DenseCompressor, Ranking
from kvlab.methods.handover import ModelAccess, PrefillNeeds, PrefillState
from kvlab.methods.held_scorer import HeldScorer, ScorerWrapper, scorer_resolver
from kvlab.methods.params import Param
from kvlab.methods.ragged import RaggedCompressor

PREFIX = "lukv-"
PAPER = (
    "Tang et al., Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache "
    "Eviction (LU-KV), ICML 2026 (arXiv:2602.08585)"
)
PARAMS = (
    Param("calib_texts", 2, "calibration pieces the curves are averaged over", minimum=1),
    Param("calib_tokens", 384, "tokens per calibration piece (context + later queries)", minimum=16),
    Param("future", 64, "last tokens of a piece whose attention is the oracle (the decoding horizon)", minimum=1),
    Param("grid", 100, "steps of the kept fraction the curves and the allocation use", minimum=2),
)
# CPython's reference manual, topics the built-in prompts and tests do not use
CALIBRATION_TOPICS = ("calls", "class", "comparisons", "compound", "context-managers", "customization", "for", "if")
_PROFILES: weakref.WeakKeyDictionary[object, dict[tuple, Tensor]] = weakref.WeakKeyDictionary()


def calibration_ids(encode: Callable[[str], list[int]], pieces: int, tokens: int) -> list[list[int]]:
    """``pieces`` consecutive pieces of ``tokens`` token ids of CPython's reference manual (fewer if it runs out)."""
    ids = encode("\n\n".join(topics[t] for t in CALIBRATION_TOPICS))
    return [ids[i * tokens : (i + 1) * tokens] for i in range(min(pieces, len(ids) // tokens))]


def eviction_curves(scores: Tensor, oracle: Tensor, grid: int) -> Tensor:
    """Oracle importance evicted when each head keeps its best-scored fraction g / grid: [L, H, grid + 1].

    scores [L, H, m] (higher = keep), oracle [L, H, m] (the same tokens' importance)."""
    m = scores.shape[-1]
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    kept = torch.nn.functional.pad(oracle.float().gather(-1, order).cumsum(-1), (1, 0))  # [L, H, m + 1]
    k = torch.round(torch.arange(grid + 1, dtype=torch.float64) * m / grid).long().to(scores.device)
    return kept[..., -1:] - kept[..., k]


def convex_gains(curves: Tensor) -> Tensor:
    """Marginal gains [U, G] of loss curves [U, G + 1] (non-increasing), made non-increasing along each row by
    pooling adjacent violators (the slopes of the curve's lower convex hull)."""
    gains = (curves[:, :-1] - curves[:, 1:]).double()
    out = torch.empty_like(gains)
    for u in range(gains.shape[0]):
        blocks: list[list[float]] = []  # [sum, count] of each pooled block
        for g in gains[u].tolist():
            blocks.append([g, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
                s, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += c
        out[u] = torch.tensor([s / c for s, c in blocks for _ in range(int(c))], dtype=torch.float64)
    return out


def greedy_fractions(gains: Tensor, steps: int) -> Tensor:
    """Each unit's kept fraction [U] after ``steps`` grid-steps go, one by one, to the largest marginal gain.

    gains [U, G] non-increasing along each row, so the greedy is the ``steps`` largest gains over all units."""
    u, g = gains.shape
    steps = max(0, min(steps, u * g))
    order = torch.sort(gains.flatten(), descending=True, stable=True).indices[:steps]
    return torch.bincount(order // g, minlength=u).double() / g


def apportion(real: Tensor, total: int, cap: int) -> Tensor:
    """Integer counts [U] in [0, cap] summing to ``total`` (at most U x cap), proportional to ``real`` [U] and
    rounded by largest remainder; what a capped unit cannot hold goes to the others in proportion."""
    real = real.double().clamp(min=0)
    if float(real.sum()) <= 0:
        real = torch.ones_like(real)
    total = min(total, cap * real.numel())
    out = torch.zeros(real.shape, dtype=torch.long)
    free = torch.ones(real.shape, dtype=torch.bool)
    want = torch.zeros_like(real)
    while bool(free.any()):
        share = real.masked_fill(~free, 0.0)
        if float(share.sum()) <= 0:
            share = free.double()
        want = share * (total - int(out.sum())) / share.sum()
        over = free & (want > cap)
        if not bool(over.any()):
            break
        out[over] = cap
        free &= ~over
    floor = want.floor().long().masked_fill(~free, 0)
    out = out + floor
    frac = (want - floor.double()).masked_fill(~free, -1.0)
    left = total - int(out.sum())
    out[torch.sort(frac, descending=True, stable=True).indices[: max(0, left)]] += 1
    return out


class LUKV(RaggedCompressor, HeldScorer):
    """LU-KV's allocation over a prompt-time scorer it holds (``scorer``; see the module docstring).
    ``profiled(Inner)`` is the wrapper the registry lists for ``lukv-NAME``."""

    params = PARAMS

    def own_needs(self, needs: PrefillNeeds) -> PrefillNeeds:
        return replace(needs, model_access=True)

    def own_knobs(self, n_prompt: int) -> dict:
        c = self.cfg
        return {k: int(c[k]) for k in ("calib_texts", "calib_tokens", "future", "grid")}

    # ----- the profile ----------------------------------------------------------------------------
    def profile(self, access: ModelAccess) -> Tensor:
        """The scorer's eviction-loss curves on the calibration pieces, averaged: [L, Hkv, grid + 1] (cached per
        model and scorer setting while the model is loaded; the prefill's keys are the model's, whatever dtype
        the caches store them in)."""
        c = self.cfg
        key = (
            self.scorer.name,
            tuple(sorted((k, repr(v)) for k, v in self.scorer.cfg.items())),
            *(int(c[k]) for k in ("calib_texts", "calib_tokens", "future", "grid")),
        )
        known = _PROFILES.setdefault(access.owner, {})
        if key not in known:
            tokens = min(int(c["calib_tokens"]), self.info.max_positions)
            future = min(int(c["future"]), tokens // 2)
            pieces = calibration_ids(access.encode, int(c["calib_texts"]), tokens)
            if not pieces:
                raise RuntimeError(f"{self.name}: the calibration text is shorter than {tokens} tokens")
            curves = [self.piece_curves(access, ids[:-future], ids[-future:]) for ids in pieces]
            known[key] = torch.stack(curves).mean(0)
        return known[key]

    def piece_curves(self, access: ModelAccess, context: list[int], future: list[int]) -> Tensor:
        """One calibration piece's loss curves [L, Hkv, grid + 1]: the scorer ranks ``context`` (a copy of it
        planned for the piece), the ``future`` tokens' queries give the oracle."""
        scorer = self.scorer.remade(Budget(fraction=0.5))
        assert isinstance(scorer, DenseCompressor)  # a copy of the scorer
        scorer.plan(len(context))
        state = access.prefill(context, replace(scorer.prefill_needs(len(context)), model_access=True))
        rank = scorer.ranking(state)
        assert rank is not None and state.model is not None  # a half budget ranks; model access was asked
        oracle = self.oracle(state.model, future, len(context))[..., rank.start : rank.start + rank.scores.shape[-1]]
        return eviction_curves(rank.scores, oracle, int(self.cfg["grid"]))

    def oracle(self, access: ModelAccess, future: list[int], n: int) -> Tensor:
        """[L, Hkv, n]: the largest attention any of the ``future`` queries (run after the n context tokens on
        their exact cache) pays each context token, over the query heads of each KV group."""
        h = self.info.n_kv_heads
        out: list[Tensor | None] = [None] * self.info.n_layers

        def observe(layer: int, q: Tensor, k: Tensor) -> None:
            s = self.sem[layer]
            total = k.shape[-2]
            x = sm.logits(q.float(), k.float(), s)  # [Hq, c, n + c]
            bias = sm.window_bias(
                s, torch.arange(total - q.shape[-2], total, device=q.device), torch.arange(total, device=q.device)
            )
            probs = sm.softmax(x if bias is None else x + bias.to(x.device), s)[..., :n]  # [Hq, c, n]
            out[layer] = probs.amax(-2).view(h, -1, n).amax(1)

        access.extend(future, observe)
        return torch.stack([o for o in out if o is not None])

    # ----- the allocation -----------------------------------------------------------------------------
    def head_budgets(self, rank: Ranking, curves: Tensor) -> Tensor:
        """[L, Hkv]: the ranked tokens each head keeps; global layers share their total by the greedy on the
        convexified curves, local layers keep the scorer's budgets."""
        n_layers, h, m = rank.scores.shape
        budgets = torch.tensor(rank.budgets)[:, None].expand(n_layers, h).clone()
        glob = torch.tensor([not self.sem[i].is_local for i in range(n_layers)])
        if not bool(glob.any()) or m == 0:
            return budgets
        total = int(budgets[glob].sum())
        gains = convex_gains(curves[glob].reshape(-1, curves.shape[-1]).cpu())
        grid = gains.shape[-1]
        steps = round(total / m * grid)
        fractions = greedy_fractions(gains, steps)
        budgets[glob] = apportion(fractions * m, total, m).view(-1, h)
        return budgets

    def keep_mask(self, state: PrefillState) -> Tensor | None:
        rank = self.scorer.ranking(state)
        if rank is None:
            return None
        if state.model is None:
            raise RuntimeError(f"{self.name}: the prefill gave no model access to profile the model with")
        n, n_layers, h = state.n_tokens, state.keys.shape[0], self.info.n_kv_heads
        self.budgets = self.head_budgets(rank, self.profile(state.model).to(rank.scores.device))
        keep = torch.ones(n_layers, h, n, dtype=torch.bool, device=state.keys.device)
        keep[..., rank.head : n - rank.tail] = False
        m = rank.scores.shape[-1]
        keep[..., rank.start : rank.start + m] = ranked_keep(rank.scores, self.budgets.to(keep.device))
        return keep


def profiled(inner: type[DenseCompressor], **inner_defaults: Any) -> ScorerWrapper:
    """``lukv-NAME``: ``inner``'s ranking with LU-KV's per-layer and per-head budgets, profiled for the model."""
    return ScorerWrapper(
        inner,
        PREFIX + inner.name,
        title=f"LU-KV-{inner.title}",
        summary=f"{inner.title}'s ranking; the budget spread over layers and KV heads by utility curves profiled "
        "for the loaded model (convex hulls, greedy on marginal gains).",
        own_params=PARAMS,
        group="recent",
        paper=PAPER,
        inner_defaults=tuple(inner_defaults.items()),
        cache=LUKV,
    )


# ``lukv-NAME`` for a method that ranks the prompt -> its wrapper; else None
resolve = scorer_resolver(PREFIX, profiled)


__all__ = ["LUKV", "apportion", "convex_gains", "eviction_curves", "greedy_fractions", "profiled", "resolve"]
