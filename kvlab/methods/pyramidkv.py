"""PyramidKV: SnapKV selection with per-layer budgets that shrink with depth.

Cai, Zhang, Gao, Liu, Liu, Lu, Hu, Dong, Xiao. "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling", arXiv:2406.02069 — Sec. 3 (budget allocation): attention gets
more concentrated in higher layers, so the total budget of ``L x k`` tokens is spread as an
arithmetic sequence, the top layer getting ``k / beta`` and the bottom layer ``2k - k / beta``;
inside each layer the tokens are picked as in SnapKV (votes of the last ``window`` prompt
queries, pooled). Here ``k`` is the per-layer budget beyond the observation window, which every
layer keeps; the rounded per-layer budgets sum exactly to the total.
"""

from __future__ import annotations

import torch

from kvlab.methods.params import Param
from kvlab.methods.snapkv import SnapKV


def pyramid_budgets(total: int, n_layers: int, beta: float, cap: int) -> list[int]:
    """Integer per-layer budgets (bottom layer first) of an arithmetic sequence summing to ``total``.

    Real-valued sequence from ``2a - a/beta`` down to ``a/beta`` (a = total / n_layers); rounded
    by largest remainder; any layer above ``cap`` gives its excess to the layers below the cap.
    """
    a = total / n_layers
    top = a / beta
    real = torch.linspace(2 * a - top, top, n_layers, dtype=torch.float64) if n_layers > 1 else torch.tensor([a])
    real = real.clamp(max=cap)
    missing = total - real.sum()
    while missing > 1e-9 and bool((real < cap).any()):  # spread what the clamp cut off
        room = (cap - real).clamp(min=0)
        real = real + room * min(1.0, float(missing / room.sum()))
        missing = total - real.sum()
    out = real.floor().long()
    rest = int(round(float(real.sum()))) - int(out.sum())
    if rest > 0:
        out[torch.argsort(real - out, descending=True, stable=True)[:rest]] += 1
    return out.tolist()


class PyramidKV(SnapKV):
    name = "pyramidkv"
    title = "PyramidKV"
    paper = (
        "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling "
        "(arXiv:2406.02069)"
    )
    summary = "SnapKV with a pyramid of per-layer budgets: more tokens in lower layers, fewer in higher, same total."
    params = SnapKV.params + (
        Param("beta", 20.0, "top layer keeps 1/beta of the average per-layer budget", minimum=1.0),
    )

    def plan_tokens(self, n_prompt: int) -> dict:
        knobs = super().plan_tokens(n_prompt)
        n_layers = self.info.n_layers
        self.layer_keep = pyramid_budgets(
            n_layers * knobs["prefix_kept"], n_layers, float(self.cfg["beta"]), n_prompt - self.window
        )
        return {**knobs, "layer_capacity": [k + self.window for k in self.layer_keep]}
