"""KNorm: keep the prompt keys with the smallest L2 norm.

Devoto, Zhao, Scardapane, Minervini. "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", EMNLP 2024, https://arxiv.org/abs/2406.11430 — across most layers a key's
L2 norm and the attention it later receives are anti-correlated, so the cache keeps, per layer
and head, the tokens whose keys have the lowest norm (and their values), without looking at any
attention weight. The reference code (github.com/alessiodevoto/l2compress, ``l2_compress``) sorts
each head's tokens by key norm after a forward pass and keeps the lowest ``keep_ratio``. kvpress's
``KnormPress`` (the scorer ``-keys.norm(dim=-1)`` on every layer) skips no layer, and neither does
kvlab by default; ``skip_layers=2`` gives the reference code's example, which leaves layers 0 and 1
uncompressed.

Deviations:

* The budget is bytes: the layers left uncompressed (``skip_layers``, the first ones) keep every
  prompt token, and the other layers share what remains of the same total, so the cache holds the
  budget. When even one token per compressed layer would not fit, fewer layers are skipped.
* Norms are taken on the keys as cached (post-RoPE, as in the reference code), in float32.
* Compression runs once, after the exact prefill (the paper's retrieval setting); the paper's
  language-modelling runs also prune while decoding. Here generated tokens are all kept.
* ``window`` (default 0, none in the paper) optionally keeps the prompt's last tokens whatever their norm.
"""

from __future__ import annotations

from torch import Tensor

from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored


class KNorm(PromptScored):
    name = "knorm"
    title = "KNorm"
    group = "recent"
    paper = (
        "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, "
        "EMNLP 2024 (arXiv:2406.11430)"
    )
    summary = "Keeps the prompt tokens whose keys have the smallest L2 norm, per layer and KV head."
    params = (
        Param(
            "skip_layers",
            0,
            "first layers left uncompressed (kvpress: none; the reference code's example: 2, layers 0 and 1)",
            minimum=0,
        ),
        Param("window", 0, "last prompt tokens kept whatever their norm (paper: none)", minimum=0),
    )

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: minus each key's L2 norm (the smallest norms score highest)."""
        return -state.keys.float().norm(dim=-1)

    def plan_tokens(self, n_prompt: int) -> dict:
        knobs = super().plan_tokens(n_prompt)
        n_layers, prefix = self.info.n_layers, n_prompt - self.window
        total = n_layers * knobs["prefix_kept"]  # tokens besides the windows, all layers together
        skip = 0 if self.full or self.capacity >= n_prompt else min(int(self.cfg["skip_layers"]), n_layers)
        need = max(0, 1 - self.window)  # each compressed layer keeps at least one token
        while skip and total - skip * prefix < (n_layers - skip) * need:
            skip -= 1
        self.layer_keep = None
        if not skip:
            return {**knobs, "skip_layers": 0}
        share, extra = divmod(total - skip * prefix, n_layers - skip)  # the rest, spread evenly
        self.layer_keep = [prefix] * skip + [share + (i < extra) for i in range(n_layers - skip)]
        return {**knobs, "skip_layers": skip, "layer_capacity": [k + self.window for k in self.layer_keep]}
