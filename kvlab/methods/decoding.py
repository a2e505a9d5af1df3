"""Decode-time compression: a prompt scorer re-applied every N decode steps on the running cache.

NVIDIA kvpress 0.5.5, ``DecodingPress`` (``kvpress/presses/decoding_press.py``, with
``PrefillDecodingPress`` for the prompt), https://github.com/NVIDIA/kvpress: a scorer press (SnapKV,
KNorm, Expected Attention, ...) compresses the cache to ``target_size`` tokens once every
``compression_interval`` decode steps, scoring everything the cache holds then (the kept tokens and
the ones generated since). There is no paper: the press is the reference; the scorer's paper is the
inner method's. ``decoding-NAME`` wraps any registered method that ranks the prompt (declared
``ranks_prompt``, as ``ada-NAME`` does): ``decoding-snapkv`` and ``decoding-knorm`` are listed,
the others are made on demand (``decoding-expected-attention``, ``decoding-keydiff``, ...).

As kvlab runs it:

1. Prefill: the scorer compresses the prompt to T_0 tokens per layer and KV head.
2. Decoding: a layer holds its kept tokens and every token appended since its last compression; once
   N (``compression_interval``) tokens were appended since, the scorer ranks everything the layer holds
   and keeps T_k of it, before the next token is appended (what kvpress does after step N's forward,
   so every query attends over the same tokens as kvpress's). The bytes per step draw a saw-tooth
   between T_k and T_k + N tokens.
3. The budget caps the peak: T_k is the most tokens that, grown by the tooth's N tokens, the budget
   still allows at the tooth's last step (a fraction budget allows its share of every token seen, so
   T_k grows along a run). ``target_size`` fixes every T_k as kvpress's does (the plan refuses a
   target whose tooth passes the budget); ``compression_interval`` left unset is a fifth of the tokens
   the budget pays for at prefill (T = 4 N: the proportion of kvpress's defaults, 2048 and 512), and a
   plan shortens it while a tooth would leave a layer no token.

The scorer runs on the running cache through the hand-over it already reads (``ranking``): per layer, a
``PrefillState`` of the layer's kept keys and values (each head's in position order; n = what it
holds; ``next_position`` = the true position of the next token), the queries this cache holds and
their statistics, and a copy of the scorer for that one layer, planned for the layer's target. Every
head keeps the ranking's first ``head`` and last ``tail`` tokens (a window, sinks) and its best-scored
others up to the target. The prompt goes the same way, from the prefill's own state.

Bytes: the kept tokens (keys, values, an int32 position each) and the post-RoPE queries the cache holds
for the scorer (Q per layer: what the scorer asks for, at most N; none for a scorer of keys alone,
KNorm or KeyDiff), in the cache dtype. A query costs Hq/(2 Hkv) of a token: 1.5 tokens on the
embedded model. The plan pays for them before the tokens.

Deviations from kvpress:

* The budget caps the peak: kvpress compresses to ``target_size`` and lets the cache grow N tokens
  above it; here T + N (and the queries held) is what the budget allows.
* Queries: kvpress buffers the hidden states of the decode steps since the last compression (at most
  256) and recomputes the queries from them, not counted anywhere; kvlab holds the last Q post-RoPE
  queries, counted. kvpress's SnapKV rotates every buffered query by the current token's position
  (a decode step's position embeddings are the current token's alone); here each keeps its own.
* kvpress's ``DecodingPress`` leaves the prompt whole (``PrefillDecodingPress`` adds a prefill press);
  here the scorer compresses it, to T_0, so the budget holds from the first step.
* Every layer gets the same target (a sliding-window layer what its window holds, a chunked layer what
  its block shows it through the tooth, the rest to the others): a scorer's own split over the layers
  (PyramidKV's pyramid, KNorm's ``skip_layers``) is not kept. kvpress uses one target per layer too.
* A question fed after compression (the query-agnostic protocol) counts token by token; kvpress counts
  the question's forward as one step.
* On a sliding-window layer the scorer sees the kept tokens as consecutive (SnapKV then masks its
  window by index); tokens that left the window are dropped first, when every head holds the same
  count of them.
* Expected Attention on the running cache: the statistics of the Q queries held (the paper's decoding
  buffer), its future positions from the true next position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from kernels.tensor_ops import gather_tokens
from kvlab.core import cancel
from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.core.rope import Rotary
from kvlab.core.semantics import ModelSemantics
from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor, DenseLayer, _filled_recent, _in_window, water_fill
from kvlab.methods.handover import PrefillNeeds, PrefillState, QueryStats
from kvlab.methods.held_scorer import scorer_named
from kvlab.methods.params import Param
from kvlab.methods.wrapped import Wrapper

PREFIX = "decoding-"
KVPRESS = "NVIDIA kvpress 0.5.5, DecodingPress (github.com/NVIDIA/kvpress)"
INTERVAL = Param(
    "compression_interval",
    None,
    "decode steps between two compressions (none: a fifth of the tokens the budget pays for; kvpress: 512)",
    minimum=1,
    kind=int,
)
TARGET = Param(
    "target_size",
    None,
    "tokens per layer and KV head each compression keeps (none: what the budget allows less the interval; "
    "kvpress: 2048)",
    minimum=1,
    kind=int,
)
AUTO_SHARE = 5  # an interval left unset: the tokens paid for at prefill / 5, so that T = 4 N (kvpress: 2048 / 512)


def one_layer(info: ModelInfo, layer: int) -> ModelInfo:
    """``info`` as a model of the one layer ``layer`` (its attention semantics and rotation): what a copy of
    a scorer sees when it ranks that layer alone."""
    rope = None if info.rope is None else Rotary([info.rope.layer(layer)])
    return replace(info, n_layers=1, semantics=ModelSemantics((info.semantics[layer],)), rope=rope)


def layer_of(state: PrefillState, layer: int) -> PrefillState:
    """The prefill ``state`` restricted to one layer (what ``one_layer``'s scorer reads)."""

    def stats(s: QueryStats | None) -> QueryStats | None:
        return None if s is None else QueryStats(s.mean[layer : layer + 1], s.cov[layer : layer + 1], s.n, s.first_pos)

    sem = None if state.semantics is None else ModelSemantics((state.semantics[layer],))
    return PrefillState(
        keys=state.keys[layer : layer + 1],
        values=state.values[layer : layer + 1],
        queries=state.queries[layer : layer + 1],
        scaling=sem[0].scaling if sem is not None else state.scaling,
        semantics=sem,
        query_stats=stats(state.query_stats),
        query_stats_by_window={
            w: QueryStats(s.mean[layer : layer + 1], s.cov[layer : layer + 1], s.n, s.first_pos)
            for w, s in state.query_stats_by_window.items()
        },
    )


def ranked_indices(scores: Tensor, start: int, head: int, tail: int, n: int, target: int) -> Tensor:
    """[Hkv, target] ascending: each head keeps its first ``head`` and last ``tail`` of ``n`` tokens and its
    ``target - head - tail`` best-scored among ``scores`` [Hkv, m] (tokens start .. start + m - 1)."""
    h = scores.shape[0]
    keep = torch.zeros(h, n, dtype=torch.bool, device=scores.device)
    keep[:, :head] = True
    keep[:, n - tail :] = True
    b = min(target - head - tail, scores.shape[-1])
    if b > 0:
        top = torch.topk(scores.float(), b, dim=-1).indices + start
        keep.scatter_(1, top, True)
    return torch.arange(n, device=scores.device).expand(h, n)[keep].view(h, -1)


@dataclass(frozen=True)
class Tooth:
    """One compression and the tokens appended after it: at ``start`` decode steps done, each layer keeps
    ``targets`` tokens (per KV head), then grows by ``length`` before the next compression."""

    start: int
    length: int
    targets: tuple[int, ...]


class DecodingCompressor(DenseCompressor):
    """A scorer (``scorer_cls``, a method that ``ranks_prompt``) re-applied every N decode steps on the cache;
    ``decoding(Inner)`` is the wrapper the registry lists for ``decoding-NAME``."""

    streaming = True
    plain_feed = False  # its own append (compressions) and attend (the queries it holds)
    params = (INTERVAL, TARGET)

    def __init__(
        self,
        info: ModelInfo,
        budget: Budget | None,
        params: dict,
        scorer_cls: type[DenseCompressor],
        scorer_params: dict,
        seed: int = 0,
    ):
        super().__init__(info, budget, params, seed=seed)
        self.scorer_cls, self.scorer_params = scorer_cls, dict(scorer_params)
        self.scorer = scorer_cls(info, budget, scorer_params, seed=seed)  # the model's: its checks and knobs
        self.layer_infos = [one_layer(info, i) for i in range(info.n_layers)]
        self.full = False
        self.interval = 1
        self.held_queries = 0  # Q: queries held per layer for the scorer
        self.queries: list[Tensor] = []  # per layer [Hq, Q', d] (cache dtype), the last Q' <= Q queries
        self.since: list[int] = []  # per layer: tokens appended since its last compression
        self.work_dtype = torch.float32  # what the scorer reads (the prefill's dtype)
        self._targets: dict[tuple[int, int, int, int], tuple[int, ...]] = {}  # tooth_targets, computed once

    def check_semantics(self) -> None:
        self.scorer.check_semantics()

    # ----- the scorer, for one layer ---------------------------------------------------------------
    def scorer_for(self, layer: int, target: int, n: int) -> DenseCompressor:
        """A copy of the scorer for ``layer`` alone, planned to keep ``target`` of ``n`` tokens."""
        copy = self.scorer_cls(self.layer_infos[layer], Budget(tokens=target), self.scorer_params, seed=self.seed)
        copy.decode_steps = 0
        copy.plan(n)
        return copy

    def scorer_needs(self, n: int, target: int) -> PrefillNeeds:
        """What the scorer asks of a state of ``n`` tokens kept to ``target``; a running cache has queries and
        their statistics only (``ValueError`` for anything else)."""
        needs = self.scorer_for(0, max(1, min(target, n)), n).prefill_needs(n)
        wants = [
            what
            for what, asked in (
                ("the attention every prompt query paid", needs.acc_attn),
                ("an observer of the prefill", needs.observer is not None),
                ("a forward pass of its own", needs.model_access),
            )
            if asked
        ]
        if wants:
            raise ValueError(
                f"{self.name}: {self.scorer.name} needs {' and '.join(wants)}, which a running cache does not have; "
                "it cannot be re-applied while decoding"
            )
        return needs

    def choose(self, layer: int, state: PrefillState, target: int) -> Tensor | None:
        """[Hkv, target] indices of the tokens of ``state`` (one layer) the scorer keeps; None: all of them."""
        n = state.n_tokens
        if target >= n:
            return None
        rank = self.scorer_for(layer, target, n).ranking(state)
        if rank is None:
            return None
        return ranked_indices(rank.scores[0], rank.start, rank.head, rank.tail, n, target)

    # ----- the plan -------------------------------------------------------------------------------
    def query_bytes(self, q: int) -> int:
        """Bytes of ``q`` held queries in one layer."""
        return q * self.info.n_heads * self.sem[0].k_dim * self.info.dtype_bytes

    def checked_steps(self, length: int) -> tuple[int, ...]:
        """The steps of a tooth at which its bytes are checked: its first and last (held then grows by one
        token per layer and step, faster than any allowance), every one on a model with chunked layers
        (a chunk's start drops what the layer held)."""
        return tuple(range(length + 1)) if any(s.chunk for s in self.sem.layers) else (0, length)

    def restarted(self, layer: int, seen: int, j: int) -> int | None:
        """On a chunked layer: the tokens it holds ``j`` steps into a tooth begun with ``seen`` tokens seen, when
        a chunk began among those j tokens (every older token then leaves it); None otherwise."""
        chunk, last = self.sem[layer].chunk, seen + j - 1
        if chunk is None or j < 1 or last - last % chunk < seen:
            return None
        return last % chunk + 1

    def held_at(self, targets: tuple[int, ...], seen: int, j: int) -> int:
        """Tokens all layers hold (per KV head) ``j`` steps into a tooth that kept ``targets``, ``seen`` tokens
        seen at its start: each layer its target (at most what its queries saw then) plus j, a restarted chunk
        its own."""
        held = 0
        for layer, t in enumerate(targets):
            r = self.restarted(layer, seen, j)
            held += min(t, self.sem[layer].sees(seen)) + j if r is None else r
        return held

    def tooth_caps(self, seen: int, length: int) -> list[int]:
        """Per layer: the most tokens a compression ``seen`` tokens in may keep and still hold no more than the
        layer's queries see through the ``length`` steps that follow (``LayerSemantics.most_seen``, less the
        tooth's growth): all it saw on a global layer, a window less the tooth, on a chunked layer what its
        block showed then (a block ending inside the tooth: what it shows up to there, less the tooth)."""
        return [max(0, s.most_seen(seen, length) - length) for s in self.sem.layers]

    def tooth_targets(self, n: int, start: int, length: int, q: int) -> tuple[int, ...]:
        """Per layer: the tokens a compression at ``start`` decode steps keeps so that, at every step of the
        ``length`` that follow, the cache (and ``q`` queries per layer) holds at most what the budget allows.

        The most tokens, all layers together, spread evenly over the layers as they can hold them
        (``tooth_caps``: what a local layer cannot hold goes to the others, ``water_fill``), for which every
        checked step holds: the layers growing then (not restarted in a new block) hold their targets and one
        token a step, the restarted ones their block's tokens."""
        n_layers = self.info.n_layers
        if self.cfg["target_size"] is not None:
            return (int(self.cfg["target_size"]),) * n_layers
        key = (n, start, length, q)
        if key in self._targets:
            return self._targets[key]
        per, fixed, seen = self.info.n_kv_heads * self.per_token_bytes(), n_layers * self.query_bytes(q), n + start
        caps = self.tooth_caps(seen, length)
        room: dict[frozenset[int], float] = {}  # the layers growing at a step -> what their targets may sum to
        for j in self.checked_steps(length):
            left = (self.allowed(n, start + j) - fixed) / per
            growing = []
            for layer in range(n_layers):
                r = self.restarted(layer, seen, j)
                if r is None:
                    growing.append(layer)
                    left -= j
                else:
                    left -= r
            key_j = frozenset(growing)
            room[key_j] = min(room.get(key_j, float("inf")), left)

        def spread(total: int) -> list[int]:
            base, extra = divmod(total, n_layers)
            return water_fill([base + (i < extra) for i in range(n_layers)], caps)

        def fits(total: int) -> bool:
            out = spread(total)
            return all(sum(out[i] for i in layers) <= left for layers, left in room.items())

        lo, hi = 0, sum(caps)  # the largest total that fits (0 when none does: the plan then refuses the tooth)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        out = self._targets[key] = tuple(spread(lo))
        return out

    def schedule(self, n: int, interval: int, q: int) -> list[Tooth]:
        """Every tooth up to the horizon: the prefill's (start 0), then one every ``interval`` decode steps."""
        horizon, teeth, start = self.horizon(n), [], 0
        while True:
            length = max(0, min(interval, horizon - start))
            teeth.append(Tooth(start, length, self.tooth_targets(n, start, length, q)))
            start += interval
            if start >= horizon:
                return teeth

    def schedule_ratio(self, n: int, teeth: list[Tooth], q: int) -> float:
        """The largest ratio of the bytes held to the bytes allowed at the checked steps of every tooth (inf
        when a tooth leaves a layer no token)."""
        per, fixed = self.info.n_kv_heads * self.per_token_bytes(), self.info.n_layers * self.query_bytes(q)
        worst = 0.0
        for t in teeth:
            if min(t.targets) < 1:
                return float("inf")
            for j in self.checked_steps(t.length):
                held = self.held_at(t.targets, n + t.start, j)
                worst = max(worst, (per * held + fixed) / max(1.0, self.allowed(n, t.start + j)))
        return worst

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        if self.full:
            self.interval, self.held_queries = 0, 0
            return {"compression_interval": None, "target_size": None}
        horizon = self.horizon(n_prompt)
        asked = self.scorer_needs(n_prompt + horizon, n_prompt + horizon)
        ask = max(asked.query_window, asked.query_stats)
        paid = self.allowed(n_prompt, 0) / (self.info.n_kv_heads * self.per_token_bytes() * self.info.n_layers)
        given = self.cfg["compression_interval"]
        interval = int(given) if given is not None else max(1, round(paid / AUTO_SHARE))

        def fits(k: int) -> bool:
            q = min(ask, k)
            return self.schedule_ratio(n_prompt, self.schedule(n_prompt, k, q), q) <= 1.0

        if given is None and interval > 1 and not fits(interval):  # the largest shorter interval that fits
            lo, hi = 1, interval
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            interval = lo
        self.interval, self.held_queries = interval, min(ask, interval)
        first = self.schedule(n_prompt, interval, self.held_queries)[0]
        return {
            "compression_interval": interval,
            "target_size": self.cfg["target_size"],
            "first_target": min(first.targets),
            "queries_held": self.held_queries,
        }

    def budget_ratio(self, n_prompt: int) -> float | None:
        if self.full:
            return None
        q = self.held_queries
        return self.schedule_ratio(n_prompt, self.schedule(n_prompt, self.interval, q), q)

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        if self.full:
            return PrefillNeeds()
        first = self.schedule(n_prompt, self.interval, self.held_queries)[0]
        needs = self.scorer_needs(n_prompt, max(first.targets))
        return replace(needs, query_window=max(needs.query_window, min(self.held_queries, n_prompt)))

    # ----- the cache ------------------------------------------------------------------------------
    def compress_tokens(self, state: PrefillState) -> None:
        n, n_layers = state.n_tokens, state.keys.shape[0]
        self.n_prompt, self.local_held, self.work_dtype = n, {}, state.keys.dtype
        targets = (n,) * n_layers if self.full else self.schedule(n, self.interval, self.held_queries)[0].targets
        self.layers, self.since = [], [0] * n_layers
        for layer in range(n_layers):
            cancel.checkpoint()
            h = state.keys.shape[1]
            idx = None if self.full else self.choose(layer, layer_of(state, layer), targets[layer])
            if idx is None:
                idx = torch.arange(n, device=state.keys.device).expand(h, n)
            first = self.sem[layer].visible_from(n - 1)
            if first > 0:  # a local layer holds what its last query sees, topped up with the newest
                idx, _ = _filled_recent(idx, None, first, n, min(targets[layer], n))
            self.layers.append(
                DenseLayer.make(
                    self.as_cached(gather_tokens(state.keys[layer], idx)),
                    self.as_cached(gather_tokens(state.values[layer], idx)),
                    idx.to(torch.int32),
                )
            )
        q = min(self.held_queries, state.queries.shape[-2])
        self.queries = [
            self.as_cached(state.queries[layer, :, state.queries.shape[-2] - q :]) for layer in range(n_layers)
        ]

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        if not self.full and self.since[layer] >= self.interval:
            self.recompress(layer, pos)
        self.layers[layer].append(k, v, pos)
        self.since[layer] += k.shape[-2]
        self.hold_local(layer, pos + k.shape[-2] - 1)

    def attend(self, layer: int, q: Tensor) -> Tensor:
        out = super().attend(layer, q)
        if self.held_queries:
            held = torch.cat([self.queries[layer], self.as_cached(q)], dim=-2)
            self.queries[layer] = held[:, -self.held_queries :]
        return out

    attend_many: ClassVar[Any] = None

    def recompress(self, layer: int, pos: int) -> None:
        """The scorer ranks everything ``layer`` holds; it keeps this tooth's target (``pos``: the position of
        the token about to be appended, so ``pos - n_prompt`` decode steps are done)."""
        cancel.checkpoint()
        start = pos - self.n_prompt
        length = max(1, min(self.interval, self.horizon(self.n_prompt) - start))
        target = self.tooth_targets(self.n_prompt, start, length, self.held_queries)[layer]
        cache, sem = self.layers[layer], self.sem[layer]
        if sem.is_local:  # what the next query can no longer see goes first
            inside = _in_window(cache.positions(), sem.visible_from(pos))
            if inside is not None and inside.shape[-1] < cache.n:
                cache.keep(inside)
        idx = self.choose(layer, self.running_state(layer, pos), max(1, target))
        if idx is not None:
            cache.keep(idx)
        self.since[layer] = 0

    def running_state(self, layer: int, pos: int) -> PrefillState:
        """What ``layer`` holds, as the hand-over the scorer reads: its kept keys and values [1, Hkv, m, d], the
        queries held [1, Hq, Q', d] with their statistics, the next token at ``pos``."""
        k, v, _, _ = self.layers[layer].views()
        queries = self.queries[layer].to(self.work_dtype)
        sem = self.sem[layer]
        stats = None
        if queries.shape[-2] and self.info.rope is not None:
            stats = held_query_stats(queries, self.info.rope.layer(layer), pos)
        return PrefillState(
            keys=k.to(self.work_dtype).unsqueeze(0),
            values=v.to(self.work_dtype).unsqueeze(0),
            queries=queries.unsqueeze(0),
            scaling=sem.scaling,
            semantics=ModelSemantics((sem,)),
            query_stats=stats,
            next_position=pos,
        )

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from super().tensors()
        if self.held_queries:
            for q in self.queries:
                yield "queries", q


def held_query_stats(queries: Tensor, rotation: Any, pos: int) -> QueryStats:
    """Statistics of the q queries [Hq, q, d] (post-RoPE, at positions pos - q .. pos - 1) before RoPE:
    mean [1, Hq, d] and covariance [1, Hq, d, d] (float32, normalised by q)."""
    q = queries.shape[-2]
    x = queries.float()
    if rotation is not None:
        x = rotation.unrotate(x, torch.arange(pos - q, pos, device=x.device))
    mean = x.mean(-2)
    centred = x - mean.unsqueeze(-2)
    cov = centred.transpose(-1, -2) @ centred / q
    return QueryStats(mean=mean.unsqueeze(0), cov=cov.unsqueeze(0), n=q, first_pos=pos - q)


@dataclass(frozen=True)
class Decoding(Wrapper):
    """``decoding-NAME``: the scorer ``inner`` re-applied every N decode steps by a ``DecodingCompressor``."""

    streaming: ClassVar[bool] = True
    no_composition: ClassVar[str] = (
        "it re-ranks its cache while decoding; a composition stores the tokens a method keeps at prefill"
    )

    def make(self, info: ModelInfo, budget: Budget | None, params: dict, own: dict, seed: int) -> Compressor:
        assert issubclass(self.inner, DenseCompressor) and self.inner.ranks_prompt  # ``resolve`` admits scorers only
        comp = DecodingCompressor(info, budget, own, self.inner, params, seed=seed)
        comp.cfg = {**comp.scorer.cfg, **comp.cfg}
        return comp


def decoding(inner: type[DenseCompressor], **inner_defaults: Any) -> Decoding:
    """``decoding-NAME``: ``inner``'s ranking re-applied every N decode steps (``inner_defaults``: the scorer's
    parameters at other defaults)."""
    return Decoding(
        inner,
        PREFIX + inner.name,
        title=f"{inner.title} while decoding",
        summary=f"{inner.title}'s ranking re-applied to the whole cache every N decode steps, so the budget "
        "holds while generating (kvpress's DecodingPress).",
        own_params=(INTERVAL, TARGET),
        group="recent",
        paper=f"{inner.paper}; {KVPRESS}",
        inner_defaults=tuple(inner_defaults.items()),
    )


def resolve(name: str, lookup: Callable[[str], Any]) -> Decoding | None:
    """``decoding-NAME`` for a method that ranks the prompt (``ranks_prompt``; not a wrapper) -> its wrapper;
    else None."""
    inner = scorer_named(name, PREFIX, lookup)
    return None if inner is None else decoding(inner)


__all__ = ["DecodingCompressor", "Decoding", "decoding", "resolve"]
