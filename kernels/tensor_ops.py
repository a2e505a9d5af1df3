"""Head grouping and token selection shared by the kernels and their torch references.

Shapes use: Hq query heads, Hkv KV heads, g = Hq / Hkv, t queries, n keys, d head_dim.
``kvlab.ops`` re-exports these.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_queries(q: Tensor, n_kv_heads: int) -> Tensor:
    """[..., Hq, t, d] -> [..., Hkv, g*t, d]: the query heads of each KV group side by side."""
    *lead, hq, t, d = q.shape
    g = hq // n_kv_heads
    return q.reshape(*lead, n_kv_heads, g * t, d)


def ungroup(out: Tensor, n_heads: int) -> Tensor:
    """[..., Hkv, g*t, x] -> [..., Hq, t, x] (inverse of ``group_queries``)."""
    *lead, hkv, gt, x = out.shape
    return out.reshape(*lead, n_heads, gt * hkv // n_heads, x)


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Select tokens per head: x [.., H, n, d] (or [.., H, n]) with idx [.., H, m] -> [.., H, m, d] ([.., H, m])."""
    if x.dim() == idx.dim():
        return torch.gather(x, -1, idx)
    return torch.gather(x, -2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


__all__ = ["gather_tokens", "group_queries", "ungroup"]
