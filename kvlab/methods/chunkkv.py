"""ChunkKV: a prompt-time scorer's budget spent on whole chunks of consecutive tokens; and its entropy-gated
variant.

Liu, Tang, Dong, Li, Liu, Li, Hu, Chu. "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", NeurIPS 2025, https://arxiv.org/abs/2502.00299 — Sec. 3: the prompt is cut
into chunks of ``chunk_length`` consecutive tokens; a chunk's score is the mean of its tokens' scores
(attention of the observation window, SnapKV's), summed over the heads; the best chunks are kept whole, in
every head of the layer alike, so that a kept token keeps its phrase around it. The paper finds 10 a robust
chunk size (its default here); kvpress benchmarks its ``ChunkKVPress`` with 20.

It wraps any method that ranks the prompt (``ranks_prompt``), as kvpress's ``ChunkKVPress`` wraps a scorer
press: ``chunkkv-snapkv`` is registered, ``chunkkv-NAME`` is made on demand for the others. The scorer
plans (its per-layer budget, its window and sinks) and ranks (``ranking``); per layer:

1. token scores: the scorer's, summed over the KV heads; a token the scorer always keeps (its window, its
   sinks) scores the layer's largest score + 1 per head, as kvpress pads a scorer's window;
2. chunks from position 0 (the last one shorter), scored by their tokens' mean; chunks holding a token
   the scorer always keeps first, then by score;
3. whole chunks in that order until the scorer's per-head count is spent; the chunk where it runs out
   keeps its best tokens. Every head of the layer keeps the same tokens: the bytes are the scorer's.

The entropy-gated variant (``entropy-chunkkv-NAME``; kvpress's ``EntropyGatedChunkKVPress``, registered as
``entropy-chunkkv-snapkv``, defaults kvpress's: chunks of 10, spiky chunks cut to 4) measures each chunk's
normalised entropy of its token scores (negative scores shifted up to 0): a chunk scoring at or above the
median chunk with an entropy below the median (important but spiky: one token carries it) keeps only its
``low_entropy_chunk_length`` best tokens, and the freed budget goes to further chunks; what is left at the
end goes to the best remaining tokens.

Deviations (kvpress's presses are the reference for the entropy gate, which has no paper of its own):

* The budget is bytes, the scorer's per-layer token count; the chunk where it runs out keeps its best
  tokens (kvpress keeps ``int(chunks x (1 - ratio))`` whole chunks, the last one possibly the short tail).
* A chunk holding a token the scorer always keeps goes first and is never cut by the gate (kvpress ranks it
  by its mean, which its padded scores make the highest in practice): the scorer's window and sinks stay.
* The paper's layer-wise index reuse (adjacent layers sharing one choice, for speed) is not implemented,
  as in kvpress.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvlab.methods.dense import DenseCompressor, Ranking
from kvlab.methods.handover import PrefillState
from kvlab.methods.held_scorer import HeldScorer, ScorerWrapper, scorer_named
from kvlab.methods.params import Param

PREFIX = "chunkkv-"
GATED_PREFIX = "entropy-chunkkv-"
PAPER = (
    "Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference, "
    "NeurIPS 2025 (arXiv:2502.00299)"
)
CHUNK = Param("chunk_length", 10, "consecutive tokens per chunk (the paper's 10; kvpress benchmarks 20)", minimum=1)
GATED_PARAMS = (
    Param("chunk_length", 10, "consecutive tokens per chunk (kvpress's entropy-gated default)", minimum=2),
    Param("low_entropy_chunk_length", 4, "tokens an important but spiky chunk keeps (kvpress's)", minimum=1),
)
EPS = 1e-8  # kvpress's, in the entropy


def token_scores(rank: Ranking, n: int) -> tuple[Tensor, Tensor]:
    """Per layer, the scorer's scores summed over the KV heads on every prompt position: ([L, n], forced [n]).

    A token the scorer always keeps (``rank.head`` first, ``rank.tail`` last: ``forced``) scores the layer's
    largest score + 1 per head; a token it neither ranks nor keeps, the layer's smallest summed score."""
    s = rank.scores.float()  # [L, H, m]
    h, m = s.shape[1], s.shape[-1]
    summed = s.sum(1)  # [L, m]
    out = summed.amin(-1, keepdim=True).expand(-1, n).clone()
    out[:, rank.start : rank.start + m] = summed
    forced = torch.zeros(n, dtype=torch.bool, device=s.device)
    forced[: rank.head] = True
    forced[n - rank.tail :] = True
    top = h * (s.reshape(s.shape[0], -1).amax(-1, keepdim=True) + 1)  # [L, 1]
    return torch.where(forced, top, out), forced


def chunked(x: Tensor, chunk: int, fill: float) -> Tensor:
    """[L, n] -> [L, ceil(n / chunk), chunk], the last chunk padded with ``fill``."""
    n = x.shape[-1]
    pad = -n % chunk
    return torch.nn.functional.pad(x, (0, pad), value=fill).view(x.shape[0], -1, chunk)


def chunk_entropy(scores: Tensor, valid: Tensor) -> Tensor:
    """Normalised entropy of each chunk's token scores: scores [L, c, k], valid [c, k] -> [L, c] in [0, 1]
    (kvpress's: negative scores shifted up to 0, entropy over log(chunk size), 0 for a one-token chunk)."""
    x = scores.masked_fill(~valid, 0.0)
    low = x.masked_fill(~valid, math.inf).amin(-1, keepdim=True).clamp(max=0.0)
    x = (x - low).masked_fill(~valid, 0.0)
    p = x / (x.sum(-1, keepdim=True) + EPS)
    h = -(p * (p + EPS).log()).masked_fill(~valid, 0.0).sum(-1)
    size = valid.sum(-1).float()  # [c]
    norm = torch.where(size > 1, size.clamp(min=2).log(), torch.ones_like(size))
    return torch.where(size > 1, (h / norm).clamp(0.0, 1.0), torch.zeros_like(h))


def chunk_keep(scores: Tensor, forced: Tensor, counts: Tensor, chunk: int, spiky: int | None = None) -> Tensor:
    """ChunkKV's choice per layer: [L, n] bool, ``counts[l]`` tokens of layer l.

    scores [L, n] (``token_scores``), forced [n] (kept first), counts [L] int64. Chunks from position 0,
    forced ones first then by mean score, kept whole until the count is spent, the last one by its best
    tokens. With ``spiky`` (the entropy gate): a chunk at or above the median mean with an entropy below
    the median keeps only its ``spiky`` best tokens, and what is left at the end goes to the best others.
    """
    n_layers, n = scores.shape
    dev = scores.device
    tok = chunked(scores, chunk, -math.inf)  # [L, c, k]
    valid = chunked(torch.ones(1, n, dtype=torch.bool, device=dev), chunk, 0).bool()[0]  # [c, k]
    size = valid.sum(-1)  # [c]
    mean = tok.masked_fill(~valid, 0.0).sum(-1) / size
    has_forced = chunked(forced[None].float(), chunk, 0.0)[0].sum(-1) > 0  # [c]
    takes = size.expand(n_layers, -1).clone()
    if spiky is not None:
        entropy = chunk_entropy(tok, valid)
        cut = (mean >= mean.median(-1, keepdim=True).values) & (entropy < entropy.median(-1, keepdim=True).values)
        takes = torch.where(cut & ~has_forced, takes.clamp(max=spiky), takes)
    key = mean.masked_fill(has_forced, math.inf)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [L, c]
    sorted_takes = takes.gather(-1, order)
    before = sorted_takes.cumsum(-1) - sorted_takes
    taken = (counts[:, None] - before).clamp(min=0).minimum(sorted_takes)
    per_chunk = torch.zeros_like(taken).scatter_(-1, order, taken)  # [L, c]
    within = torch.sort(tok, dim=-1, descending=True, stable=True).indices  # [L, c, k]
    rank_in = torch.empty_like(within).scatter_(-1, within, torch.arange(chunk, device=dev).expand_as(within))
    keep = ((rank_in < per_chunk[..., None]) & valid).view(n_layers, -1)[:, :n]
    left = counts - keep.sum(-1)  # > 0 only when the gate cut more than the chunks left could take
    if bool((left > 0).any()):
        rest = scores.masked_fill(keep, -math.inf)
        order = torch.sort(rest, dim=-1, descending=True, stable=True).indices
        extra = torch.arange(n, device=dev)[None] < left[:, None]
        keep = keep | torch.zeros_like(keep).scatter_(-1, order, extra)
    return keep


class ChunkKV(HeldScorer):
    """ChunkKV's chunk-wise choice over a prompt-time scorer it holds (``scorer``; the module docstring).
    ``chunked_scorer(Inner)`` is the wrapper the registry lists for ``chunkkv-NAME``."""

    params: ClassVar[tuple[Param, ...]] = (CHUNK,)

    def own_knobs(self, n_prompt: int) -> dict:
        return {"chunk_length": int(self.cfg["chunk_length"])}

    def spiky(self) -> int | None:
        """Tokens an important but spiky chunk keeps (None: no entropy gate)."""
        return None

    def select(self, state: PrefillState):
        n, n_layers, h = state.n_tokens, state.keys.shape[0], self.info.n_kv_heads
        rank = self.scorer.ranking(state)
        if rank is None:
            return [None] * n_layers
        scores, forced = token_scores(rank, n)
        counts = torch.tensor([rank.head + b + rank.tail for b in rank.budgets], device=scores.device)
        keep = chunk_keep(scores, forced, counts, int(self.cfg["chunk_length"]), self.spiky())
        idx = torch.arange(n, device=scores.device)
        return [idx[keep[i]].expand(h, -1) for i in range(n_layers)]


class EntropyGatedChunkKV(ChunkKV):
    """ChunkKV with kvpress's entropy gate: important but spiky chunks keep their best few tokens."""

    params = GATED_PARAMS

    def own_knobs(self, n_prompt: int) -> dict:
        return {**super().own_knobs(n_prompt), "low_entropy_chunk_length": self.spiky()}

    def spiky(self) -> int | None:
        return int(self.cfg["low_entropy_chunk_length"])


def chunked_scorer(inner: type[DenseCompressor], gated: bool = False, **inner_defaults: Any) -> ScorerWrapper:
    """``chunkkv-NAME`` (``entropy-chunkkv-NAME`` when ``gated``): ``inner``'s budget spent on whole chunks."""
    gate = " (entropy-gated: a spiky chunk keeps its best few tokens)" if gated else ""
    return ScorerWrapper(
        inner,
        (GATED_PREFIX if gated else PREFIX) + inner.name,
        title=f"{'Entropy-gated ' if gated else ''}ChunkKV-{inner.title}",
        summary=f"{inner.title}'s budget spent on whole chunks of consecutive tokens, best mean score first, "
        f"the same in every head of a layer{gate}.",
        own_params=GATED_PARAMS if gated else (CHUNK,),
        group="recent",
        paper=PAPER,
        inner_defaults=tuple(inner_defaults.items()),
        cache=EntropyGatedChunkKV if gated else ChunkKV,
    )


def resolve(name: str, lookup: Callable[[str], Any]) -> ScorerWrapper | None:
    """``chunkkv-NAME`` or ``entropy-chunkkv-NAME`` for a method that ranks the prompt -> its wrapper; else None."""
    for prefix, gated in ((GATED_PREFIX, True), (PREFIX, False)):
        inner = scorer_named(name, prefix, lookup)
        if inner is not None:
            return chunked_scorer(inner, gated)
    return None
