"""DuoAttention with patterns computed on the fly: retrieval heads keep everything, streaming heads their
first and last tokens.

Xiao, Tang, Zuo, Guo, Yang, Tang, Fu, Han. "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads", ICLR 2025, https://arxiv.org/abs/2410.10819 — a few KV heads ("retrieval
heads") need the whole context; the others ("streaming heads") attend to the initial tokens and a recent
window only, and keep just those. The paper learns a gate per head by optimisation on synthetic passkey
data; kvpress's ``DuoAttentionPress`` either loads those patterns for six checkpoints or, with
``on_the_fly_scoring``, computes a score per head from the model alone (its benchmarked
``duo_attention_on_the_fly``), which kvlab does for the loaded model:

1. the mean query and the mean key of a text, before RoPE, per head;
2. both repeated over ``pattern_len`` positions and rotated by the layer's RoPE: the last query's attention
   over the ``pattern_len`` keys (the layer's scaling);
3. the head's score is the area under that attention's cumulative sum (its mean over positions), averaged
   over the query heads of a KV group: a head whose mean query looks back far scores high.

The lowest-scored KV heads stream (kvpress: ``head_compression_ratio`` of them; sinks 128, recent 256).
Here the budget decides how many (``sink_recent.SinkRecentSplit``): heads stream lowest score first until
the cache fits.

Deviations:

* The means are the prompt's own (its queries captured by the prefill, un-rotated with the model's
  rotary embedding; its keys un-rotated likewise): kvpress averages them over 50 BookSum samples, which
  this machine does not have, so the pattern follows the prompt.
* The number of streaming heads comes from the byte budget (kvpress's benchmark sets the fraction of
  streaming heads to the compression ratio, which holds more than the budget by the streaming heads'
  sinks and windows). On a prompt too short for 128 + 256 the window shrinks (sinks and recent in
  proportion) to at most ``window_share`` of a head's even share; what the last streaming head leaves of
  the budget widens the streaming heads' recent windows.
* The layer's own attention scaling (kvpress: 1/sqrt(d)); a layer without RoPE gets the same mean
  vectors at every position. A model without a rotary embedding kvlab can read is refused.
* Prefill only, as kvpress's press: generated tokens are all kept (the paper's streaming heads also
  slide while decoding).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.attention_ops import pool_heads
from kvlab.core.rope import Rotary
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.sink_recent import SHARE, SinkRecentSplit


def head_scores(mean_q: Tensor, mean_k: Tensor, rope: Rotary, length: int, scaling: Tensor) -> Tensor:
    """kvpress's on-the-fly DuoAttention score per KV head: [L, Hkv].

    mean_q [L, Hq, d], mean_k [L, Hkv, d] (before RoPE); the mean key rotated at positions 0..length-1 and the
    mean query at length-1; the query's attention (scaling [L]) over those keys, its cumulative sum averaged
    over positions, then over each KV group's query heads.
    """
    n_layers, hq, d = mean_q.shape
    hkv = mean_k.shape[1]
    pos = torch.arange(length, device=mean_q.device)
    k = rope.rotate(mean_k.float()[:, :, None, :].expand(-1, -1, length, -1).contiguous(), pos)  # [L, Hkv, P, d]
    q = rope.rotate(mean_q.float()[:, :, None, :].contiguous(), pos[-1:])  # [L, Hq, 1, d]
    k = k.repeat_interleave(hq // hkv, dim=1)
    probs = torch.softmax((q @ k.transpose(-1, -2))[:, :, 0] * scaling[:, None, None], dim=-1)  # [L, Hq, P]
    area = probs.cumsum(-1).mean(-1)  # [L, Hq]
    return pool_heads(area, hkv, head_dim=1, reduce="mean")


class DuoAttention(SinkRecentSplit):
    name = "duoattention"
    title = "DuoAttention"
    group = "recent"
    paper = (
        "Xiao et al., DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads, "
        "ICLR 2025 (arXiv:2410.10819)"
    )
    summary = (
        "Retrieval heads keep everything, streaming heads their first and last tokens; heads scored on the fly "
        "from the model (mean query and key under RoPE), the budget sets how many stream."
    )
    params = (
        Param("n_sink", 128, "initial tokens a streaming head keeps (kvpress's on-the-fly setting)", minimum=0),
        Param("n_recent", 256, "recent tokens a streaming head keeps (kvpress's; shrunk to fit the budget)", minimum=1),
        Param(
            "pattern_len", 500, "positions of the synthetic sequence a head is scored on (kvpress's q_len)", minimum=2
        ),
        SHARE,
    )

    @property
    def per_layer(self) -> int:  # type: ignore[override]
        return self.info.n_kv_heads

    def check_semantics(self) -> None:
        super().check_semantics()
        if self.info.rope is None:
            raise sm.UnsupportedAttention(
                f"{self.name} cannot run on a model without a rotary position embedding kvlab can read: "
                "it scores heads by their mean query and key under RoPE"
            )

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return replace(super().prefill_needs(n_prompt), query_stats=n_prompt)

    def stream_order(self, state: PrefillState) -> tuple[Tensor, int]:
        """KV heads (layer-major) by their score, lowest first."""
        rope = self.info.rope
        assert rope is not None  # check_semantics refused a model without one
        n = state.n_tokens
        try:
            mean_q = state.stats_over(n).mean
        except LookupError as exc:
            raise RuntimeError(f"{self.name}: {exc}") from None
        pos = torch.arange(n, device=state.keys.device)
        mean_k = rope.unrotate(state.keys.float(), pos).mean(-2)  # [L, Hkv, d]
        scaling = torch.tensor([s.scaling for s in self.sem.layers], device=mean_q.device)
        self.head_scores = head_scores(mean_q, mean_k, rope, int(self.cfg["pattern_len"]), scaling)
        return torch.sort(self.head_scores.flatten(), stable=True).indices, 0
