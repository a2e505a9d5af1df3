"""Compactor: approximate leverage of the keys blended with chunked non-causal attention.

Chari, Van Durme. "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", 2025, https://arxiv.org/abs/2507.08143 — as kvpress 0.5.5 implements it
(``CompactorPress``, which blends ``LeverageScorePress`` and ``NonCausalAttnPress``). Per layer, on
the prompt's tokens between the first ``sink_start`` and the last ``sink_end`` (both always kept):

1. leverage: the approximate statistical leverage of the pre-RoPE keys (``leverage.py``: centred over
   these tokens, Gaussian sketch of k = 48 columns), z-normalised over the layer (all KV heads and
   tokens together);
2. attention: the prompt's queries attend to its keys non-causally inside chunks of ``chunk_size``
   tokens (logits q.k, unscaled, softmax over the chunk's keys); each key's attention summed over
   the chunk's queries and averaged over its KV group's query heads, times its value's norm,
   smoothed by an average over 3 neighbours, z-normalised over the layer;
3. score = blending x leverage + attention, blending = the fraction of the prompt the budget removes
   (kvpress's default: its ``compression_ratio``) unless given. The sinks take the layer's largest
   score, and each KV head keeps the tokens of highest score.

Defaults are kvpress's (sinks 8 + 4, chunks of 256, k = 48, blending from the budget); kvpress
notes that both the blending default and the Cholesky solve differ from the paper.

As kvpress does, the last chunk is padded to ``chunk_size`` with zero queries and keys that take
part in its softmax: a padding key adds exp(0) to every real query's normaliser, and each padding
query spreads a uniform row (1/``chunk_size`` per key) over the chunk, so every real key of a last
chunk of r tokens gains (``chunk_size`` - r)/``chunk_size`` of attention. kvlab keeps this to
select what kvpress selects (``reference_padding``, on by default); off, the last chunk attends
over its r tokens alone.

Deviations from kvpress: the pre-RoPE keys and the sketch as in ``leverage.py`` (the cached keys
turned back with the model's RoPE; the sketch drawn from the run's seed in kvpress's order), the
queries are the prefill's own post-RoPE queries (kvpress projects the hidden states again and
rotates them: the same numbers), and the blending default is computed from the capacity kvlab
keeps (1 - capacity / n), which is kvpress's ratio when its kept count is the same. The method
needs every prompt query from the prefill ([L, Hq, n, d], float32). Prefill-only: generated tokens
are all kept. A model without a rotary embedding kvlab can read is refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.core.attention_ops import pool_heads
from kvlab.methods.expected_attention import require_rope
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.leverage import gaussian_sketch, leverage_scores, pre_rope_keys
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored


def layer_z(x: Tensor) -> Tensor:
    """x [L, H, m] z-normalised per layer over all its heads and tokens (unbiased std, at least 1e-6)."""
    flat = x.reshape(x.shape[0], -1)
    mean = flat.mean(-1)[:, None, None]
    std = flat.std(-1).nan_to_num(1.0).clamp_min(1e-6)[:, None, None]  # one number alone: no spread
    return (x - mean) / std


def chunked_attention_sums(q: Tensor, k: Tensor, chunk: int, reference_padding: bool = True) -> Tensor:
    """Non-causal attention inside chunks of ``chunk`` tokens, summed over each chunk's queries: [.., Hq, m].

    q [.., Hq, m, d], k [.., Hkv, m, d] (query head h reads KV head h // (Hq / Hkv)); logits q.k, unscaled.
    The tokens are padded with zeros to a whole number of chunks. ``reference_padding``: the padding takes
    part in the last chunk's softmax as in kvpress (module docstring); otherwise its keys get no weight and
    its queries none either.
    """
    hq, m, d = q.shape[-3:]
    k = k.repeat_interleave(hq // k.shape[-3], dim=-3)
    pad = (-m) % chunk
    lead = q.shape[:-2]
    qc = F.pad(q, (0, 0, 0, pad)).reshape(*lead, (m + pad) // chunk, chunk, d)
    kc = F.pad(k, (0, 0, 0, pad)).reshape(*lead, (m + pad) // chunk, chunk, d)
    dots = qc @ kc.transpose(-1, -2)  # [.., Hq, chunks, chunk, chunk]
    padding = torch.arange(chunk, device=q.device) >= chunk - pad  # the last chunk's padding slots
    last = dots[..., -1, :, :]
    if pad and reference_padding:
        last.masked_fill_(padding[:, None], 0).masked_fill_(padding[None, :], -1e-9)
    elif pad:
        last.masked_fill_(padding[None, :], -math.inf)
    probs = torch.softmax(dots.float(), dim=-1)
    if pad and not reference_padding:
        probs[..., -1, :, :].masked_fill_(padding[:, None], 0)
    return probs.sum(-2).reshape(*lead, m + pad)[..., :m]


class Compactor(PromptScored):
    name = "compactor"
    title = "Compactor"
    group = "recent"
    paper = (
        "Chari, Van Durme, Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate "
        "Leverage Scores, 2025 (arXiv:2507.08143)"
    )
    summary = (
        "Keeps the prompt tokens of highest blend of key leverage (pre-RoPE, sketched) and chunked non-causal "
        "attention times value norm, plus the first 8 and last 4."
    )
    params = (
        Param("sink_start", 8, "first prompt tokens always kept (kvpress's sink_size_start)", minimum=0),
        Param("sink_end", 4, "last prompt tokens always kept (kvpress's sink_size_end)", minimum=0),
        Param("chunk_size", 256, "tokens per chunk of the non-causal attention", minimum=1),
        Param("sketch_dimension", 48, "columns k of the leverage's Gaussian sketch", minimum=1),
        Param(
            "blending",
            None,
            "weight of the leverage term (none: the fraction of the prompt the budget removes, as kvpress)",
            minimum=0.0,
            kind=float,
        ),
        Param(
            "reference_padding",
            True,
            "pad the last chunk with zero queries and keys as kvpress does (off: the last chunk alone)",
        ),
    )

    def check_semantics(self) -> None:
        super().check_semantics()
        require_rope(self.name, self.info.rope, "its leverage term scores the keys before RoPE")

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        """Every prompt query (the non-causal attention), unless every token is kept."""
        return PrefillNeeds(query_window=0 if self.full or self.capacity >= n_prompt else n_prompt)

    def plan_tokens(self, n_prompt: int) -> dict:
        knobs = super().plan_tokens(n_prompt)
        given = self.cfg["blending"]
        self.blending = float(given) if given is not None else 1 - min(self.capacity, n_prompt) / max(1, n_prompt)
        return {**knobs, "blending": round(self.blending, 6)}

    def sinks(self, n: int) -> tuple[int, int]:
        """(first, last) tokens always kept, as kvpress clamps them on an ``n``-token prompt."""
        left = min(int(self.cfg["sink_start"]), n)
        return left, min(int(self.cfg["sink_end"]), max(0, n - left))

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: the blended score between the sinks; the sinks get each layer's largest."""
        n = state.n_tokens
        left, right = self.sinks(n)
        if n - right <= left:  # every token a sink
            return state.keys.new_zeros(state.keys.shape[:-1], dtype=torch.float32)
        c = self.cfg
        key = (left, right, int(c["chunk_size"]), int(c["sketch_dimension"]), bool(c["reference_padding"]), self.seed)
        lev, attn = self.shared(state, key, lambda: self.terms(state, left, n - right))
        blended = self.blending * lev + attn  # [L, Hkv, n - left - right]
        top = blended.reshape(blended.shape[0], -1).amax(-1)[:, None, None]
        return torch.cat([top.expand(-1, blended.shape[1], left), blended, top.expand(-1, blended.shape[1], right)], -1)

    def terms(self, state: PrefillState, start: int, end: int) -> tuple[Tensor, Tensor]:
        """The two z-normalised terms of the tokens start..end-1, each [L, Hkv, end - start]: the leverage of
        their pre-RoPE keys and their chunked non-causal attention times the value norm (pooled over 3)."""
        n, c = state.n_tokens, self.cfg
        rope = self.info.rope
        assert rope is not None  # check_semantics refused a model without one
        keys, values = state.keys[:, :, start:end], state.values[:, :, start:end]
        pre = pre_rope_keys(keys, rope, first=start)
        n_layers, n_kv, _, d = pre.shape
        sketch = gaussian_sketch(self.seed, n_layers, n_kv, d, int(c["sketch_dimension"]))
        lev = layer_z(leverage_scores(pre, sketch.to(pre.device)))
        if state.queries.shape[-2] < n:
            raise RuntimeError(f"{self.name}: the prefill captured {state.queries.shape[-2]} of {n} prompt queries")
        q = state.queries[..., state.queries.shape[-2] - n :, :][..., start:end, :]
        chunk, padding = int(c["chunk_size"]), bool(c["reference_padding"])
        # one layer at a time: a layer's chunked logits are [Hq, chunks, chunk, chunk] float32
        sums = torch.stack([chunked_attention_sums(q[i], keys[i], chunk, padding) for i in range(q.shape[0])])
        attn = pool_heads(sums, self.info.n_kv_heads, head_dim=-2, reduce="mean") * values.float().norm(dim=-1)
        return lev, layer_z(F.avg_pool1d(attn, kernel_size=3, stride=1, padding=1))


__all__ = ["Compactor", "chunked_attention_sums", "layer_z"]
