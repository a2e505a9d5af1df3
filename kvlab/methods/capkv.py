"""CapKV: keep the prompt tokens that add most to the retained cache's information capacity.

"Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective" (CapKV), 2026,
https://arxiv.org/abs/2604.25975 — Under a linear-Gaussian surrogate of attention, the information a
retained set keeps is log det(I + sum_i w_i u_i u_i^T), u_i the direction token i writes to the
output and w_i the weight future queries give it. A token's contribution is approximated by its
weighted leverage in that capacity matrix. As the paper's press in kvpress 0.5.5
(``CapPress``), per layer and query head, on the tokens after the first ``n_sink``:

1. a historical-query anchor mu: the mean of the prompt's queries after the sinks, before RoPE,
   rotated by RoPE averaged over the next ``n_future`` positions (as Expected Attention's future
   query);
2. w_i = exp(tau (cos(mu, k_i) - max_j cos(mu, k_j))) (cosine of the anchor and the post-RoPE key);
3. u_i = v_i (values as output directions); A = I + sum_i (w_i + epsilon) u_i u_i^T;
4. score_i = w_i u_i^T A^{-1} u_i, averaged over the KV group's query heads. The sinks score above
   every token (always kept); the highest are kept.

Defaults are kvpress's press's: tau = 5, and n_future = 512, n_sink = 4, epsilon = 1e-6, which it
takes from Expected Attention's press. kvpress notes the press's own departures
from the paper's text, kept here: the keys and the anchor are L2-normalised before their product
(a cosine, not the raw q.k), scores are shifted by their maximum before the exponential, the anchor
is rotated by the averaged future RoPE, and u_i is the raw value (not W_o v_i).

Deviations from kvpress: the anchor is the mean of the pre-RoPE queries rotated once (kvpress
rotates each query, then averages: the same in exact arithmetic); the pre-RoPE queries are the
prefill's post-RoPE ones turned back with the model's RoPE (``PrefillNeeds.query_stats``), and
the averaged rotation is the model's own (each layer's, on models whose layers differ). A model
without a rotary embedding kvlab can read is refused. Prefill-only: generated tokens are all kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.methods.expected_attention import future_queries, require_rope
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored

CHUNK = 1 << 24  # numbers of the largest intermediate ([layers, Hq, n, dv]) scored at once: 64 MiB of float32


def capacity_scores(anchor: Tensor, keys: Tensor, values: Tensor, tau: float, epsilon: float) -> Tensor:
    """CapKV's scores [.., Hkv, n] (module docstring, steps 2-4).

    anchor [.., Hq, d] (post-RoPE frame); keys [.., Hkv, n, d], values [.., Hkv, n, dv]; query head h reads
    KV head h // (Hq / Hkv); the scores of a KV group's query heads are averaged.
    """
    hq, hkv = anchor.shape[-2], keys.shape[-3]
    g = hq // hkv
    mu = F.normalize(anchor.float(), dim=-1).reshape(*anchor.shape[:-2], hkv, g, 1, anchor.shape[-1])
    unit = F.normalize(keys.float(), dim=-1).unsqueeze(-3)  # [.., Hkv, 1, n, d]
    cos = (mu @ unit.transpose(-1, -2)).squeeze(-2).clamp(-1.0, 1.0)  # [.., Hkv, G, n]
    logits = tau * cos
    w = torch.exp(logits - logits.amax(-1, keepdim=True))
    u = values.float().unsqueeze(-3)  # [.., Hkv, 1, n, dv]
    scaled = u * (w + epsilon).sqrt().unsqueeze(-1)  # [.., Hkv, G, n, dv]
    eye = torch.eye(u.shape[-1], device=u.device)
    capacity = eye + scaled.transpose(-1, -2) @ scaled  # [.., Hkv, G, dv, dv]
    ut = u.transpose(-1, -2).expand(*capacity.shape[:-1], u.shape[-2])  # [.., Hkv, G, dv, n]
    leverage = (ut * torch.linalg.solve(capacity, ut)).sum(-2)  # [.., Hkv, G, n]
    return (w * leverage).mean(-2)


class CapKV(PromptScored):
    name = "capkv"
    title = "CapKV"
    group = "recent"
    paper = (
        "Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective (CapKV), 2026 (arXiv:2604.25975)"
    )
    summary = (
        "Keeps the prompt tokens of largest weighted leverage in the log-det capacity of the values, weighted by "
        "their keys' alignment with the mean (future-rotated) query, plus the first 4."
    )
    params = (
        Param("tau", 5.0, "temperature of the query-key alignment weights", minimum=0.0),
        Param("n_future", 512, "future positions the anchor's RoPE rotation is averaged over", minimum=1),
        Param("n_sink", 4, "first prompt tokens left out of the anchor and always kept", minimum=0),
        Param("epsilon", 1e-6, "added to the weights inside the capacity matrix", minimum=0.0),
    )

    def check_semantics(self) -> None:
        super().check_semantics()
        require_rope(self.name, self.info.rope, "its query anchor is rotated by the RoPE of the next positions")

    def anchor_queries(self, n_prompt: int) -> int:
        """How many of the last prompt queries make the anchor: all after the sinks (at least 1)."""
        return max(1, n_prompt - int(self.cfg["n_sink"]))

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        if self.full or self.capacity >= n_prompt:
            return PrefillNeeds()
        return PrefillNeeds(query_stats=self.anchor_queries(n_prompt))

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: CapKV's score of every token after the sinks; the sinks score above all of them."""
        c, n = self.cfg, state.n_tokens
        sink = min(int(c["n_sink"]), n)
        if sink >= n:  # every token a sink: the first ones first
            return -torch.arange(n, dtype=torch.float32, device=state.keys.device).expand(*state.keys.shape[:2], n)
        key = (float(c["tau"]), int(c["n_future"]), sink, float(c["epsilon"]))
        body = self.shared(state, key, lambda: self.capacity_terms(state, sink))  # [L, Hkv, n - sink]
        top = body.reshape(body.shape[0], -1).amax(-1)[:, None, None] + 1
        return torch.cat([top.expand(-1, body.shape[1], sink), body], -1)

    def capacity_terms(self, state: PrefillState, sink: int) -> Tensor:
        """[L, Hkv, n - sink]: CapKV's score of every token after the ``sink`` first, layers in chunks."""
        c, n = self.cfg, state.n_tokens
        anchor, _ = future_queries(self.name, state, self.info, self.anchor_queries(n), int(c["n_future"]), False)
        keys, values = state.keys[:, :, sink:], state.values[:, :, sink:]
        step = max(1, CHUNK // (anchor.shape[1] * keys.shape[-2] * values.shape[-1]))
        tau, eps = float(c["tau"]), float(c["epsilon"])
        return torch.cat(
            [
                capacity_scores(anchor[lo : lo + step], keys[lo : lo + step], values[lo : lo + step], tau, eps)
                for lo in range(0, keys.shape[0], step)
            ]
        )
