"""Some units of the cache keep everything, the others only their first and last tokens: the budget split that
SimLayerKV (units: layers, the "lazy" ones stream) and DuoAttention (units: KV heads, the "streaming"
heads) share.

A unit is a layer or a KV head of a layer. A streaming unit keeps its first ``n_sink`` prompt tokens and its
last ``n_recent``; a full unit keeps every prompt token its layer sees (a sliding-window layer: its window;
a chunked layer: what its queries see up to the plan's horizon, ``Compressor.reach``).
The methods differ only in which units stream first (``stream_order``: a layer's laziness, a head's
pattern score); under a byte budget this split decides how many:

* plan: the prompt's share of the budget is T tokens over all layers and KV heads (each kept token costs its
  key, value and int32 position; each head's int32 count comes off first). The streaming window is the
  method's ``n_sink + n_recent`` (its paper's), shrunk, sinks and recent in proportion (at least 4 sinks,
  StreamingLLM's, if the method has them), to at most ``window_share`` of a unit's even share of T, so that
  streaming units leave room for full ones (on a prompt much longer than the window, the method's own
  sizes stand);
* compression: units stream in ``stream_order`` until the tokens held fit T; what the last one left over
  widens the streaming units' recent windows, evenly (at most what each sees), so that the cache uses its
  budget.

Prefill-only: generated tokens are all kept (as kvpress's presses do; the papers' streaming units also
slide while decoding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.ragged import RaggedCompressor

MIN_SINKS = 4  # a shrunk window keeps at least this many sinks (StreamingLLM's), when the method has them
SHARE = Param(
    "window_share",
    0.5,
    "a streaming unit's sinks + recent at most this share of a unit's even share of the budget "
    "(room for full units on short prompts)",
    minimum=0.01,
    maximum=1.0,
)


def split_counts(
    held: Tensor, order: Tensor, total: int, window: int, at_least: int = 0, widen: bool = True
) -> tuple[Tensor, Tensor]:
    """Tokens per unit when units stream in ``order`` until the total fits: (counts [U], streaming [U] bool).

    held [U]: what each unit keeps in full; a streaming unit keeps min(held, window). Units stream in
    ``order`` (a permutation of 0..U-1) until sum(counts) <= total (all stream when even that is over), the
    first ``at_least`` of them whatever the total; with ``widen``, the total left over is then spread evenly
    over the streaming units, each up to its ``held``.
    """
    h = held.long()
    hs = h[order]
    stream = hs.clamp(max=window)
    need = int(h.sum()) - total
    savings = (hs - stream).cumsum(0)
    m = int((savings < need).sum()) + 1 if need > 0 else 0
    m = min(max(m, at_least), len(hs))
    streaming_sorted = torch.arange(len(hs), device=h.device) < m
    counts_sorted = torch.where(streaming_sorted, stream, hs)
    slack = total - int(counts_sorted.sum()) if widen else 0
    while slack > 0:  # water-fill the streaming units' windows
        room = streaming_sorted & (counts_sorted < hs)
        k = int(room.sum())
        if not k:
            break
        each, extra = divmod(slack, k)
        add = torch.zeros_like(counts_sorted)
        add[room] = each + (torch.arange(k, device=h.device) < extra).long()
        add = add.minimum(hs - counts_sorted)
        counts_sorted = counts_sorted + add
        slack -= int(add.sum())
        if not int(add.sum()):
            break
    counts = torch.empty_like(counts_sorted).scatter_(0, order, counts_sorted)
    streaming = torch.empty_like(streaming_sorted).scatter_(0, order, streaming_sorted)
    return counts, streaming


def sinks_and_recent(counts: Tensor, n: int, sink: int) -> Tensor:
    """[.., n] bool: each unit's first min(sink, count) tokens and its last count - that many."""
    s = counts.clamp(max=sink)
    pos = torch.arange(n, device=counts.device)
    return (pos < s[..., None]) | (pos >= (n - (counts - s))[..., None])


class SinkRecentSplit(RaggedCompressor):
    """Units (layers, or KV heads: ``per_layer`` units a layer) that keep everything or stream (sinks +
    recent), split under the byte budget (the module docstring). A subclass gives ``stream_order(state)``."""

    per_layer = 1  # units per layer: 1 (a layer's heads alike) or the KV heads
    full: bool
    total: int  # set by plan: tokens all units keep together (per unit, per head)
    sink: int  # set by plan: a streaming unit's first tokens
    recent: int  # set by plan: a streaming unit's last tokens (before the slack widens it)
    stream_units: Tensor | None = None  # set by compress: [L x per_layer] bool, the units that stream

    def stream_order(self, state: PrefillState) -> tuple[Tensor, int]:
        """([L x per_layer] the units in the order they stream (first: the first to keep sinks + recent only),
        how many of the first stream whatever the budget (0: the budget alone decides, and what the last
        streaming unit leaves widens the windows; more: a method's own rule, the budget a cap))."""
        raise NotImplementedError

    def unit_tokens(self, n_prompt: int) -> Tensor:
        """[L x per_layer]: the prompt tokens each unit keeps in full (per KV head; a local layer: what its queries
        see over the horizon, ``reach``: its window, a chunked layer's block)."""
        held = torch.tensor([self.reach(i, n_prompt) for i in range(self.info.n_layers)])
        return held.repeat_interleave(self.per_layer)

    def units(self) -> int:
        return self.info.n_layers * self.per_layer

    def heads_per_unit(self) -> int:
        return self.info.n_kv_heads // self.per_layer

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        held = self.unit_tokens(n_prompt)
        base_sink, base_recent = int(self.cfg["n_sink"]), int(self.cfg["n_recent"])
        if self.full or self.budget is None:
            self.total, self.sink, self.recent = int(held.sum()), base_sink, base_recent
            return {"n_sink": base_sink, "n_recent": base_recent}
        per_head = self.per_token_bytes()
        heads = self.heads_per_unit()
        target: float = self.budget.target_bytes(self.info, n_prompt)
        fixed = self.info.n_layers * self.info.n_kv_heads * self.fixed_stream_bytes()
        if self.budget.tokens is not None:  # that many tokens per layer and head (as the dense methods)
            target = self.budget.tokens * self.info.n_layers * self.info.n_kv_heads * per_head + fixed
        self.total = max(0, int((target - fixed) // (per_head * heads)))
        share = self.total / self.units()
        window = min(base_sink + base_recent, max(1, int(float(self.cfg["window_share"]) * share)))
        while window > 1 and int(held.clamp(max=window).sum()) > self.total:
            window -= 1
        proportional = round(window * base_sink / max(1, base_sink + base_recent))
        self.sink = min(base_sink, window, max(proportional, MIN_SINKS))
        self.recent = window - self.sink
        return {"n_sink": self.sink, "n_recent": self.recent, "tokens": self.total * heads}

    def planned_bytes(self, n_prompt: int) -> float:
        """After ``plan``: at most ``total`` tokens (at least one per unit), + each head's count."""
        held = self.unit_tokens(n_prompt)
        least = int(held.clamp(max=max(1, self.sink + self.recent)).sum())
        tokens = min(int(held.sum()), max(self.total, least)) * self.heads_per_unit()
        fixed = self.info.n_layers * self.info.n_kv_heads * self.fixed_stream_bytes()
        return tokens * self.per_token_bytes() + fixed

    def planned_tokens(self, n_prompt: int) -> int:
        return -(-int(self.planned_bytes(n_prompt) // self.per_token_bytes()) // self.units() // self.heads_per_unit())

    def keep_mask(self, state: PrefillState) -> Tensor | None:
        n = state.n_tokens
        held = self.unit_tokens(n).to(state.keys.device)
        if self.full:
            return None
        order, at_least = self.stream_order(state)
        if not at_least and self.total >= int(held.sum()):
            return None
        window = self.sink + self.recent
        counts, self.stream_units = split_counts(
            held, order.to(held.device), self.total, window, at_least, not at_least
        )
        per_head = counts.view(self.info.n_layers, self.per_layer).repeat_interleave(self.heads_per_unit(), dim=1)
        return sinks_and_recent(per_head, n, self.sink)


__all__ = ["SHARE", "SinkRecentSplit", "sinks_and_recent", "split_counts"]
