"""AdaKV: a prompt-time scorer's budget spread over the KV heads of a layer by one joint top-k.

Feng, Lv, Cao, Xie, Zhou. "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference", NeurIPS 2025, https://arxiv.org/abs/2407.11550 — Algorithm 1 (adaptive
budget allocation) inside Algorithm 2 (Ada-SnapKV). A top-k eviction method gives every head of a
layer the same budget B. Ada-KV pools the scores of the layer's H heads, takes the top H x B of
them jointly, and gives head i as many tokens as it placed in that joint top (f_i); each head then
keeps its own f_i best tokens. A head whose attention is concentrated on a few tokens gives its
budget to one whose attention is spread out. The safeguard of the authors' code
(``AdaptiveSnapKVCluster``, ``floor_alpha``, 0.2 in its runs with grouped-query attention): head i
gets ``alpha * B + (1 - alpha) * f_i``, never less than ``alpha`` of the uniform budget.

It wraps any method that ranks the prompt (declared ``ranks_prompt``: the ``PromptScored`` methods
and Expected Attention), as kvpress's ``AdaKVPress`` wraps a scorer press: ``ada-snapkv`` and
``ada-expected-attention`` (kvpress's benchmarked entry, with epsilon 1e-2) are registered;
``ada-NAME`` is made on demand for the others (``ada-pyramidkv``, the paper's Ada-Pyramid;
``ada-knorm``, ``ada-keydiff``). The wrapper (``Adaptive``) holds the scorer; the cache (``AdaKV``)
holds an instance of it, which plans the budget and ranks the prompt (``ranking``: its scores, the
tokens every head keeps as it does, such as a recent window or sinks, and the per-layer budget);
only the split of each layer's budget over its heads changes. TOVA and H2O score while decoding and
are not wrapped.

The heads of a layer then hold different numbers of tokens; the cache holds exactly those
(``ragged.RaggedLayer``, the store shared with the other methods whose heads differ).

Deviations:

* The per-head budgets are rounded by largest remainder so that a layer's budgets sum to exactly
  H x B (the authors' code rounds each head on its own, which can miss the total by a few tokens).
* Grouped-query attention: the scores of a KV group's query heads are summed (as kvlab's SnapKV
  does; the authors' code averages them): the joint ranking is the same. For the other scorers the
  joint top-k compares their scores across heads as they are (KNorm's key norms, KeyDiff's cosines);
  the paper argues for attention weights only.
* The authors' code's options ``normalize`` (scale each head's scores by its top-B share) and
  ``skip`` (uniform budgets in the first layers) are not implemented (its LongBench scripts run
  with ``skip`` 0 and without ``normalize``).
* Each head's count is held as an int32 (4 bytes per layer and KV head) and counted in the bytes.
* ``kept_positions`` pads a shorter head's row by repeating the newest position it holds (every
  head holds it), so the rows stay rectangular; the set of positions per head is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillState
from kvlab.methods.held_scorer import HeldScorer, ScorerWrapper, scorer_resolver
from kvlab.methods.params import Param
from kvlab.methods.ragged import RaggedCompressor

PREFIX = "ada-"


def joint_allocation(scores: Tensor, budget: Tensor, alpha: float) -> Tensor:
    """Ada-KV's per-head budgets (Algorithm 1, with the safeguard): [L, H] int64.

    scores: [L, H, m], higher = keep, comparable across a layer's heads; budget: [L] int64, the
    uniform per-head budget B_l (0 <= B_l <= m). f[l, i] counts head i's scores among the top
    H x B_l of layer l's H x m scores; head i gets alpha B_l + (1 - alpha) f[l, i], rounded by
    largest remainder so that each layer's budgets sum to H x B_l.
    """
    n_layers, h, m = scores.shape
    order = torch.sort(scores.reshape(n_layers, h * m), dim=-1, descending=True, stable=True).indices
    in_top = torch.arange(h * m, device=scores.device) < (h * budget)[:, None]  # [L, H m] in score order
    f = torch.zeros(n_layers, h, dtype=torch.long, device=scores.device).scatter_add_(1, order // m, in_top.long())
    real = alpha * budget[:, None].double() + (1 - alpha) * f.double()
    out = real.floor().long()
    rest = h * budget - out.sum(-1)  # [L]: the tokens the floors left over, 0 <= rest <= H
    by_remainder = torch.argsort(real - out, dim=-1, descending=True, stable=True)
    bump = torch.arange(h, device=scores.device)[None, :] < rest[:, None]
    return out.scatter_add_(1, by_remainder, bump.long())


def ranked_keep(scores: Tensor, budgets: Tensor) -> Tensor:
    """[L, H, m] bool: each head keeps its ``budgets`` [L, H] best-scored tokens of ``scores`` [L, H, m]."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    top = torch.arange(scores.shape[-1], device=scores.device) < budgets[..., None]
    return torch.zeros_like(top).scatter_(-1, order, top)


ALPHA = Param(
    "alpha",
    0.2,
    "safeguard: each head keeps at least this share of the uniform per-head budget (1: uniform)",
    minimum=0.0,
    maximum=1.0,
)
PAPER = (
    "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM "
    "Inference, NeurIPS 2025 (arXiv:2407.11550)"
)


class AdaKV(RaggedCompressor, HeldScorer):
    """Ada-KV's allocation over a prompt-time scorer it holds (``scorer``, see the module docstring):
    the scorer plans and ranks the prompt (``ranking``), this cache keeps what the joint top-k gives
    each head. ``adaptive(Inner)`` is the wrapper the registry lists for ``ada-NAME``."""

    params = (ALPHA,)

    def own_knobs(self, n_prompt: int) -> dict:
        return {"alpha": float(self.cfg["alpha"])}

    def keep_mask(self, state: PrefillState) -> Tensor | None:
        rank = self.scorer.ranking(state)
        if rank is None:
            return None
        n, n_layers, h = state.n_tokens, state.keys.shape[0], state.keys.shape[1]
        keep = torch.ones(n_layers, h, n, dtype=torch.bool, device=state.keys.device)
        keep[..., rank.head : n - rank.tail] = False
        m = rank.scores.shape[-1]
        budget = torch.tensor(rank.budgets, device=rank.scores.device)
        counts = joint_allocation(rank.scores, budget, float(self.cfg["alpha"]))
        keep[..., rank.start : rank.start + m] = ranked_keep(rank.scores, counts)
        return keep


def adaptive(inner: type[DenseCompressor], **inner_defaults: Any) -> ScorerWrapper:
    """``ada-NAME``: ``inner``'s scores and budgets with Ada-KV's allocation (``inner_defaults``: the scorer's
    parameters at other defaults)."""
    return ScorerWrapper(
        inner,
        PREFIX + inner.name,
        title=f"Ada-{inner.title}",
        summary=f"{inner.title}'s scores; each layer's budget spread over its KV heads by one joint top-k "
        "(each head at least alpha of the uniform share).",
        own_params=(ALPHA,),
        group="recent",
        paper=PAPER,
        inner_defaults=tuple(inner_defaults.items()),
        cache=AdaKV,
    )


# ``ada-NAME`` for a method that ranks the prompt -> its wrapper; else None
resolve = scorer_resolver(PREFIX, adaptive)
