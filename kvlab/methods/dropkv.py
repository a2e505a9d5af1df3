"""DropKV: evict the prompt tokens whose removal would move the window's attention outputs least.

"DropKV: KV Cache Eviction via Decoupled Residual-Output Perturbation", OpenReview MqfNzH3TVH
(https://openreview.net/forum?id=MqfNzH3TVH), and its press proposed to kvpress (pull request
#285, open). Evicting pair j renormalises a query's softmax over the others, so query i's output
moves by exactly

    o_i^(-j) - o_i = p_ij / (1 - p_ij) (o_i - v_j)

(p_ij its attention on j, o_i = sum_k p_ik v_k its output). Choosing the set to evict jointly is
combinatorial (the pairs interact through the normaliser); DropKV scores each pair alone by the
squared perturbation it causes to the last ``window`` prompt queries:

    s_j = sum_i (p_ij / (1 - p_ij + epsilon))^2 ||v_j - o_i||^2,

averaged over the query heads of the KV group, smoothed by an average over ``kernel`` neighbours.
The window itself is always kept; of the tokens before it, the highest scores are kept.

Defaults are the press's: a window of 32, kernel 7, epsilon 1e-6 (the paper's fused Triton
kernels are not reproduced: the window's probabilities are materialised, [L, Hq, w, n]).

Deviations from the press: the probabilities are the prefill's own attention of the window (the
model's attention scaling, soft-cap and sliding windows; the press scales by 1/sqrt(head_dim) and
ignores soft-caps and windows; the same on the embedded model); scores in float32. When the
capacity is smaller than the window, kvlab keeps the window's last ``capacity`` tokens (the press
picks among its equal scores). Prefill-only: generated tokens are all kept.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored


def perturbation_scores(probs: Tensor, values: Tensor, epsilon: float) -> Tensor:
    """DropKV's s_j for every key: probs [.., Hq, w, n] (the window's attention), values [.., Hkv, n, dv]
    -> [.., Hkv, n] (the mean over each KV group's query heads).

    sum_i c_ij ||v_j - o_i||^2 with c_ij = (p_ij / (1 - p_ij + epsilon))^2, expanded as
    ||v_j||^2 sum_i c_ij - 2 v_j . sum_i c_ij o_i + sum_i c_ij ||o_i||^2 (no [w, n, dv] tensor).
    """
    hq, w, n = probs.shape[-3:]
    hkv = values.shape[-3]
    p = probs.float().reshape(*probs.shape[:-3], hkv, hq // hkv, w, n)  # [.., Hkv, G, w, n]
    v = values.float().unsqueeze(-3)  # [.., Hkv, 1, n, dv]
    out = p @ v  # [.., Hkv, G, w, dv]
    c = (p / (1.0 - p + epsilon)).square()
    ct = c.transpose(-1, -2)  # [.., Hkv, G, n, w]
    first = c.sum(-2) * v.square().sum(-1)
    second = 2.0 * (v * (ct @ out)).sum(-1)
    third = (ct @ out.square().sum(-1, keepdim=True)).squeeze(-1)
    return (first - second + third).mean(-2)


def smoothed(scores: Tensor, kernel: int) -> Tensor:
    """scores [.., n] averaged over ``kernel`` neighbours (zero padding counted, same length)."""
    if kernel <= 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    return F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)[..., : scores.shape[-1]].reshape(scores.shape)


class DropKV(PromptScored):
    name = "dropkv"
    title = "DropKV"
    group = "recent"
    paper = (
        "DropKV: KV Cache Eviction via Decoupled Residual-Output Perturbation, OpenReview MqfNzH3TVH "
        "(https://openreview.net/forum?id=MqfNzH3TVH)"
    )
    summary = (
        "Keeps the prompt tokens whose eviction would perturb the last 32 queries' outputs most "
        "(sum of (p/(1-p))^2 ||v - o||^2), plus those 32."
    )
    params = (
        Param("window", 32, "last prompt queries whose outputs are measured (their tokens are kept)", minimum=1),
        Param("kernel", 7, "average-pooling kernel over the scores (1: none)", minimum=1),
        Param("epsilon", 1e-6, "added to 1 - p in the perturbation's weight", minimum=0.0),
    )

    def observed(self, n_prompt: int) -> int:
        """The window's queries: ``window``, at most the prompt."""
        return max(1, min(int(self.cfg["window"]), n_prompt))

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return PrefillNeeds(query_window=self.observed(n_prompt))

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: the smoothed perturbation score of every prompt token."""
        w, eps, kernel = self.observed(state.n_tokens), float(self.cfg["epsilon"]), int(self.cfg["kernel"])

        def compute() -> Tensor:
            return smoothed(perturbation_scores(state.window_probs(w), state.values, eps), kernel)

        return self.shared(state, (w, eps, kernel), compute)
