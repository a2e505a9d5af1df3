"""Expected Attention: prompt tokens scored by the attention future queries are expected to pay them.

Devoto, Jeblick, Jégou. "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", 2025, https://arxiv.org/abs/2510.00636 — Sec. 3, and its reference
implementation, ``ExpectedAttentionPress`` in NVIDIA's kvpress:

1. The pre-RoPE queries of the prompt (all but the first ``n_sink``, whose outlier activations
   would distort the statistics) are modelled as a Gaussian N(mu, Sigma) per query head.
2. A future query at position t is R_t q (RoPE's rotation). The rotation is averaged over the next
   ``n_future`` positions n .. n + T - 1: Rbar = mean_t R_t, and the future query is modelled as
   Rbar q ~ N(Rbar mu, Rbar Sigma Rbar^T).
3. The expected unnormalised attention of a (post-RoPE) key k is then the Gaussian's moment
   generating function at s k (s = the attention scaling, 1/sqrt(d)):
   E[exp(s q.k)] = exp(s (Rbar mu).k + s^2/2 k^T (Rbar Sigma Rbar^T) k)
   (the covariance term only with ``use_covariance``).
4. Normalised over the keys (a softmax of the expected logits) and averaged over the query heads
   of each KV group, the expected attention a_i is multiplied by the value's norm,
   (a_i + epsilon) * ||v_i|| (with ``use_vnorm``): the size of the token's expected contribution
   to the residual stream, which the paper's score approximates with ||v_i|| for ||W_o v_i||.
5. The first ``n_sink`` tokens are always kept; of the others, the top ``capacity - n_sink`` per
   (layer, KV head) are kept, in position order. Prefill-only: generated tokens are all kept.

Defaults are the reference implementation's: T = 512, n_sink = 4, covariance and value norms on,
epsilon = 0.

Deviations:

* The scaling is the model's own attention scaling s (1/sqrt(d) in the paper; the same on every
  model that does not set another), so the covariance term is s^2/2 rather than 1/(2d).
* A soft-capped model's logits are capped after q.k; the expectation is taken of the uncapped
  logit (the cap is monotone, so a single query's ranking is unchanged; the expectation is not
  exactly the capped one's).
* ``stats_window`` (default: every prompt query after the sinks, as the paper's prefill) can
  restrict the statistics to the last prompt queries, as the paper's decoding-time buffer does.
* The paper also compresses while decoding (statistics from a buffer of recent queries); here the
  method is prefill-only, like SnapKV.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.ops import pool_heads


def mean_rotation(rotate, positions: Tensor, head_dim: int) -> Tensor:
    """Rbar [d, d]: RoPE's rotation matrix averaged over ``positions`` [T].

    ``rotate(x [..., P, d], positions [P])`` applies the model's RoPE (pre -> post) at those
    positions; applied to the basis vectors it gives each R_t's columns, so the model's own
    convention (half split or interleaved, scaled frequencies) is what is averaged.
    """
    t = positions.shape[0]
    basis = torch.eye(head_dim, device=positions.device).unsqueeze(1).expand(head_dim, t, head_dim)
    cols = rotate(basis, positions)  # [j, t, :] = R_t e_j
    return cols.float().mean(1).T  # [i, j] = mean_t R_t[i, j]


def future_query_stats(mean: Tensor, cov: Tensor | None, rbar: Tensor) -> tuple[Tensor, Tensor | None]:
    """Pre-RoPE Gaussian N(mean [.., H, d], cov [.., H, d, d]) -> that of Rbar q: (Rbar mean, Rbar cov Rbar^T)."""
    mu = mean.float() @ rbar.T
    return mu, None if cov is None else rbar @ cov.float() @ rbar.T


def expected_logits(keys: Tensor, mean: Tensor, cov: Tensor | None, scaling: float) -> Tensor:
    """log E[exp(s q.k)] for q ~ N(mean, cov), per query head and key: [.., Hq, n].

    keys [.., Hkv, n, d] (post-RoPE); mean [.., Hq, d] and cov [.., Hq, d, d] (None: the mean
    alone) of the future queries; query head h reads KV head h // (Hq / Hkv).
    The Gaussian's moment generating function: s mean.k + s^2 / 2 k^T cov k.
    """
    hkv, hq = keys.shape[-3], mean.shape[-2]
    g = hq // hkv
    k = keys.float()
    mu = mean.reshape(*mean.shape[:-2], hkv, g, mean.shape[-1])  # [.., Hkv, G, d]
    out = scaling * (mu @ k.transpose(-1, -2))  # [.., Hkv, G, n]
    if cov is not None:
        c = cov.reshape(*cov.shape[:-3], hkv, g, *cov.shape[-2:])  # [.., Hkv, G, d, d]
        kk = k.unsqueeze(-3)  # [.., Hkv, 1, n, d]
        out = out + 0.5 * scaling**2 * ((kk @ c) * kk).sum(-1)
    return out.reshape(*out.shape[:-3], hq, out.shape[-1])


def expected_attention_scores(
    keys: Tensor,
    values: Tensor,
    mean: Tensor,
    cov: Tensor | None,
    scaling: float,
    epsilon: float = 0.0,
    use_vnorm: bool = True,
) -> Tensor:
    """The paper's score of every key: (expected attention + epsilon) * ||v||, [.., Hkv, n].

    keys [.., Hkv, n, d], values [.., Hkv, n, dv]; mean / cov: the future queries' Gaussian
    (``future_query_stats``). The expected attention is the softmax over the n keys of the expected
    logits, averaged over each KV group's query heads.
    """
    probs = torch.softmax(expected_logits(keys, mean, cov, scaling), dim=-1)  # [.., Hq, n]
    attn = pool_heads(probs, keys.shape[-3], head_dim=-2, reduce="mean")  # [.., Hkv, n]
    return (attn + epsilon) * values.float().norm(dim=-1) if use_vnorm else attn
