"""StreamingLLM: attention sinks plus a recent window.

Xiao, Tian, Chen, Han, Lewis. "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 — keep the first ``n_sink`` tokens (the sinks) and the most recent
``window`` tokens; evict the oldest non-sink token as each new token arrives. Keys are stored
post-RoPE at their original positions (kvlab never re-assigns positions, see docs/design.md §3).
"""

from __future__ import annotations

import torch

from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param


class StreamingLLM(DenseCompressor):
    name = "streaming"
    plain_feed = False  # its own append (and attend)
    title = "StreamingLLM"
    group = "baseline"
    paper = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 (arXiv:2309.17453)"
    summary = "Keeps the first few tokens (attention sinks) and a recent window; evicts the oldest as it decodes."
    streaming = True
    positions_implicit = True  # the sinks, then a contiguous window: two counts say it all
    params = (
        Param("n_sink", 4, "attention-sink tokens kept from the start", minimum=0),
        Param("window", None, "recent tokens kept (set from the budget when not given)", minimum=0, kind=int),
    )

    capacity: int  # set by plan: tokens per layer and KV head kept
    full: bool  # set by plan: no budget, nothing compressed

    def plan_tokens(self, n_prompt: int) -> dict:
        cap = self.tokens_for_budget(n_prompt)
        sink = min(self.cfg["n_sink"], cap)
        if self.cfg["window"] is None:
            self.cfg["window"] = cap - sink
        self.capacity = sink + int(self.cfg["window"])
        self.full = self.is_full
        return {"n_sink": sink, "window": int(self.cfg["window"])}

    def select(self, state: PrefillState):
        n, (n_layers, hkv) = state.n_tokens, state.keys.shape[:2]
        if self.full or self.capacity >= n:
            return [None] * n_layers
        sink = min(self.cfg["n_sink"], self.capacity)
        keep = torch.cat([torch.arange(sink), torch.arange(n - (self.capacity - sink), n)])
        return keep.to(state.keys.device).expand(n_layers, hkv, -1)

    def append(self, layer: int, k, v, pos: int) -> None:
        cache = self.layers[layer]
        cache.append(k, v, pos)
        if not self.full and cache.n > self.capacity:
            sink = min(self.cfg["n_sink"], self.capacity)
            keep = torch.cat([torch.arange(sink), torch.arange(sink + cache.n - self.capacity, cache.n)])
            cache.keep(keep.to(k.device).expand(k.shape[0], -1))
