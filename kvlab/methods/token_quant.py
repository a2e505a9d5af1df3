"""A per-token quantized KV cache with a full-precision recent window: what FP8, TurboQuant and
PolarQuant share.

Each of these methods turns every key and value into a code of its own, token by token, with no
state shared between tokens of one sequence besides per-head constants (FP8's per-head scales,
TurboQuant's outlier channels). This module holds what they have in common:

* the store: per layer, the codes of the oldest tokens (a dict of tensors ``[Hkv, n, ...]``, token
  dim 1) and the most recent ``residual`` tokens in the cache dtype ``[Hkv, r, d]``. A streaming
  method quantizes the oldest window token as soon as the window passes ``residual`` tokens; a
  prefill-only one (``streaming = False``, PolarQuant as run in its paper) keeps generated tokens in
  the window. On a sliding-window layer only the tokens a query can still see are kept (the exact
  cache keeps its window too): older ones are dropped, the oldest codes first; there a prefill-only
  method codes its generated tokens too (as a streaming one does), since full-precision tokens
  replacing coded ones in a window that no longer grows would outgrow the budget;
* attention: the method's logits for the coded tokens (``code_logits``), the exact logits of the
  window, one softmax with the layer's semantics (``kvlab.core.semantics.grouped_softmax``: soft-cap,
  window, sinks), then the method's probability-weighted sum of the coded values (``code_values``)
  plus the window's;
* the planner: the subclass picks its code (bits) for the budget (``pick``), then the window is the
  longest the budget still pays for at every decode step up to the horizon (``residual`` given:
  that one). Bytes are counted from the tensors held; the planner predicts them from the subclass's
  ``token_bytes`` (one token, one layer and KV head, key and value) and ``fixed_bytes`` (per layer).

A budget of 1.0 keeps every token in the window: the exact cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.tensor_ops import group_queries, ungroup
from kvlab.core import cancel
from kvlab.core.budgets import exact_bytes
from kvlab.core.semantics import grouped_softmax
from kvlab.methods.base import Compressor
from kvlab.methods.bit_split import Pair, choose
from kvlab.methods.budget_search import fits_budget
from kvlab.methods.handover import PrefillState

Codes = dict[str, Tensor]  # name -> [Hkv, n, ...] (token dim 1); with a leading layer dim while encoding


class Shared:
    """Per-model tensors (rotations, sketches, codebooks) that a fork of the cache holds by reference."""

    def __init__(self, **tensors: Tensor):
        self.tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __deepcopy__(self, memo: dict) -> Shared:
        return self


@dataclass
class CodedLayer:
    """One layer: codes of the oldest ``n_coded`` tokens, then the full-precision window."""

    codes: Codes
    res_k: Tensor  # [Hkv, r, dk] cache dtype
    res_v: Tensor  # [Hkv, r, dv]
    n_seen: int
    extra: Codes = field(default_factory=dict)  # per-layer constants held per sequence ([Hkv, ...])

    @property
    def n_coded(self) -> int:
        return next(iter(self.codes.values())).shape[1] if self.codes else 0

    @property
    def n_held(self) -> int:
        return self.n_coded + self.res_k.shape[1]

    def __deepcopy__(self, memo: dict) -> CodedLayer:
        """A fork holds the same tensors: every update replaces them, none is written in place."""
        twin = CodedLayer(dict(self.codes), self.res_k, self.res_v, self.n_seen, dict(self.extra))
        memo[id(self)] = twin
        return twin

    def add_codes(self, new: Codes) -> None:
        self.codes = {k: torch.cat([self.codes[k], t], 1) for k, t in new.items()} if self.codes else dict(new)

    def drop_oldest(self, m: int) -> None:
        """Forget the m oldest tokens (they left a sliding window): codes first, then the window."""
        c = min(m, self.n_coded)
        if c:
            self.codes = {k: t[:, c:] for k, t in self.codes.items()}
        if m > c:
            self.res_k, self.res_v = self.res_k[:, m - c :], self.res_v[:, m - c :]


class TokenQuantizer(Compressor):
    """Base of the per-token quantizers. Subclasses set ``encode``, ``code_logits``, ``code_values``,
    ``dequantize``, ``token_bytes``, ``fixed_bytes`` and ``pick``; ``prepare`` sees the prefill first."""

    streaming = True

    # ----- what a subclass provides ---------------------------------------------------------------
    def pick(self, n_prompt: int) -> dict:
        """Choose the code for the budget (updating the instance; called at budget 1.0 too); return its knobs."""
        return {}

    def token_bytes(self) -> float:
        """Bytes of one coded token (key + value) in one layer and KV head, as held."""
        raise NotImplementedError

    def fixed_bytes(self) -> float:
        """Bytes held per layer whatever the number of tokens (per-head constants), summed over KV heads."""
        return 0.0

    def full_layers(self) -> frozenset[int]:
        """Layers that keep every token in the cache dtype, never coded (vLLM's boundary layers); none here."""
        return frozenset()

    def prepare(self, keys: Tensor, values: Tensor) -> list[Codes]:
        """Before encoding the prefill keys/values [L, Hkv, n, d]: per-layer constants held per sequence."""
        return [{} for _ in range(keys.shape[0])]

    def encode(self, layers: slice, k: Tensor, v: Tensor, extra: list[Codes]) -> Codes:
        """Codes of k [L', Hkv, c, dk], v [L', Hkv, c, dv] for the layers ``layers`` -> tensors [L', Hkv, c, ...]."""
        raise NotImplementedError

    def code_logits(self, layer: int, qg: Tensor, st: CodedLayer) -> Tensor:
        """Scaled grouped queries qg [Hkv, R, dk] -> logits [Hkv, R, n_coded] of the coded keys (no soft-cap)."""
        raise NotImplementedError

    def code_values(self, layer: int, p: Tensor, st: CodedLayer) -> Tensor:
        """Probabilities p [Hkv, R, n_coded] -> their weighted sum of the coded values [Hkv, R, dv]."""
        raise NotImplementedError

    # ----- planning -------------------------------------------------------------------------------
    def plan(self, n_prompt: int) -> dict:
        self.full = self.is_full
        knobs = self.pick(n_prompt)  # at budget 1.0 too (nothing is coded then)
        if self.full:
            self.residual = n_prompt
        else:
            given = self.cfg.get("residual")
            self.residual = int(given) if given is not None else self._longest_window(n_prompt)
        predicted = self._held(n_prompt, 0)
        return {
            **knobs,
            "residual": self.residual,
            "planned_fraction": round(predicted / max(1, exact_bytes(self.info, n_prompt)), 4),
            "fits_budget": self.full or fits_budget(self, n_prompt),
        }

    def _held(self, n: int, steps: int, residual: int | None = None) -> float:
        """Bytes held after ``steps`` decode steps with a window of ``residual`` tokens (predicted)."""
        r = self.residual if residual is None else residual
        info = self.info
        full = (info.head_dim + info.v_head_dim) * info.dtype_bytes
        total = 0.0
        uncoded = self.full_layers()
        for i, sem in enumerate(self.sem.layers):
            held = sem.sees(n + steps)  # a local layer keeps only what its newest query sees (``_trim``)
            if i in uncoded:
                total += info.n_kv_heads * held * full
                continue
            window = min(held, r) if self.streaming or self.full or sem.is_local else min(held, min(r, n) + steps)
            coded = held - window
            total += info.n_kv_heads * (coded * self.token_bytes() + window * full) + self.fixed_bytes()
        return total

    def _worst_ratio(self, n: int, residual: int | None = None) -> float:
        horizon = self.horizon(n)
        steps = {0, horizon, *(s for s in range(0, horizon + 1, max(1, horizon // 16)))}
        r = self.residual if residual is None else residual
        steps |= {x - n for x in [r, *(s.window for s in self.sem.layers if s.window)] if 0 <= x - n <= horizon}
        for c in {s.chunk for s in self.sem.layers if s.chunk}:  # a chunked layer holds its most at a block's end
            steps |= set(range(-(-n // c) * c - n, horizon + 1, c))
        return max(self._held(n, j, r) / max(1.0, self.allowed(n, j)) for j in sorted(steps))

    def budget_ratio(self, n_prompt: int) -> float | None:
        if self.full:
            return None
        return self._worst_ratio(n_prompt)

    def choose_pair(
        self, pairs: list[Pair], set_pair: Callable[[float, float], None], n: int, residual: int = 0
    ) -> None:
        """Set the (key bits, value bits) pair to plan with (``set_pair``): the only one, or the full cache's first,
        else ``bit_split.choose``'s among ``pairs`` (the most bytes within the budget with a window of
        ``residual`` tokens, at every decode step up to the horizon)."""
        if self.is_full or len(pairs) == 1:
            set_pair(*pairs[0])
            return

        def fits(p: Pair) -> bool:
            set_pair(*p)
            return self._worst_ratio(n, residual) <= 1.0

        def size(p: Pair) -> float:
            set_pair(*p)
            return self.token_bytes()

        set_pair(*choose(pairs, fits, size)[0])

    def _longest_window(self, n: int) -> int:
        """The largest window (up to the prompt) whose bytes stay within the budget at every step."""
        if self._worst_ratio(n, 0) > 1.0:
            return 0
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._worst_ratio(n, mid) <= 1.0 else (lo, mid - 1)
        return lo

    # ----- the cache ------------------------------------------------------------------------------
    def compress(self, state: PrefillState) -> None:
        keys, values = state.keys, state.values
        n_layers, _, n, _ = keys.shape
        uncoded = self.full_layers()
        extra = [{} for _ in range(n_layers)] if self.full else self.prepare(keys, values)
        self.layers = []
        for i in range(n_layers):
            cancel.checkpoint()
            codes = {}
            n_coded = 0 if self.full or i in uncoded else max(0, n - self.residual)
            if n_coded:  # one layer at a time: the float intermediates stay the size of one layer's cache
                enc = self.encode(
                    slice(i, i + 1), keys[i : i + 1, :, :n_coded], values[i : i + 1, :, :n_coded], extra[i : i + 1]
                )
                codes = {k: t[0] for k, t in enc.items()}
            st = CodedLayer(
                codes, self.as_cached(keys[i, :, n_coded:]), self.as_cached(values[i, :, n_coded:]), n, extra[i]
            )
            self._trim(i, st)
            self.layers.append(st)
        self.extra = extra

    def _trim(self, layer: int, st: CodedLayer) -> None:
        """Drop the held tokens the newest one's query does not see (a local layer's window or chunk)."""
        sees = st.n_seen - self.sem[layer].visible_from(st.n_seen - 1)
        if st.n_held > sees:
            st.drop_oldest(st.n_held - sees)

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        st = self.layers[layer]
        st.res_k = torch.cat([st.res_k, k.to(st.res_k.dtype)], 1)
        st.res_v = torch.cat([st.res_v, v.to(st.res_v.dtype)], 1)
        st.n_seen += k.shape[1]
        over = st.res_k.shape[1] - self.residual
        coding = not self.full and layer not in self.full_layers()
        if (self.streaming or self.sem[layer].is_local) and coding and over > 0:
            sl = slice(layer, layer + 1)
            enc = self.encode(sl, st.res_k[None, :, :over], st.res_v[None, :, :over], [st.extra])
            st.add_codes({name: t[0] for name, t in enc.items()})
            st.res_k, st.res_v = st.res_k[:, over:], st.res_v[:, over:]
        self._trim(layer, st)

    def _logits(self, layer: int, q: Tensor) -> Tensor:
        """[Hkv, g*t, n_held]: the coded keys' logits, then the window's exact ones (scaled, no cap)."""
        st = self.layers[layer]
        qg = group_queries(q.float() * self.sem[layer].scaling, st.res_k.shape[0])
        window = torch.matmul(qg, st.res_k.float().transpose(-1, -2))
        if not st.n_coded:
            return window
        return torch.cat([self.code_logits(layer, qg, st), window], -1)

    def attend(self, layer: int, q: Tensor) -> Tensor:
        st = self.layers[layer]
        p = grouped_softmax(self._logits(layer, q), self.sem[layer], q.shape[0], st.n_seen, q.shape[-2])
        nc = st.n_coded
        out = torch.matmul(p[..., nc:], st.res_v.float())
        if nc:
            out = out + self.code_values(layer, p[..., :nc], st)
        return ungroup(out, q.shape[0]).to(q.dtype)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for st in self.layers:
            for name, t in st.codes.items():
                yield name, t
            for name, t in st.extra.items():
                yield name, t
            yield "residual_keys", st.res_k
            yield "residual_values", st.res_v

    def kept_positions(self, layer: int) -> Tensor | None:
        st = self.layers[layer]
        r = st.res_k.shape[1]
        pos = torch.arange(st.n_seen - r, st.n_seen, dtype=torch.int32, device=st.res_k.device)
        return pos.expand(st.res_k.shape[0], r)

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """The softmax ``attend`` takes, over positions 0..n_seen-1 (0 where a sliding window dropped a token)."""
        st = self.layers[layer]
        p = ungroup(grouped_softmax(self._logits(layer, q), self.sem[layer], q.shape[0], st.n_seen), q.shape[0])[:, 0]
        return torch.nn.functional.pad(p, (st.n_seen - st.n_held, 0))


__all__ = ["Codes", "CodedLayer", "Shared", "TokenQuantizer"]
