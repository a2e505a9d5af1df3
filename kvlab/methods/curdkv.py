"""CurDKV: keep the prompt tokens of largest approximate leverage of keys and values together.

Sengupta, Chaudhary, Chakraborty. "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition" (CurDKV), NeurIPS 2025, https://arxiv.org/abs/2509.15038 — as kvpress 0.5.5
implements it (``CURPress``): a CUR decomposition samples rows with probability proportional to
their leverage, which the squared row norms approximate. Per layer and KV head:

1. k2_i = ||k_i||^2 and v2_i = ||v_i||^2 (optionally after a shared Gaussian projection to 20
   dimensions, ``random_projection``);
2. each normalised within consecutive windows of ``local_window`` tokens (its share of its window's
   sum; the last window padded with zeros), the local approximation of the leverage;
3. combined as k2 x v2 (``leverage``: also k2, v2 or their mean), normalised to sum 1 over the
   prompt; the first ``n_sink`` tokens get 1 (always kept). The highest are kept.

Defaults are kvpress's (4 sinks, the product, local windows of 16, no projection); the paper
approximates the leverage through Gaussian random projections, which ``random_projection`` turns on.

Deviations from kvpress:

* The projection, when on, is drawn from the run's seed, one [d, 20] float32 draw per layer for the
  keys (and one more for the values when their head size differs; kvpress uses the keys' for both
  and cannot run then).
* A window whose keys (or values) are all zero would divide by zero in kvpress; here its shares are 0.
* Scores are computed on the cached (post-RoPE) keys in float32, as kvpress on a float32 model.
  Prefill-only: generated tokens are all kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored

PROJECTION = 20  # kvpress's dimension of the random projection


def local_shares(x: Tensor, window: int) -> Tensor:
    """x [.., n] (non-negative) -> each entry's share of its window's sum, windows of ``window`` consecutive
    entries (the last one padded with zeros); a window summing to 0 gives shares of 0."""
    n = x.shape[-1]
    padded = F.pad(x, (0, (-n) % window)).reshape(*x.shape[:-1], -1, window)
    total = padded.sum(-1, keepdim=True)
    shares = torch.where(total > 0, padded / total.clamp_min(torch.finfo(x.dtype).tiny), 0.0)
    return shares.reshape(*x.shape[:-1], -1)[..., :n]


def curd_scores(keys: Tensor, values: Tensor, leverage: str, window: int, n_sink: int) -> Tensor:
    """keys [.., n, d], values [.., n, dv] (float32) -> CurDKV's scores [.., n] (module docstring, steps 1-3)."""
    k2, v2 = keys.square().sum(-1), values.square().sum(-1)
    if window > 1:
        k2, v2 = local_shares(k2, window), local_shares(v2, window)
    combined = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage]
    scores = combined / combined.sum(-1, keepdim=True)
    scores[..., :n_sink] = 1.0
    return scores


class CurDKV(PromptScored):
    name = "curdkv"
    title = "CurDKV"
    group = "recent"
    paper = (
        "Sengupta, Chaudhary, Chakraborty, Value-Guided KV Compression for LLMs via Approximated CUR Decomposition, "
        "NeurIPS 2025 (arXiv:2509.15038)"
    )
    summary = (
        "Keeps the prompt tokens of largest key x value leverage (squared norms, normalised in windows of 16), "
        "plus the first 4."
    )
    params = (
        Param("n_sink", 4, "first prompt tokens always kept", minimum=0),
        Param(
            "leverage",
            "kv_product",
            "how the key and value leverages combine",
            choices=("kv_product", "kv_avg", "key", "value"),
        ),
        Param("local_window", 16, "tokens per window of the local approximation (1: none)", minimum=1),
        Param("random_projection", False, f"project keys and values to {PROJECTION} Gaussian dimensions first"),
    )

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: CurDKV's score of every prompt token (the sinks: 1)."""
        keys, values = state.keys.float(), state.values.float()
        if self.cfg["random_projection"]:
            keys, values = self.projected(keys, values)
        c = self.cfg
        return curd_scores(keys, values, c["leverage"], int(c["local_window"]), int(c["n_sink"]))

    def projected(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys, values [L, Hkv, n, d] through one Gaussian [d, 20] / sqrt(20) per layer, from the run's seed."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed)

        def gaussian(rows: int) -> Tensor:
            return torch.randn(rows, PROJECTION, generator=gen) / math.sqrt(PROJECTION)

        out_k, out_v = [], []
        for k, v in zip(keys, values):
            g = gaussian(k.shape[-1])
            gv = g if v.shape[-1] == k.shape[-1] else gaussian(v.shape[-1])
            out_k.append(k @ g.to(k.device))
            out_v.append(v @ gv.to(v.device))
        return torch.stack(out_k), torch.stack(out_v)
