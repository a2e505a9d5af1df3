"""Score-based token selection: streaming eviction by running scores, and prompt-time scorers.

``PromptScored`` (at the end of this file) is the prompt-time kind: a subclass returns one score
per prompt token, layer and KV head, and the base keeps the best ones the budget allows plus the
prompt's last tokens (SnapKV, KNorm, KeyDiff).

``ScoredEvictionCompressor`` is the streaming kind (Scissorhands, H2O).

Both keep, per layer and KV head, full-precision tokens plus one score per kept token, protect the
most recent tokens, and evict the tokens whose score marks them least useful when the cache grows
past its capacity. They differ in what the score is and in which direction is "worse":

* H2O: accumulated attention (float32); evict the lowest.
* Scissorhands: how often a token's attention fell below 1/t (int16 counter); evict the highest.

A subclass sets ``score_dtype``, ``evict_highest``, ``reset_after_eviction``, implements
``initial_scores(state)`` (the scores that rank the prompt tokens for the prefill eviction and the
scores the survivors carry into decoding, both [L, Hkv, n]) and ``observe(layer, attn)`` (fold one
decode step's pooled attention [Hkv, n] into the scores), and sets ``self.capacity``,
``self.recent`` and ``self.full`` in ``plan``.
Eviction happens in ``append``, before the new token's query attends, so the cache never holds
more than ``capacity`` tokens, not even during attention.

A chunk of new tokens (``feed``) runs in blocks between evictions: while the cache has room for a
block, its tokens are appended at once and attend in one causal attention, and each query's row is
then folded into the scores in order, as that many decode steps would; a token whose append evicts
goes alone. The score updates are those of feeding the tokens one by one, call for call; only the
block's attention is one matrix product, which may round a probability's last bit differently.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from kernels.tensor_ops import gather_tokens
from kvlab.core.attention_ops import pool_heads
from kvlab.methods.dense import DenseCompressor, DenseLayer, Ranking
from kvlab.methods.handover import PrefillState

T = TypeVar("T")


def eviction_keep(key: Tensor, n_drop: int, recent: int) -> Tensor:
    """Indices of the tokens to keep after dropping the ``n_drop`` tokens with the largest ``key``.

    key: [..., H, n] eviction priority (larger = dropped first); the last ``recent`` tokens are
    never dropped; among equal keys the earlier token goes first. Returns [..., H, n - n_drop]
    (int64, ascending, so the cache keeps its positional order).
    """
    n = key.shape[-1]
    if n_drop <= 0:
        return torch.arange(n, device=key.device).expand(*key.shape)
    candidates = n - recent
    if n_drop > candidates:
        raise ValueError(f"cannot drop {n_drop} of {n} tokens while protecting the last {recent}")
    if n_drop == 1:  # one token (H2O's every step): the first largest key, no sort
        kept = torch.arange(n - 1, device=key.device)
        drop = key[..., :candidates].argmax(-1, keepdim=True)
        return kept + (kept >= drop)
    order = torch.sort(key[..., :candidates], dim=-1, descending=True, stable=True).indices
    keep = torch.ones(key.shape, dtype=torch.bool, device=key.device)
    keep.scatter_(-1, order[..., :n_drop], False)
    idx = torch.arange(n, device=key.device).expand(*key.shape)
    return idx[keep].view(*key.shape[:-1], n - n_drop)


def pooled_step_attention(probs: Tensor, n_kv_heads: int) -> Tensor:
    """One decode query's attention [Hq, 1, n] averaged over each KV group's query heads -> [Hkv, n]."""
    return pool_heads(probs.squeeze(-2), n_kv_heads, head_dim=-2, reduce="mean")


class _Room:
    """Spare room after a [H, n] tensor's tokens: appending zeros costs a copy only when the room runs out."""

    __slots__ = ("buf",)

    def __init__(self):
        self.buf: Tensor | None = None

    def extend(self, s: Tensor, m: int) -> Tensor:
        """``s`` [H, n] followed by ``m`` zero columns: a view of ``buf`` (reallocated, with amortized
        doubling, when ``s`` does not already start it, e.g. after an eviction made a new tensor)."""
        n, buf = s.shape[-1], self.buf
        if buf is None or buf.data_ptr() != s.data_ptr() or buf.stride() != s.stride() or n + m > buf.shape[-1]:
            buf = s.new_empty(s.shape[0], max(16, 2 * (n + m)))
            buf[:, :n] = s
            self.buf = buf
        buf[:, n : n + m] = 0
        return buf[:, : n + m]


class ScoredEvictionCompressor(DenseCompressor):
    """A dense cache with one score per kept token (per layer and KV head) and score-driven eviction."""

    streaming = True
    wants_probs = True
    score_dtype: ClassVar[torch.dtype] = torch.float32
    evict_highest: ClassVar[bool] = False
    reset_after_eviction: ClassVar[bool] = False  # survivors start from zero after a decode eviction
    plain_feed = False  # appending evicts and attending updates the scores
    # declared: append, attend and the score update are this class's own, so a fed chunk's tokens that fit
    # without eviction go in blocks (``_feed_block``). A subclass that overrides one of them sets it False.
    feeds_in_blocks: ClassVar[bool] = True

    # set by plan(): capacity (tokens per layer and head), recent (never evicted), full (no eviction)
    capacity: int
    recent: int
    full: bool
    position: int = 0  # true position of the query now attending (the newest token's)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scores: list[Tensor] = []
        self._score_room: dict[int, _Room] = defaultdict(_Room)  # per layer: where scores grow without a copy

    # ----- what subclasses provide --------------------------------------------------------
    def initial_scores(self, state: PrefillState) -> tuple[Tensor, Tensor]:
        """(scores ranking the prompt tokens for the prefill eviction, scores they carry on), each [L, Hkv, n]."""
        raise NotImplementedError

    def observe(self, layer: int, attn: Tensor) -> None:
        """Fold this step's pooled attention ``attn`` [Hkv, n] into ``self.scores[layer]``."""
        raise NotImplementedError

    def prefill_drop(self, n: int, layer: int = 0) -> int:
        """How many prompt tokens the prefill compression drops (in ``layer``)."""
        return max(0, n - self.layer_capacity(layer))

    def decode_drop(self, n: int, layer: int = 0) -> int:
        """How many tokens to drop when an append takes ``layer``'s cache to ``n`` > its capacity."""
        return n - self.layer_capacity(layer)

    layer_caps: list[int] | None = None  # set by plan() on a model with local layers (None: ``capacity`` everywhere)

    def plan(self, n_prompt: int) -> dict:
        knobs = super().plan(n_prompt)
        self.layer_caps = self.spread_capacity(n_prompt, self.capacity)
        return knobs if self.layer_caps is None else {**knobs, "layer_capacity": self.layer_caps}

    def spread_capacity(self, n_prompt: int, capacity: int) -> list[int] | None:
        """Per-layer capacities on a model with local layers: a window that holds fewer than ``capacity``
        tokens (a chunked layer's block, up to the horizon: ``reach``) leaves the rest of its share to the
        global layers, evenly (``spread_over_layers``); a local layer keeps ``capacity`` as its own cap (its
        window drops tokens before the cap is reached). The global layers then take what the plan's peak over
        the horizon still leaves (``held_per_step``: a chunked layer holds its most only late in a block, and
        an eviction of several tokens at once leaves a global layer under its cap until it refills). None when
        every layer can hold ``capacity`` (always on a model without local layers)."""
        if self.full or not self.sem.has_local:
            return None
        n_layers = self.info.n_layers
        held = self.spread_over_layers(n_prompt, [capacity] * n_layers)
        if held == [min(capacity, n_prompt)] * n_layers:
            return None
        caps = [capacity if s.is_local else c for s, c in zip(self.sem.layers, held)]
        return self._fill_global(n_prompt, caps)

    def _fill_global(self, n: int, caps: list[int]) -> list[int]:
        """``caps`` with the largest extra capacity on every global layer (the same for each, at most up to the
        prompt) whose ``peak_ratio`` still fits the budget; ``caps`` itself when none fits."""

        def raised(extra: int) -> list[int]:
            return [c if s.is_local else min(n, c + extra) for s, c in zip(self.sem.layers, caps)]

        if self.budget is None or self.peak_ratio(n, raised(1)) > 1.0:
            return caps
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.peak_ratio(n, raised(mid)) <= 1.0 else (lo, mid - 1)
        return raised(lo)

    def drop_size(self, capacity: int) -> int:
        """Tokens one eviction drops from a layer of ``capacity`` that an append took one past it (1: one a step;
        Scissorhands drops m at once)."""
        return 1

    def held_per_step(self, n: int, caps: list[int], steps: int) -> Tensor:
        """Tokens per KV head each layer holds with capacities ``caps`` after the prefill of ``n`` tokens and each
        of ``steps`` decode steps: int64 [L, steps + 1]. A global layer keeps its capacity less one eviction's
        drop (``drop_size``) and refills; a local layer at most what its queries see (and its capacity: a bound
        where drops of several tokens cut deeper)."""
        s = torch.arange(steps + 1, dtype=torch.int64)
        rows = []
        for sem, cap in zip(self.sem.layers, caps):
            if sem.is_local:
                rows.append(sem.sees_many(n + s).clamp(max=cap))
                continue
            m = max(1, min(self.drop_size(cap), cap))
            t = s + (n if n <= cap else n - max(m, n - cap))
            rows.append(torch.where(t <= cap, t, cap - m + 1 + (t - cap - 1) % m))
        return torch.stack(rows)

    def peak_ratio(self, n: int, caps: list[int]) -> float:
        """The largest ratio of bytes held (``held_per_step``) to bytes allowed, from the prefill to the horizon."""
        assert self.budget is not None
        h = self.horizon(n)
        tokens = self.held_per_step(n, caps, h).sum(0).double()
        info = self.info
        held = info.n_kv_heads * (tokens * self.per_token_bytes() + info.n_layers * self.fixed_stream_bytes())
        return float((held / self.budget.allowed_per_step(info, n, h, True)).max())

    def budget_ratio(self, n_prompt: int) -> float | None:
        """Spread over a model's local layers: the peak over the horizon (``peak_ratio``); else the dense store's."""
        if self.full or self.layer_caps is None:
            return super().budget_ratio(n_prompt)
        return self.peak_ratio(n_prompt, [self.layer_capacity(i) for i in range(self.info.n_layers)])

    def planned_tokens(self, n_prompt: int) -> int:
        """After ``plan``: mean kept tokens per layer and KV head, rounded up (a local layer: what its window
        holds)."""
        if self.layer_caps is None:
            return super().planned_tokens(n_prompt)
        caps = enumerate(self.layer_caps)
        return math.ceil(sum(min(self.reach(i, n_prompt), c) for i, c in caps) / self.info.n_layers)

    def layer_capacity(self, layer: int) -> int:
        """Tokens per KV head ``layer`` holds at most (``capacity`` in every layer unless spread)."""
        return self.capacity if self.layer_caps is None else self.layer_caps[layer]

    def layer_recent(self, layer: int) -> int:
        """Last tokens of ``layer`` never evicted."""
        return self.recent

    # ----- the shared cache logic ---------------------------------------------------------
    def score_bytes(self) -> int:
        return torch.empty((), dtype=self.score_dtype).element_size()

    def per_token_bytes(self, with_logw: bool = False) -> int:
        """K, V and position of one kept token plus its score (per layer and KV head)."""
        return super().per_token_bytes(with_logw) + (0 if self.is_full else self.score_bytes())

    def set_full(self, full: bool) -> None:
        """No eviction at all: the cache is the exact one (positions 0..n-1 implied, no scores)."""
        self.full = full
        self.positions_implicit = full
        self.wants_probs = not full  # the scores need each step's attention, unless nothing is evicted

    def _priority(self, scores: Tensor) -> Tensor:
        return scores if self.evict_highest else -scores.float()

    def _layer_keep(self, rank: Tensor, drop: int, recent: int, first: int, pos: Tensor | None = None) -> Tensor:
        """``eviction_keep`` for one layer (rank [Hkv, n]; ``pos`` the tokens' positions, the prompt's 0..n-1
        when None); on a local layer whose window starts at ``first`` the tokens before it go first (its
        newest query no longer sees them), then the lowest ranked."""
        priority = self._priority(rank)
        if first > 0:
            n = rank.shape[-1]
            outside = (torch.arange(n, device=rank.device) if pos is None else pos) < first
            priority = priority.float().masked_fill(outside, math.inf)
            recent = min(recent, n - int(outside.sum(-1).max()))  # a local layer protects what its window shows
            drop = min(max(drop, int(outside.sum(-1).min())), n - recent)
        return eviction_keep(priority, drop, recent)

    def select(self, state: PrefillState):
        n_layers, n = state.keys.shape[0], state.n_tokens
        if self.full:
            self.scores = []
            return [None] * n_layers
        rank, carry = self.initial_scores(state)
        drops = [self.prefill_drop(n, i) for i in range(n_layers)]
        recents = [self.layer_recent(i) for i in range(n_layers)]
        firsts = [self.sem[i].visible_from(n - 1) for i in range(n_layers)]
        if len(set(drops)) == 1 and len(set(recents)) == 1 and not any(firsts):  # every layer alike: one call
            together = eviction_keep(self._priority(rank), drops[0], recents[0])
            self.scores = list(gather_tokens(carry.to(self.score_dtype), together).unbind(0))
            return together
        idx = [self._layer_keep(rank[i], drops[i], recents[i], firsts[i]) for i in range(n_layers)]
        self.scores = [gather_tokens(carry[i].to(self.score_dtype), ix) for i, ix in enumerate(idx)]
        return idx

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        self.position = pos + k.shape[1] - 1
        cache = self.layers[layer]
        cache.append(k, v, pos)
        if self.full:
            return
        self.scores[layer] = self._score_room[layer].extend(self.scores[layer], k.shape[1])
        first = self._window_start(layer)
        if first > 0:  # a local layer: the oldest tokens no head's window shows any more
            out = int((cache.positions() < first).sum(-1).min())
            if out:
                h, n = cache.positions().shape
                self._keep(layer, torch.arange(out, n, device=k.device).expand(h, n - out))
        if cache.n > self.layer_capacity(layer):
            self._evict(layer, self.decode_drop(cache.n, layer))

    def _window_start(self, layer: int) -> int:
        """The first position the newest query of ``layer`` sees (0 on a global layer)."""
        s = self.sem[layer]
        return s.visible_from(self.position) if s.is_local else 0

    def _keep(self, layer: int, idx: Tensor) -> None:
        self.layers[layer].keep(idx)
        s = self.scores[layer]
        self.scores[layer] = s.new_zeros(idx.shape) if self.reset_after_eviction else gather_tokens(s, idx)

    def _evict(self, layer: int, n_drop: int) -> None:
        first = self._window_start(layer)
        pos = self.layers[layer].positions() if first > 0 else None
        idx = self._layer_keep(self.scores[layer], n_drop, self.layer_recent(layer), first, pos)
        self._keep(layer, idx)

    def after_attend(self, layer: int, probs: Tensor) -> None:
        self.observe(layer, pooled_step_attention(probs, self.info.n_kv_heads))

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c new tokens (q [Hq, c, d], k/v [Hkv, c, d] at positions pos..pos+c-1) -> out [Hq, c, d].

        Blocks of tokens that all fit in the cache are appended together and attend in one causal
        attention; a token whose append evicts goes through ``append`` + ``attend`` alone.
        """
        if not self._feeds_blocks(layer):
            return super().feed(layer, q, k, v, pos)
        outs, i, c = [], 0, q.shape[-2]
        while i < c:
            room = c - i if self.full else self.layer_capacity(layer) - self.layers[layer].n
            if room > 0:
                b = min(room, c - i)
                outs.append(self._feed_block(layer, q[:, i : i + b], k[:, i : i + b], v[:, i : i + b], pos + i))
                i += b
            else:  # this token's append evicts
                self.append(layer, k[:, i : i + 1], v[:, i : i + 1], pos + i)
                outs.append(self.attend(layer, q[:, i : i + 1]))
                i += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)

    def _feeds_blocks(self, layer: int) -> bool:
        """True when this class feeds in blocks (``feeds_in_blocks``) and the layer is a dense store (not a
        composition's compressed one)."""
        return self.feeds_in_blocks and isinstance(self.layers[layer], DenseLayer)

    def _feed_block(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """b tokens that fit without eviction: q [Hq, b, d], k/v [Hkv, b, d] -> out [Hq, b, d]."""
        b = q.shape[-2]
        if not self.full:
            self.scores[layer] = self._score_room[layer].extend(self.scores[layer], b)
        if self.full or not self.wants_probs:
            self.position = pos + b - 1
            return self._append_attend_block(layer, q, k, v, pos)
        out, probs = self._append_attend_block(layer, q, k, v, pos, return_probs=True)
        self._observe_rows(layer, probs, pos)
        return out

    def _observe_rows(self, layer: int, probs: Tensor, pos: int) -> None:
        """Fold a block's causal attention probs [Hq, b, n] into the scores one query at a time, in order.

        Query t (position pos + t) is observed as its decode step would be: over the n - b + t + 1
        tokens it sees (its masked future is left out), with only those tokens' scores in place.
        """
        pooled = pool_heads(probs, self.info.n_kv_heads, head_dim=-3, reduce="mean")  # [Hkv, b, n]
        b, n = pooled.shape[-2:]
        scores = self.scores[layer]
        for t in range(b):
            seen = n - b + t + 1
            self.position = pos + t
            view = scores[:, :seen]
            self.scores[layer] = view
            self.observe(layer, pooled[:, t, :seen])
            if self.scores[layer] is not view:  # an observe that replaced the scores instead of adding in place
                view.copy_(self.scores[layer])
        self.scores[layer] = scores

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from super().tensors()
        for s in self.scores:
            yield "scores", s


def with_window(top: Tensor, n: int, window: int) -> Tensor:
    """Chosen prefix indices [..., Hkv, k] (any order) -> sorted, followed by the window: [..., Hkv, k + window]."""
    win = torch.arange(n - window, n, device=top.device).expand(*top.shape[:-1], window)
    return torch.cat([top.sort(-1).values, win], -1)


def top_prefix_plus_window(scores: Tensor, keep: int, n: int, window: int) -> Tensor:
    """Indices [..., Hkv, keep + window]: the ``keep`` best prefix tokens (sorted) then the window."""
    return with_window(torch.topk(scores, keep, dim=-1).indices, n, window)


class PromptScored(DenseCompressor):
    """A prompt-time scorer: one score per prompt token, layer and KV head picks what is kept.

    A subclass implements ``scores(state)`` -> [L, Hkv, n] (or [L, Hkv, n - window]: the window's
    columns are never read), higher = keep. ``plan`` turns the budget into ``capacity`` tokens per
    layer and KV head (``tokens_for_budget``); ``select`` keeps, per layer and KV head, the last
    ``window`` prompt tokens (``recent_window()``, the ``window`` parameter by default, shrunk to the
    capacity) and the ``capacity - window`` best-scored tokens before them, in position order. A
    subclass may set ``layer_keep`` in ``plan`` (tokens kept besides the window, per layer) to spread
    the same total unevenly over the layers. Prefill-only: generated tokens are all kept.
    """

    # set by plan(): capacity (tokens per layer and KV head), window (last prompt tokens always kept),
    # full (nothing dropped)
    capacity: int
    window: int
    full: bool
    layer_keep: list[int] | None = None  # per layer: tokens kept besides the window (None: capacity - window)

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n] (or [L, Hkv, n - window]) scores of the prompt tokens; higher = keep."""
        raise NotImplementedError

    ranks_prompt = True

    def shared(self, state: PrefillState, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()`` once per prefill for this class and ``key`` (what the result depends on besides the
        prompt: parameters, seed; never the budget): the budgets of a comparison share one prefill and reuse
        it (``PrefillState.memo``)."""
        full = (type(self).__qualname__, *key)
        if full not in state.memo:
            state.memo[full] = compute()
        return state.memo[full]

    def ranking(self, state: PrefillState) -> Ranking | None:
        """After ``plan``: the scores of the tokens before the window and each layer's budget for them (None:
        every token is kept)."""
        n = state.n_tokens
        if self.full or self.capacity >= n:
            return None
        return Ranking(self.scores(state)[..., : n - self.window], 0, self.prefix_budgets(n), tail=self.window)

    def prefix_budgets(self, n: int) -> list[int]:
        """After ``plan``: per layer, the tokens kept besides the window (``layer_keep``, else the capacity
        less the window everywhere), spread over the layers as they can hold them (``spread_over_layers``: a
        local layer keeps what its window shows, the rest of its share goes to the others)."""
        keep = self.layer_keep or [self.capacity - self.window] * self.info.n_layers
        return [c - self.window for c in self.spread_over_layers(n, [k + self.window for k in keep])]

    def recent_window(self) -> int:
        """Last prompt tokens kept whatever their score (0: none); the ``window`` parameter if there is one."""
        return int(self.cfg.get("window", 0))

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        self.capacity = self.tokens_for_budget(n_prompt)
        self.window = min(self.recent_window(), self.capacity, n_prompt)
        return {"capacity": self.capacity, "window": self.window, "prefix_kept": self.capacity - self.window}

    def select(self, state: PrefillState):
        n, n_layers = state.n_tokens, state.keys.shape[0]
        if self.full or self.capacity >= n:
            return [None] * n_layers
        prefix = self.scores(state)[..., : n - self.window]  # [L, Hkv, n - window]
        budgets = self.prefix_budgets(n)
        if self.layer_keep is None and len(set(budgets)) == 1:
            return top_prefix_plus_window(prefix, budgets[0], n, self.window)
        ranked = torch.topk(prefix, max(budgets), dim=-1).indices  # [L, Hkv, kmax], best first
        return [with_window(ranked[layer, :, :k], n, self.window) for layer, k in enumerate(budgets)]
