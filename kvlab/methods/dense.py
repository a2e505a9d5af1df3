"""The dense token store most methods share: full-precision kept tokens per layer, their positions and
optional log-weights (``DenseLayer``), and ``DenseCompressor``, a method whose cache is that store.

A ``DenseCompressor`` subclass implements ``plan_tokens(n_prompt)`` (its knobs for the budget) and
``select(state)`` (the kept token indices per layer) or ``compress_tokens(state)``, optionally
``log_weights``; decoding appends to the store and attends with softmax over it.

``plan`` and ``compress`` are this class's own: they run the subclass's ``plan_tokens`` /
``compress_tokens`` and, when a composition gave the method a ``TokenStorage`` (``snapkv+kivi2``,
``h2o+qjl``: ``kvlab.methods.composed``), hand the kept tokens to it; its bytes per token are what
the budget pays for.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from kernels import Segment, use_triton
from kernels.decode_attention import decode_attention as kernel_decode_attention
from kernels.tensor_ops import gather_tokens
from kvlab.core import cancel
from kvlab.core import semantics as sm
from kvlab.core.attention_ops import weights_on_positions
from kvlab.core.budgets import TOLERANCE, per_token_bytes
from kvlab.core.semantics import Keys
from kvlab.methods.base import Compressor
from kvlab.methods.handover import PrefillState


class _Growable:
    """A tensor that grows along dim -2 (tokens) with amortized doubling; ``view`` is the used part."""

    __slots__ = ("buf", "n")

    def __init__(self, t: Tensor):
        self.buf, self.n = t, t.shape[-2]

    def view(self) -> Tensor:
        return self.buf[..., : self.n, :]

    def append(self, x: Tensor) -> None:
        m = x.shape[-2]
        if self.n + m > self.buf.shape[-2]:
            cap = max(16, 2 * (self.n + m))
            new = self.buf.new_empty(*self.buf.shape[:-2], cap, self.buf.shape[-1])
            new[..., : self.n, :] = self.view()
            self.buf = new
        self.buf[..., self.n : self.n + m, :] = x
        self.n += m

    @classmethod
    def gathered(cls, x: Tensor, idx: Tensor, room: int = 16) -> _Growable:
        """The tokens ``idx`` [.., H, m] of x [.., H, n, d] in a new buffer with ``room`` tokens to spare:
        an eviction followed by an append (H2O's every step) then makes one copy, not two."""
        kept = gather_tokens(x, idx)
        out = cls(kept.new_empty(*kept.shape[:-2], kept.shape[-2] + room, kept.shape[-1]))
        out.buf[..., : kept.shape[-2], :] = kept
        out.n = kept.shape[-2]
        return out


def _positions(k: Tensor, pos: int) -> Tensor:
    """[Hkv, m, 1] int32 positions pos..pos+m-1 for the m tokens of ``k`` [Hkv, m, d]."""
    h, m = k.shape[0], k.shape[1]
    if m == 1:
        return torch.full((h, 1, 1), pos, dtype=torch.int32, device=k.device)
    return torch.arange(pos, pos + m, dtype=torch.int32, device=k.device).view(1, m, 1).expand(h, m, 1)


@dataclass
class DenseLayer:
    """One layer of a dense cache: full-precision kept tokens, their positions, optional log-weights.

    k, v: [Hkv, n, d]; pos: [Hkv, n] int32 (original token positions); logw: [Hkv, n] float32, the
    log of how many tokens each kept token stands for (None when all weights are 1).
    """

    k: _Growable
    v: _Growable
    pos: _Growable  # stored as [Hkv, n, 1]
    logw: _Growable | None = None  # stored as [Hkv, n, 1]

    @classmethod
    def make(cls, k: Tensor, v: Tensor, pos: Tensor, logw: Tensor | None = None) -> DenseLayer:
        return cls(
            _Growable(k.contiguous()),
            _Growable(v.contiguous()),
            _Growable(pos.to(torch.int32).unsqueeze(-1).contiguous()),
            None if logw is None else _Growable(logw.float().unsqueeze(-1).contiguous()),
        )

    @property
    def n(self) -> int:
        return self.k.n

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        lw = None if self.logw is None else self.logw.view().squeeze(-1)
        return self.k.view(), self.v.view(), self.pos.view().squeeze(-1), lw

    def positions(self) -> Tensor:
        """[Hkv, n] int32 positions of the kept tokens."""
        return self.pos.view().squeeze(-1)

    def read_views(self) -> tuple[Keys, Tensor, Tensor, Tensor | None]:
        """``views`` as attention reads them (a compressed store may hand ``ScoredKeys`` for the keys)."""
        return self.views()

    def append(self, k: Tensor, v: Tensor, pos: int) -> None:
        """Tokens k, v [Hkv, m, d] at positions pos..pos+m-1."""
        self.k.append(k)
        self.v.append(v)
        self.pos.append(_positions(k, pos))
        if self.logw is not None:
            self.logw.append(torch.zeros((k.shape[0], k.shape[1], 1), device=k.device))

    def keep(self, idx: Tensor) -> None:
        """Keep only the tokens ``idx`` [Hkv, m] (per head), in the given order."""
        self.k = _Growable.gathered(self.k.view(), idx)
        self.v = _Growable.gathered(self.v.view(), idx)
        self.pos = _Growable.gathered(self.pos.view(), idx)
        if self.logw is not None:
            self.logw = _Growable.gathered(self.logw.view(), idx)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        k, v, pos, lw = self.views()
        yield "keys", k
        yield "values", v
        yield "positions", pos
        if lw is not None:
            yield "log_weights", lw


@dataclass
class Ranking:
    """A prompt-time scorer's choice before it is made (what ``ada-`` spreads over the heads, ``adakv``).

    Every head keeps the first ``head`` and the last ``tail`` prompt tokens; ``scores`` [L, Hkv, m] rank
    the tokens ``start .. start + m - 1`` (higher = keep; ``start >= head``, ``start + m <= n - tail``),
    of which each head of layer l keeps ``budgets[l]`` (uniformly; ``ada-`` redistributes them).
    """

    scores: Tensor
    start: int
    budgets: list[int]
    head: int = 0
    tail: int = 0


class KeptTokens(Protocol):
    """One layer's kept tokens as the dense methods use them: a ``DenseLayer``, or a composition's store
    of the same tokens in fewer bytes (``composed.TokenStore``)."""

    pos: _Growable  # [Hkv, n, 1] int32
    logw: _Growable | None  # [Hkv, n, 1] float32

    @property
    def n(self) -> int: ...

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]: ...

    def read_views(self) -> tuple[Keys, Tensor, Tensor, Tensor | None]: ...

    def positions(self) -> Tensor: ...

    def append(self, k: Tensor, v: Tensor, pos: int) -> None: ...

    def keep(self, idx: Tensor) -> None: ...

    def tensors(self) -> Iterator[tuple[str, Tensor]]: ...


class TokenStorage(Protocol):
    """How a composition holds a dense method's kept tokens (``kvlab.methods.composed.Storage``)."""

    def fit(self, n_prompt: int) -> None:
        """Before the method plans: set the storage's size knobs for the budget and prompt."""

    def kv_bytes(self) -> int:
        """One kept token's key and value in one layer and KV head, as stored."""
        ...

    def fixed_bytes(self) -> float:
        """Bytes per layer and KV head held besides the tokens (counted sketches), taken off the budget first."""
        ...

    def knobs(self) -> dict:
        """The storage's knobs, shown with the method's plan."""
        ...

    def stored(self, state: PrefillState, layers: list[KeptTokens]) -> list[KeptTokens]:
        """The method's compressed dense layers, held in this storage."""
        ...

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """What the storage holds per sequence besides the layers (counted sketches)."""
        ...

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Per-model tensors the storage shares across sequences."""
        ...


class DenseCompressor(Compressor):
    """A method whose cache is, per layer, full-precision kept tokens with optional log-weights.

    Subclasses implement ``select(state)`` returning, per layer, the kept token indices [Hkv, m]
    (a tensor [L, Hkv, m] or a list of per-layer tensors); optionally ``log_weights(state, idx)``.
    Eviction while decoding goes in ``after_attend``.
    """

    # set by a subclass's plan: tokens per layer and KV head the prefill compression keeps (None: all)
    capacity: int | None = None
    # set by a composition (``composed.Composition``): how the kept tokens are stored (None: dense)
    storage: TokenStorage | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers: list[KeptTokens] = []
        # prefill-only, per local layer: the prompt tokens held after compression (its share of the budget)
        self.local_held: dict[int, int] = {}
        # prefill-only, per local layer: how many tokens more than ``local_held`` it may grow to while its queries
        # see more than its exact cache grows by (a chunked layer inside a block): what its plan kept for them
        self.local_reserve: dict[int, int] = {}
        self.n_prompt = 0

    # ----- what a subclass provides ----------------------------------------------------------
    def plan_tokens(self, n_prompt: int) -> dict:
        """The method's knobs for the budget (``Compressor.plan``); ``plan`` adds the storage's."""
        return {}

    def select(self, state: PrefillState):
        raise NotImplementedError

    def log_weights(self, state: PrefillState, idx: list[Tensor]) -> list[Tensor] | None:
        return None

    positions_implicit: bool = False  # True when kept positions follow from counts alone (set per instance too)
    # declared: append and attend are the dense store's own (no eviction, no per-step scores), so a chunk
    # fed after compression is appended at once and attended in one call. A subclass that overrides
    # ``append`` or ``attend`` sets it False (tests/test_all_methods.py checks every method's declaration).
    plain_feed: ClassVar[bool] = True
    # declared: ``ranking(state)`` gives the prompt's scores before the choice, so Ada-KV's allocation can
    # wrap the method (``ada-NAME``, ``kvlab.methods.adakv``)
    ranks_prompt: ClassVar[bool] = False
    # declared: one capacity on every layer, a local layer's capped by its window (``capacity_over_windows``
    # plans it), so ``planned_bytes`` counts each layer's own
    window_capped: ClassVar[bool] = False

    def ranking(self, state: PrefillState) -> Ranking | None:
        """After ``plan``, for a method that ``ranks_prompt``: its scores before the choice (None: it keeps every
        token)."""
        raise NotImplementedError(f"{self.name} does not rank the prompt")

    # ----- the token storage of a composition ----------------------------------------------------
    def held_in(self) -> TokenStorage | None:
        """The composition's storage the kept tokens go to (None: dense, and at budget 1.0, the exact cache)."""
        return None if self.is_full else self.storage

    def plan(self, n_prompt: int) -> dict:
        storage = self.held_in()
        if storage is not None:
            storage.fit(n_prompt)
        knobs = self.plan_tokens(n_prompt)
        return knobs if storage is None else {**knobs, **storage.knobs()}

    def compress(self, state: PrefillState) -> None:
        self.compress_tokens(state)
        storage = self.held_in()
        if storage is not None:
            self.layers = storage.stored(state, self.layers)

    def per_token_bytes(self, with_logw: bool = False) -> int:
        """Bytes one kept token costs in one layer and KV head: K, V (as the storage holds them), its int32
        position (+ log-weight)."""
        storage = self.held_in()
        kv = per_token_bytes(self.info) if storage is None else storage.kv_bytes()
        return kv + (0 if self.positions_implicit else 4) + (4 if with_logw else 0)

    def tokens_for_budget(self, n_prompt: int, with_logw: bool = False) -> int:
        """How many tokens per layer and head fit the byte budget (all of them for budget 1.0 or none)."""
        budget = self.budget
        if budget is None or self.is_full:
            return n_prompt
        if budget.tokens is not None:  # that many tokens, fewer when their overheads pass the tolerance
            worth = budget.tokens * per_token_bytes(self.info) * (1 + TOLERANCE)
            return max(1, min(budget.tokens, n_prompt, int(worth // self.per_token_bytes(with_logw))))
        target = budget.target_bytes(self.info, n_prompt) / (self.info.n_layers * self.info.n_kv_heads)
        storage = self.held_in()
        fixed = 0.0 if storage is None else storage.fixed_bytes()  # a storage's counted sketches: paid for first
        return max(1, min(n_prompt, int((target - fixed) // self.per_token_bytes(with_logw))))

    def spread_over_layers(self, n_prompt: int, shares: list[int]) -> list[int]:
        """Per-layer token counts ``shares`` (per KV head) as the layers can hold them: a local layer whose
        queries see fewer tokens (its window; a chunked layer's block, up to the plan's horizon: ``reach``)
        keeps all of them, and what its share leaves goes to the layers that can hold more, evenly
        (water-filling). Unchanged on a model without local layers."""
        return water_fill(shares, [self.reach(i, n_prompt) for i in range(len(self.sem.layers))])

    def planned_tokens(self, n_prompt: int) -> int:
        """After ``plan``: tokens per layer and KV head the prefill compression keeps (the capacity by default)."""
        return n_prompt if self.capacity is None else min(n_prompt, self.capacity)

    def layer_tokens(self, n_prompt: int) -> list[int]:
        """After ``plan``: per layer, the most tokens per KV head the plan lets it hold after compression and while
        its queries see more (``planned_tokens``, a local layer's at most its ``reach``)."""
        kept = self.planned_tokens(n_prompt)
        return [min(kept, self.reach(i, n_prompt)) for i in range(self.info.n_layers)]

    def planned_logw(self) -> bool:
        """After ``plan``: whether kept tokens carry a log-weight."""
        return False

    def window_capped_bytes(self, n_prompt: int, kept: int) -> float:
        """The bytes of ``kept`` tokens on every layer, a local layer's capped by what its window shows (a
        plain store keeps only that, ``compress_tokens``; a chunked layer's block up to the horizon, ``reach``),
        + fixed bytes: a capacity's cost on a model with local layers."""
        tokens = sum(min(kept, self.reach(i, n_prompt)) for i in range(len(self.sem.layers)))
        per_token = self.per_token_bytes(self.planned_logw())
        return self.info.n_kv_heads * (tokens * per_token + self.info.n_layers * self.fixed_stream_bytes())

    def capacity_over_windows(self, n_prompt: int, capacity: int) -> int:
        """The largest capacity, from ``capacity`` up to the prompt, whose ``window_capped_bytes`` fit the
        budget after prefill: the share a window cannot hold goes to the global layers (``capacity`` itself
        on a model without local layers)."""
        if not self.sem.has_local:
            return capacity
        allowed = self.allowed(n_prompt, 0)
        lo, hi = capacity, n_prompt
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.window_capped_bytes(n_prompt, mid) <= allowed else (lo, mid - 1)
        return lo

    def fixed_stream_bytes(self) -> float:
        """Bytes per layer and KV head held besides the kept tokens (e.g. a storage's counted sketches)."""
        storage = self.held_in()
        return 0.0 if storage is None else storage.fixed_bytes()

    def planned_bytes(self, n_prompt: int) -> float:
        """After ``plan``: the bytes the compressed prompt will hold (kept tokens x their cost, + fixed bytes;
        ``window_capped``: a local layer's tokens capped by its window)."""
        if self.window_capped and self.sem.has_local:
            return self.window_capped_bytes(n_prompt, self.planned_tokens(n_prompt))
        per_stream = self.planned_tokens(n_prompt) * self.per_token_bytes(self.planned_logw())
        return self.info.n_layers * self.info.n_kv_heads * (per_stream + self.fixed_stream_bytes())

    def budget_ratio(self, n_prompt: int) -> float | None:
        """Kept tokens are the most held after prefill: a streaming eviction holds its capacity while the
        allowance grows; a prefill-only method's generated tokens are allowed on top."""
        return self.planned_bytes(n_prompt) / max(1.0, self.allowed(n_prompt, 0))

    def compress_tokens(self, state: PrefillState) -> None:
        """The dense layers of the tokens ``select`` keeps (a subclass may build them otherwise)."""
        idx = self.select(state)
        idx = [i for i in idx]
        lw = self.log_weights(state, idx)
        n = state.n_tokens
        self.layers = []
        self.n_prompt, self.local_held, self.local_reserve = n, {}, {}
        caps = self.layer_tokens(n)
        for layer, ix in enumerate(idx):
            cancel.checkpoint()
            if ix is None:  # keep everything
                h = state.keys.shape[1]
                ix = torch.arange(n, device=state.keys.device).expand(h, n)
            pos = ix.to(torch.int32)
            layer_lw = None if lw is None else lw[layer]
            first = self.sem[layer].visible_from(n - 1)
            if first > 0 and self._plain_feed():  # a local layer holds what its last query sees
                ix, layer_lw = _filled_recent(ix, layer_lw, first, n, caps[layer])
                pos = ix.to(torch.int32)
            self.layers.append(
                DenseLayer.make(
                    self.as_cached(gather_tokens(state.keys[layer], ix)),
                    self.as_cached(gather_tokens(state.values[layer], ix)),
                    pos,
                    layer_lw,
                )
            )
            if self.sem[layer].is_local and not self.streaming and self._plain_feed():
                self.hold_as_compressed(layer, self.layers[-1].n, caps[layer])

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        cache = self.layers[layer]
        cache.append(k, v, pos)
        s, newest = self.sem[layer], pos + k.shape[-2] - 1
        if _past_span(s, cache.n, newest, k.shape[-2]) and self._plain_feed():  # a local layer holds what it sees
            inside = _in_window(cache.views()[2], s.visible_from(newest))
            if inside is not None:
                cache.keep(inside)
        if layer in self.local_held:  # prefill-only on a local layer: generated tokens only as its exact view grows
            room = self.local_held[layer] + self.local_growth(layer, newest)
            if cache.n > room:
                cache.keep(_oldest_dropped(cache.positions(), cache.n - room))

    def hold_as_compressed(self, layer: int, kept: int, planned: int) -> None:
        """Record that the local ``layer`` holds ``kept`` tokens (per KV head, or over its heads where a method
        counts them so) after compression, of the ``planned`` its plan gave it: while decoding it then holds
        ``kept`` plus its exact cache's growth, and up to ``planned`` where its queries see more
        (``local_growth``, ``hold_local``)."""
        self.local_held[layer] = kept
        self.local_reserve[layer] = max(0, planned - kept)

    def local_growth(self, layer: int, newest: int) -> int:
        """What a local layer may add to what it held after compression (``local_held``) once the newest token
        is at ``newest`` and still hold its budget: the growth of its exact cache (0 once its window is full),
        and where its queries see more than that (a chunked layer inside a block: its exact cache holds a whole
        block throughout) the rest of what they see, up to its ``local_reserve``."""
        s, n = self.sem[layer], self.n_prompt
        exact = s.held(newest + 1) - s.held(n)
        seen = s.sees(newest + 1) - s.sees(n)
        return exact + min(max(0, seen - exact), self.local_reserve.get(layer, 0))

    def hold_local(self, layer: int, newest: int) -> int:
        """For a method with its own ``append``, after it: on a local layer, forget what the next query no
        longer sees, then the oldest tokens beyond what the layer held after compression (``local_held``,
        set by the method) plus ``local_growth``. Returns how many tokens were dropped."""
        cache, s = self.layers[layer], self.sem[layer]
        if not s.is_local:
            return 0
        before = cache.n
        inside = _in_window(cache.positions(), s.visible_from(newest))
        if inside is not None and inside.shape[-1] < cache.n:
            cache.keep(inside)
        if layer in self.local_held:
            room = self.local_held[layer] + self.local_growth(layer, newest)
            if cache.n > room:
                cache.keep(_oldest_dropped(cache.positions(), cache.n - room))
        return before - cache.n

    def visible(self, layer: int) -> tuple[Keys, Tensor, Tensor, Tensor | None]:
        """This layer's (k, v, pos, logw) as the newest token's query sees them (``read_views``: the keys may
        be ``ScoredKeys``): on a local layer the keys outside its window get a -inf log-weight
        (``semantics.window_bias``)."""
        k, v, pos, lw = self.layers[layer].read_views()
        s = self.sem[layer]
        if s.is_local and pos.numel():
            out = pos < s.visible_from(int(pos.max()))
            if bool(out.any()):
                hide = torch.zeros(pos.shape, device=pos.device).masked_fill_(out, float("-inf"))
                lw = hide if lw is None else lw + hide
        return k, v, pos, lw

    def attend(self, layer: int, q: Tensor) -> Tensor:
        k, v, _, lw = self.visible(layer)
        sem = self.sem[layer]
        if self.wants_probs:
            out, probs = sm.attend(q, k, v, sem, lw, return_probs=True)
            self.after_attend(layer, probs)
            return out
        if use_triton(q.device) and sem.plain and sem.v_dim == sem.k_dim and isinstance(k, Tensor):  # Triton, CUDA
            return kernel_decode_attention(q, [Segment(keys=k, values=v, log_weights=lw)], self.scaling)
        return sm.attend(q, k, v, sem, lw)

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """Vectorized when nothing evicts or scores per step: append all c tokens, one causal attention."""
        cache = self.layers[layer]
        if not self._plain_feed() or not isinstance(cache, DenseLayer) or self.sem[layer].is_local:
            return super().feed(layer, q, k, v, pos)
        return self._append_attend_block(layer, q, k, v, pos)

    def _append_attend_block(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int, return_probs: bool = False):
        """Append c tokens k/v [Hkv, c, d] to the dense store at once, then one causal attention of their
        queries q [Hq, c, d]: out [Hq, c, d] (and probs [Hq, c, n], zero on each query's future tokens)."""
        cache = self.layers[layer]
        cache.append(k, v, pos)
        keys, values, _, lw = cache.read_views()
        sem = self.sem[layer]
        return sm.attend(q, keys, values, sem, lw, return_probs=return_probs, causal_tail=q.shape[-2])

    def _plain_feed(self) -> bool:
        """True when append and attend are the dense store's own (``plain_feed``) and no step's attention is wanted."""
        return not self.wants_probs and self.plain_feed

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for layer in self.layers:
            for kind, t in layer.tensors():
                if not (self.positions_implicit and kind == "positions"):
                    yield kind, t
        storage = self.held_in()
        if storage is not None:
            yield from storage.tensors()

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        storage = self.held_in()
        if storage is not None:
            yield from storage.shared_tensors()

    def kept_positions(self, layer: int) -> Tensor | None:
        return self.layers[layer].positions()

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """Softmax over the kept tokens (with their log-weights), at their positions; 0 where evicted."""
        k, _, pos, lw = self.visible(layer)
        return weights_on_positions(q, k, pos, self.sem[layer], lw)


def water_fill(shares: list[int], caps: list[int]) -> list[int]:
    """``shares`` (one count per layer) capped by ``caps``, what the caps cut given evenly to the layers below
    their caps, again until none is left or every layer is at its cap (water-filling)."""
    out = [min(a, c) for a, c in zip(shares, caps)]
    surplus = sum(shares) - sum(out)
    while surplus > 0:
        room = [i for i, (o, c) in enumerate(zip(out, caps)) if o < c]
        if not room:
            break
        each, extra = divmod(surplus, len(room))
        for j, i in enumerate(room):
            add = min(each + (j < extra), caps[i] - out[i])
            out[i] += add
            surplus -= add
    return out


def _past_span(sem: sm.LayerSemantics, held: int, newest: int, m: int) -> bool:
    """Whether a local layer holding ``held`` tokens may hold some its next query no longer sees, after m new
    tokens up to position ``newest``: more than its window, or a chunk begun among the new tokens."""
    if not sem.is_local:
        return False
    span = sem.span
    return (span is not None and held > span) or (sem.chunk is not None and newest % sem.chunk < m)


def _filled_recent(ix: Tensor, lw: Tensor | None, first: int, n: int, cap: int) -> tuple[Tensor, Tensor | None]:
    """A local layer's kept indices ``ix`` [Hkv, m] (in order) without those before ``first``, which its last
    query no longer sees, topped up to ``cap`` tokens (at most the n - first it sees) with the newest ones
    not kept, at log-weight 0: a selection made over the whole prompt whose picks left the window then still
    uses the layer's share of the budget. Heads may keep different counts inside the window; each ends with
    the same count (more than ``cap`` only where a head kept more inside). Returns ([Hkv, m'], log-weights)."""
    h, span = ix.shape[0], n - first
    inside = ix >= first
    slot = (ix - first).clamp_min(0)
    taken = torch.zeros(h, span, dtype=torch.int32, device=ix.device).scatter_add_(1, slot, inside.int()) > 0
    held = taken.sum(-1, keepdim=True)
    want = max(min(cap, span), int(held.max()))
    free = ~taken
    rank = free.flip(-1).cumsum(-1).flip(-1)  # newest free token: 1
    keep = taken | (free & (rank <= want - held))
    idx = torch.arange(first, n, device=ix.device).expand(h, -1)[keep].view(h, -1)
    if lw is None:
        return idx, None
    w = torch.zeros(h, span, dtype=lw.dtype, device=lw.device).scatter_add_(1, slot, torch.where(inside, lw, 0))
    return idx, w[keep].view(h, -1)


def _oldest_dropped(pos: Tensor, n_drop: int) -> Tensor:
    """Indices [Hkv, m - n_drop] of the entries of ``pos`` [Hkv, m] (token positions) but the ``n_drop``
    oldest of each head, in order: a local layer whose exact cache no longer grows makes room for a new
    token by forgetting the oldest it kept."""
    order = torch.sort(pos, dim=-1, stable=True).indices[:, n_drop:]
    return order.sort(-1).values


def _in_window(pos: Tensor, first: int) -> Tensor | None:
    """Indices [Hkv, m'] of the entries of ``pos`` [Hkv, m] (token positions) that are >= ``first``, in
    order; None when the heads hold different counts of them (the window then hides the others)."""
    keep = pos >= first
    counts = keep.sum(-1)
    if bool((counts != counts[0]).any()):
        return None
    idx = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    return idx[keep].view(pos.shape[0], -1)


__all__ = ["DenseCompressor", "DenseLayer", "KeptTokens", "TokenStorage", "water_fill"]
