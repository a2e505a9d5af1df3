"""CriticalKV: a prompt-time scorer's choice made in two stages, the second weighted by ||W_o v||_1.

Feng, Lv, Cao, Xie, Zhou. "Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective" (CriticalKV), arXiv:2502.03805 — Sec. 3-4. The L1 perturbation of a head's attention output
when entries are evicted is bounded by a sum over the evicted entries of their attention weight times
||v_i W_o||_1 (the value projected by the head's block of the output projection). Algorithm 1 selects
the budget b in two stages: the first ``first_stage_ratio`` x b entries by attention weight alone (the
scorer's), then the rest by the bound's terms, (score + epsilon) x ||W_o v||_1.

It wraps any method that ranks the prompt (``ranks_prompt``), as kvpress's ``CriticalKVPress`` wraps a
scorer press: ``criticalkv-snapkv`` (the paper's and kvpress's pairing) is registered, ``criticalkv-NAME``
is made on demand for the others (``criticalkv-expected-attention`` with ``use_vnorm`` off, as kvpress
benchmarks it: its value norm is what ||W_o v|| replaces). The scorer plans, keeps what it always keeps
(its window, its sinks) and ranks the rest (``ranking``); this method re-ranks within each head:

1. stage 1: per layer, the first ``int(first_stage_ratio x capacity)`` kept tokens are the tokens the
   scorer always keeps and its best-scored ones (kvpress: its scores put the window first, at the top);
2. stage 2: the other tokens are ranked by (score + epsilon) x mean over the KV group's query heads h of
   ||W_o[:, h] v||_1, and each head keeps the best of them up to the scorer's budget.

W_o is read from the loaded model (``PrefillNeeds.out_proj``: each layer's output projection, a view of
its weight, never changed). Every head keeps the scorer's count: the bytes are the scorer's.

Defaults: the paper's two-stage split, ``first_stage_ratio`` 0.5; kvpress's ``epsilon`` 1e-4 (the paper
leaves it open).

Deviations:

* kvlab's scorers sum their votes over a KV group's query heads (SnapKV: also over the window), kvpress's
  average them; epsilon is added to the scores as kvlab's scorer gives them, so its weight against a
  score differs by that factor (group size x window for SnapKV: 96 on the embedded model).
* Stage 1 counts the tokens the scorer always keeps against its share, as kvpress's top-k over the padded
  scores does; here they are never dropped, also when they alone pass the stage-1 share.
* A model without an output projection kvlab can find (``engine.prefill.output_projections``) is refused
  at compression, in one line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from kvlab.core.attention_ops import pool_heads
from kvlab.methods.adakv import ranked_keep
from kvlab.methods.dense import DenseCompressor, Ranking
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.held_scorer import HeldScorer, ScorerWrapper, scorer_resolver
from kvlab.methods.params import Param

PREFIX = "criticalkv-"
PAPER = (
    "Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective "
    "(CriticalKV), 2025 (arXiv:2502.03805)"
)
PARAMS = (
    Param(
        "critical_epsilon",
        1e-4,
        "added to the scorer's score before the ||W_o v||_1 weighting (kvpress's)",
        minimum=0.0,
    ),
    Param(
        "first_stage_ratio",
        0.5,
        "share of each head's budget chosen by the scorer alone (stage 1; the paper's 0.5)",
        minimum=0.0,
        maximum=1.0,
    ),
)
# a scorer's parameters as a CriticalKV pairing wants them: Expected Attention's value norm is what ||W_o v|| replaces
SCORER_DEFAULTS: dict[str, dict[str, Any]] = {"expected-attention": {"use_vnorm": False}}


def projected_value_norms(values: Tensor, out_proj: Tensor, n_kv_heads: int) -> Tensor:
    """mean over each KV group's query heads h of ||W_o[:, h] v||_1: [Hkv, m].

    values [Hkv, m, dv] (the head's values, read by its group's query heads); out_proj [hidden, Hq, dv]
    (``PrefillState.out_proj``'s layer). Computed one query head at a time ([m, hidden] at once).
    """
    hq = out_proj.shape[1]
    g = hq // n_kv_heads
    w = out_proj.float()
    norms = torch.stack([(values[h // g].float() @ w[:, h].T).abs().sum(-1) for h in range(hq)])  # [Hq, m]
    return pool_heads(norms, n_kv_heads, head_dim=0, reduce="mean")


def two_stage_scores(scores: Tensor, norms: Tensor, first: list[int], epsilon: float) -> Tensor:
    """CriticalKV's ranking of the tokens a scorer ranks: [L, Hkv, m].

    scores [L, Hkv, m] (the scorer's, higher = keep), norms [L, Hkv, m] (``projected_value_norms``), first
    [L]: how many each head of layer l takes in stage 1. Stage 1's tokens (each head's ``first[l]`` best
    scores) rank above all others (+inf); the others by (score + epsilon) x norm.
    """
    out = (scores.float() + epsilon) * norms
    stage1 = ranked_keep(
        scores, torch.tensor(first, device=scores.device)[:, None].expand(scores.shape[:2]).contiguous()
    )
    return out.masked_fill(stage1, float("inf"))


class CriticalKV(HeldScorer):
    """CriticalKV's two-stage choice over a prompt-time scorer it holds (``scorer``; see the module
    docstring). ``critical(Inner)`` is the wrapper the registry lists for ``criticalkv-NAME``."""

    params = PARAMS
    ranks_prompt = True

    def own_needs(self, needs: PrefillNeeds) -> PrefillNeeds:
        return replace(needs, out_proj=True)

    def own_knobs(self, n_prompt: int) -> dict:
        return {
            "critical_epsilon": float(self.cfg["critical_epsilon"]),
            "first_stage_ratio": float(self.cfg["first_stage_ratio"]),
        }

    def ranking(self, state: PrefillState) -> Ranking | None:
        """The scorer's ranking with its scores replaced by CriticalKV's two-stage ones (same budgets)."""
        rank = self.scorer.ranking(state)
        if rank is None:
            return None
        if state.out_proj is None:
            raise RuntimeError(
                f"{self.name}: cannot read the model's attention output projection (W_o), which it weighs values by"
            )
        m, h = rank.scores.shape[-1], self.info.n_kv_heads
        span = slice(rank.start, rank.start + m)
        norms = torch.stack(
            [projected_value_norms(state.values[i, :, span], w, h) for i, w in enumerate(state.out_proj)]
        )
        ratio, fixed = float(self.cfg["first_stage_ratio"]), rank.head + rank.tail
        first = [min(b, max(0, int(ratio * (b + fixed)) - fixed)) for b in rank.budgets]
        scores = two_stage_scores(rank.scores, norms, first, float(self.cfg["critical_epsilon"]))
        return replace(rank, scores=scores)

    def select(self, state: PrefillState):
        n, n_layers = state.n_tokens, state.keys.shape[0]
        rank = self.ranking(state)
        if rank is None:
            return [None] * n_layers
        h, dev = self.info.n_kv_heads, state.keys.device
        kept = ranked_keep(rank.scores, torch.tensor(rank.budgets, device=dev)[:, None].expand(-1, h).contiguous())
        keep = torch.ones(n_layers, h, n, dtype=torch.bool, device=dev)
        keep[..., rank.head : n - rank.tail] = False
        keep[..., rank.start : rank.start + kept.shape[-1]] = kept
        idx = torch.arange(n, device=dev).expand(h, n)
        return [idx[keep[i]].view(h, -1) for i in range(n_layers)]


def critical(inner: type[DenseCompressor], **inner_defaults: Any) -> ScorerWrapper:
    """``criticalkv-NAME``: ``inner``'s scores re-ranked in CriticalKV's two stages (``inner_defaults``: the
    scorer's parameters at other defaults; ``SCORER_DEFAULTS`` first)."""
    defaults = {**SCORER_DEFAULTS.get(inner.name, {}), **inner_defaults}
    return ScorerWrapper(
        inner,
        PREFIX + inner.name,
        title=f"CriticalKV-{inner.title}",
        summary=f"{inner.title}'s budget, half by its scores, the rest by its scores times the value's "
        "output-projection norm ||W_o v||_1 (an output-perturbation bound).",
        own_params=PARAMS,
        group="recent",
        paper=PAPER,
        inner_defaults=tuple(defaults.items()),
        cache=CriticalKV,
    )


# ``criticalkv-NAME`` for a method that ranks the prompt -> its wrapper; else None
resolve = scorer_resolver(PREFIX, critical)
