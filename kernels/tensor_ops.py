"""Head grouping and token selection shared by the kernels and their torch references.

Shapes use: Hq query heads, Hkv KV heads, g = Hq / Hkv, t queries, n keys, d head_dim.
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
    """Select tokens per head: x [.., H, n, d] (or [.., H, n]) with idx [.., H, m] -> [.., H, m, d] ([.., H, m]).

    idx's leading dims may be smaller than x's (``torch.gather``'s rule). Whole rows of d elements are
    copied at once (``index_select`` over x's rows, read through its strides) when x's rows are
    contiguous: an element-wise ``gather`` over [.., H, m, d] is ~15x slower on the CPU.
    """
    if x.dim() == idx.dim():
        return torch.gather(x, -1, idx)
    rows = _token_rows(x, idx)
    if rows is None:
        return torch.gather(x, -2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))
    table, flat = rows
    return table.index_select(0, flat).view(*idx.shape, x.shape[-1])


def _token_rows(x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor] | None:
    """x's token rows as one [R, d] view of its storage and idx as row numbers in it, or None when x's
    rows are not laid out that way (or nothing is selected)."""
    d, st = x.shape[-1], x.stride()
    if idx.numel() == 0 or x.numel() == 0 or st[-1] != 1 or st[-2] != d or any(s % d for s in st[:-2]):
        return None
    flat = idx.to(torch.int64)
    last = x.shape[-2] - 1
    for i, size in enumerate(idx.shape[:-1]):  # each leading index, in rows of d elements
        step = st[i] // d
        shape = [1] * idx.dim()
        shape[i] = size
        flat = flat + torch.arange(size, device=x.device).view(shape) * step
        last += (size - 1) * step
    return x.as_strided((last + 1, d), (d, 1)), flat.reshape(-1)


__all__ = ["gather_tokens", "group_queries", "ungroup"]
