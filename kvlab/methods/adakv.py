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

The heads of a layer then hold different numbers of tokens. The cache holds exactly those
(``RaggedLayer``): per layer, the kept prompt tokens of all heads in one flat [T, d] tensor with
each head's count, and the tokens appended after compression (which every head gets) in a dense
[Hkv, m, d] store. Attention builds a transient per-head view padded to the longest head; the
padding is never part of ``tensors()`` and gets zero weight.

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

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kvlab.core import cancel
from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor, DenseLayer, prompt_scorer
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.wrapped import Wrapper

PREFIX = "ada-"
PAD_LOGW = -1e30  # a padding slot's log-weight: weight exactly 0, finite so a block of padding alone stays finite


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


def topped_up(mask: Tensor, want: Tensor, first: int) -> Tensor:
    """``mask`` [H, n] (bool, no token before ``first``) with each head's newest unmarked tokens at or after
    ``first`` added until head h marks ``want[h]`` of them."""
    free = ~mask
    free[:, :first] = False
    rank = free.flip(-1).cumsum(-1).flip(-1)  # the newest free token: 1
    return mask | (free & (rank <= (want - mask.sum(-1))[:, None]))


def ranked_keep(scores: Tensor, budgets: Tensor) -> Tensor:
    """[L, H, m] bool: each head keeps its ``budgets`` [L, H] best-scored tokens of ``scores`` [L, H, m]."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    top = torch.arange(scores.shape[-1], device=scores.device) < budgets[..., None]
    return torch.zeros_like(top).scatter_(-1, order, top)


@dataclass
class RaggedLayer:
    """One layer whose KV heads hold different numbers of prompt tokens, plus the tokens appended since.

    k: [T, d], v: [T, dv]: the kept prompt tokens of every head one after the other (head 0's first,
    each head's in position order); pos: [T] int32, their positions; counts: [Hkv] int32, how many
    each head holds (summing to T). tail: the tokens appended after compression, held by every head
    alike ([Hkv, m, d] in a ``DenseLayer``).
    """

    k: Tensor
    v: Tensor
    pos: Tensor
    counts: Tensor
    tail: DenseLayer

    @classmethod
    def kept(cls, keys: Tensor, values: Tensor, keep: Tensor) -> RaggedLayer:
        """The tokens ``keep`` [Hkv, n] (bool) of keys [Hkv, n, d] / values [Hkv, n, dv]."""
        h, n = keep.shape
        pos = torch.arange(n, dtype=torch.int32, device=keys.device).expand(h, n)
        tail = DenseLayer.make(keys[:, :0], values[:, :0], pos[:, :0])
        return cls(keys[keep], values[keep], pos[keep], keep.sum(-1).to(torch.int32), tail)

    def append(self, k: Tensor, v: Tensor, pos: int) -> None:
        """Tokens k [Hkv, c, d], v [Hkv, c, dv] at positions pos..pos+c-1, for every head."""
        self.tail.append(k, v, pos)

    def drop_before(self, first: int) -> None:
        """Forget the tokens at positions below ``first`` (a sliding-window layer's)."""
        inside = self.pos >= first
        if not bool(inside.all()):
            head = torch.repeat_interleave(torch.arange(len(self.counts), device=self.pos.device), self.counts.long())
            self.counts = torch.bincount(head[inside], minlength=len(self.counts)).to(torch.int32)
            self.k, self.v, self.pos = self.k[inside], self.v[inside], self.pos[inside]
        tail_pos = self.tail.views()[2][0]  # [m]: the same positions in every head
        if tail_pos.numel() and int(tail_pos[0]) < first:
            idx = (tail_pos >= first).nonzero().squeeze(-1)
            self.tail.keep(idx.expand(len(self.counts), -1))

    def held(self) -> int:
        """Tokens held, all heads together (prompt tokens and the tail of every head)."""
        return int(self.counts.sum()) + len(self.counts) * self.tail.n

    def drop_oldest(self, m: int) -> None:
        """Forget at least m tokens, the oldest first: prompt tokens by position, whichever heads hold them;
        once none is left, the oldest appended ones (every head's, so a multiple of the head count)."""
        t = min(m, self.pos.numel())
        if t:
            inside = torch.ones_like(self.pos, dtype=torch.bool)
            inside[torch.sort(self.pos, stable=True).indices[:t]] = False
            head = torch.repeat_interleave(torch.arange(len(self.counts), device=self.pos.device), self.counts.long())
            self.counts = torch.bincount(head[inside], minlength=len(self.counts)).to(torch.int32)
            self.k, self.v, self.pos = self.k[inside], self.v[inside], self.pos[inside]
        rest = -(-(m - t) // len(self.counts))
        if rest:
            n = self.tail.n
            self.tail.keep(torch.arange(min(rest, n), n, device=self.pos.device).expand(len(self.counts), -1))

    def read_views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """As attention reads them: ``views`` (``DenseLayer.read_views``)."""
        return self.views()

    def positions(self) -> Tensor:
        """[Hkv, w + m] int32: the positions of ``views`` (a shorter head's row padded with its newest)."""
        return self.views()[2]

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """A transient per-head view of what is held: k [Hkv, w + m, d], v, pos [Hkv, w + m], logw.

        Each head's prompt tokens padded to the longest head's w (zero keys and values, log-weight
        ``PAD_LOGW``, the newest position held), then the tail; logw None when no head is padded.
        """
        tk, tv, tpos, _ = self.tail.views()
        counts = self.counts.tolist()
        newest = int(tpos.max()) if tpos.numel() else int(self.pos.max()) if self.pos.numel() else 0
        k = pad_sequence(list(self.k.split(counts)), batch_first=True)
        v = pad_sequence(list(self.v.split(counts)), batch_first=True)
        pos = pad_sequence(list(self.pos.split(counts)), batch_first=True, padding_value=newest)
        lw = None
        if min(counts) < max(counts):
            pad = torch.arange(k.shape[1], device=k.device)[None, :] >= self.counts[:, None]
            lw = torch.zeros(pad.shape, device=k.device).masked_fill_(pad, PAD_LOGW)
            lw = torch.cat([lw, lw.new_zeros(lw.shape[0], tk.shape[1])], 1)
        return torch.cat([k, tk], 1), torch.cat([v, tv], 1), torch.cat([pos, tpos], 1), lw

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield "keys", self.k
        yield "values", self.v
        yield "positions", self.pos
        yield "head_counts", self.counts
        yield from self.tail.tensors()


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


class AdaKV(DenseCompressor):
    """Ada-KV's allocation over a prompt-time scorer it holds (``scorer``, see the module docstring):
    the scorer plans and ranks the prompt (``ranking``), this cache keeps what the joint top-k gives
    each head. ``adaptive(Inner)`` is the wrapper the registry lists for ``ada-NAME``."""

    params = (ALPHA,)
    layers: list[RaggedLayer]  # type: ignore[assignment]  # the dense store's interface, ragged
    plain_feed = False  # its own append

    def __init__(self, info: ModelInfo, budget: Budget | None, params: dict, scorer: DenseCompressor, seed: int = 0):
        super().__init__(info, budget, params, seed=seed)
        self.scorer = scorer

    def check_semantics(self) -> None:
        self.scorer.check_semantics()

    def plan_tokens(self, n_prompt: int) -> dict:
        self.scorer.decode_steps = self.decode_steps
        return {**self.scorer.plan(n_prompt), "alpha": float(self.cfg["alpha"])}

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return self.scorer.prefill_needs(n_prompt)

    def planned_tokens(self, n_prompt: int) -> int:
        return self.scorer.planned_tokens(n_prompt)

    def per_token_bytes(self, with_logw: bool = False) -> int:
        return self.scorer.per_token_bytes(with_logw)

    def fixed_stream_bytes(self) -> float:
        """The scorer's, and each head's int32 count of kept prompt tokens."""
        return self.scorer.fixed_stream_bytes() + 4

    def compress_tokens(self, state: PrefillState) -> None:
        n, n_layers, h = state.n_tokens, state.keys.shape[0], state.keys.shape[1]
        keep = torch.ones(n_layers, h, n, dtype=torch.bool, device=state.keys.device)
        rank = self.scorer.ranking(state)
        if rank is not None:
            keep[..., rank.head : n - rank.tail] = False
            m = rank.scores.shape[-1]
            budget = torch.tensor(rank.budgets, device=rank.scores.device)
            counts = joint_allocation(rank.scores, budget, float(self.cfg["alpha"]))
            keep[..., rank.start : rank.start + m] = ranked_keep(rank.scores, counts)
        positions = torch.arange(n, device=keep.device)
        planned = [n] * n_layers if rank is None else [rank.head + b + rank.tail for b in rank.budgets]
        self.layers = []
        self.n_prompt, self.local_held, self.local_reserve = n, {}, {}
        for layer in range(n_layers):
            cancel.checkpoint()
            mask, first = keep[layer], self.sem[layer].visible_from(n - 1)
            if first > 0:  # a local layer holds what its last query sees: each head's picks there, topped up
                mask = topped_up(mask & (positions >= first), mask.sum(-1).clamp(max=n - first), first)
            ks, vs = self.as_cached(state.keys[layer]), self.as_cached(state.values[layer])
            self.layers.append(RaggedLayer.kept(ks, vs, mask))
            if first > 0:  # held over the heads; the growth (and its reserve) per head, as ``append`` counts it
                kept = int(mask.sum())
                self.local_held[layer] = kept
                self.local_reserve[layer] = max(0, min(planned[layer], self.reach(layer, n)) - kept // h)

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        """The new tokens go to every head; on a local layer, what leaves the window goes, and the layer then
        holds at most what it held after compression (plus its window's growth): its oldest prompt tokens,
        whichever heads hold them, make room first."""
        cache, newest = self.layers[layer], pos + k.shape[-2] - 1
        cache.append(k, v, pos)
        s = self.sem[layer]
        if s.is_local:
            cache.drop_before(s.visible_from(newest))
        if layer in self.local_held:
            h = len(cache.counts)
            over = cache.held() - (self.local_held[layer] + h * self.local_growth(layer, newest))
            if over > 0:
                cache.drop_oldest(over)

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c tokens: appended to every head at once, one causal attention (a sliding-window
        layer, whose window moves with every token, takes them one at a time)."""
        if self.sem[layer].is_local:
            return Compressor.feed(self, layer, q, k, v, pos)
        return self._append_attend_block(layer, q, k, v, pos)

    def head_counts(self) -> Tensor:
        """[L, Hkv] int32: the prompt tokens each layer's KV heads hold."""
        return torch.stack([layer.counts for layer in self.layers])


@dataclass(frozen=True)
class Adaptive(Wrapper):
    """``ada-NAME``: the scorer ``inner`` held by an ``AdaKV`` cache."""

    no_composition: ClassVar[str] = (
        "its heads hold different token counts; a composition stores every head of a layer alike"
    )

    def make(self, info: ModelInfo, budget: Budget | None, params: dict, own: dict, seed: int) -> Compressor:
        scorer = self.inner(info, budget, params, seed=seed)
        assert isinstance(scorer, DenseCompressor) and scorer.ranks_prompt  # ``resolve`` admits scorers only
        ada = AdaKV(info, budget, own, scorer, seed=seed)
        ada.cfg = {**scorer.cfg, **ada.cfg}
        return ada


def adaptive(inner: type[DenseCompressor], **inner_defaults: Any) -> Adaptive:
    """``ada-NAME``: ``inner``'s scores and budgets with Ada-KV's allocation (``inner_defaults``: the scorer's
    parameters at other defaults)."""
    return Adaptive(
        inner,
        PREFIX + inner.name,
        title=f"Ada-{inner.title}",
        summary=f"{inner.title}'s scores; each layer's budget spread over its KV heads by one joint top-k "
        "(each head at least alpha of the uniform share).",
        own_params=(ALPHA,),
        group="recent",
        paper=PAPER,
        inner_defaults=tuple(inner_defaults.items()),
    )


def resolve(name: str, lookup: Callable[[str], Any]) -> Adaptive | None:
    """``ada-NAME`` for a method that ranks the prompt (``ranks_prompt``; not a wrapper) -> its wrapper; else None."""
    inner = prompt_scorer(name, PREFIX, lookup)
    return None if inner is None else adaptive(inner)
