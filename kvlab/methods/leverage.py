"""LeverageScore: keep the prompt tokens whose pre-RoPE keys have the largest statistical leverage.

Chari, Van Durme. "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", 2025, https://arxiv.org/abs/2507.08143 — its geometric half, as kvpress 0.5.5
implements it on its own (``LeverageScorePress``). Per layer and KV head:

1. the prompt's keys before RoPE, K [n, d], centred over the sequence;
2. sketched on the right by a Gaussian Phi [d, k] (entries N(0, 1/k), k = 48): X = (K - mean K) Phi;
3. the leverage of token i, h_i = x_i^T (X^T X + lambda I)^{-1} x_i (clamped at 0), via a Cholesky
   factor of the k x k Gram matrix; lambda = 1e-2, raised tenfold while the factorisation fails
   (at most 5 tries), as kvpress does. A token far outside the directions the other keys span has
   a leverage near 1, one among many alike near 0; the highest are kept. No attention is computed.

Defaults are kvpress's (k = 48; the paper's own code is not public), and the method keeps nothing
besides its top tokens, as kvpress's press.

Deviations:

* Keys before RoPE are the cached (post-RoPE) keys turned back with the model's own rotary
  embedding (``kvlab.core.rope``), in float32; kvpress projects the layer's hidden states again
  (``k_proj``). The two agree to float32 rounding. A model without a rotary embedding kvlab can
  read is refused.
* The sketch is drawn from the run's seed (a CPU ``torch.Generator``), one [1, Hkv, d, k] float32
  draw per layer in layer order: the same numbers kvpress draws on a float32 model after
  ``torch.manual_seed(seed)``, so the kept positions can be compared with it.
* kvpress z-normalises each layer's scores (over all its heads and tokens) before the top-k: an
  increasing affine map of the whole layer that changes no ranking, left out here.
* ``window`` (kvlab's, default 0: none, as kvpress) keeps the prompt's last tokens whatever their
  score. Prefill-only: generated tokens are all kept.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlab.core.rope import Rotary
from kvlab.methods.expected_attention import require_rope
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored

RIDGE = 1e-2  # kvpress's first jitter on the sketched Gram matrix
TRIES = 5


def pre_rope_keys(keys: Tensor, rope: Rotary, first: int = 0) -> Tensor:
    """keys [L, Hkv, m, d] as cached (post-RoPE) at positions first..first+m-1 -> before RoPE, float32."""
    return rope.unrotate(keys.float(), torch.arange(first, first + keys.shape[-2], device=keys.device))


def gaussian_sketch(seed: int, n_layers: int, n_kv_heads: int, head_dim: int, k: int) -> Tensor:
    """[L, Hkv, d, k] float32 Gaussian sketches with entries N(0, 1/k), drawn from ``seed`` one layer at a time
    ([1, Hkv, d, k] each, the draws kvpress makes layer by layer)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    draws = [torch.randn(1, n_kv_heads, head_dim, k, generator=gen) for _ in range(n_layers)]
    return torch.cat(draws) * (1 / math.sqrt(k))


def cholesky_with_jitter(gram: Tensor, jitter: float = RIDGE, tries: int = TRIES) -> Tensor:
    """The lower Cholesky factor of gram [.., k, k] + jitter I, the jitter raised tenfold (every matrix of the
    batch together) while some factorisation fails."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    for _ in range(tries):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if bool((info == 0).all()):
            return factor
        jitter = max(1e-8, 10.0 * jitter)
    raise RuntimeError(f"leverage scores: the sketched Gram matrix is not positive definite after {tries} tries")


def leverage_scores(keys: Tensor, sketch: Tensor) -> Tensor:
    """Approximate leverage of every key: keys [.., n, d] (before RoPE), sketch [.., d, k] -> [.., n] float32.

    Centred over the n keys, sketched (X = (K - mean) Phi), then diag(X (X^T X + lambda I)^{-1} X^T) from a
    Cholesky solve, clamped at 0.
    """
    x = (keys - keys.mean(dim=-2, keepdim=True)) @ sketch.to(keys.dtype)  # [.., n, k]
    x = x.float()
    xt = x.transpose(-1, -2)
    gram = xt @ x
    factor = cholesky_with_jitter(0.5 * (gram + gram.transpose(-1, -2)))
    solved = torch.cholesky_solve(xt, factor)  # (X^T X + lambda I)^{-1} X^T: [.., k, n]
    return (x * solved.transpose(-1, -2)).sum(-1).clamp_min(0)


class LeverageScore(PromptScored):
    name = "leverage"
    title = "LeverageScore"
    group = "recent"
    paper = (
        "Chari, Van Durme, Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate "
        "Leverage Scores, 2025 (arXiv:2507.08143)"
    )
    summary = (
        "Keeps the prompt tokens whose pre-RoPE keys have the largest approximate statistical leverage "
        "(a Gaussian sketch of the centred keys), per layer and KV head."
    )
    params = (
        Param("sketch_dimension", 48, "columns k of the Gaussian sketch (kvpress's default)", minimum=1),
        Param("window", 0, "last prompt tokens kept whatever their score (kvpress: none)", minimum=0),
    )

    def check_semantics(self) -> None:
        super().check_semantics()
        require_rope(self.name, self.info.rope, "it scores the keys before RoPE")

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: the leverage of every prompt token's pre-RoPE key."""
        k = int(self.cfg["sketch_dimension"])
        return self.shared(state, (k, self.seed), lambda: self.leverage(state, k))

    def leverage(self, state: PrefillState, k: int) -> Tensor:
        """[L, Hkv, n] the leverage scores, sketched to ``k`` columns from the run's seed."""
        rope = self.info.rope
        assert rope is not None  # check_semantics refused a model without one
        keys = pre_rope_keys(state.keys, rope)
        n_layers, n_kv, _, d = keys.shape
        sketch = gaussian_sketch(self.seed, n_layers, n_kv, d, k)
        return leverage_scores(keys, sketch.to(keys.device))
