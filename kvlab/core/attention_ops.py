"""Shared tensor math: grouped-query attention over dense or weighted caches, head pooling.

Shapes use: Hq query heads, Hkv KV heads, g = Hq / Hkv, t queries, n keys, d head_dim.
Head grouping and token selection (``group_queries``, ``ungroup``, ``gather_tokens``) are ``kernels.tensor_ops``'.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.semantics import Keys, LayerSemantics

Sem = LayerSemantics | float  # a layer's semantics, or a bare scaling (plain softmax attention)


def pool_heads(x: Tensor, n_kv_heads: int, head_dim: int = -3, reduce: str = "sum") -> Tensor:
    """Pool a per-query-head tensor over each KV group: [.., Hq, ...] -> [.., Hkv, ...]."""
    dim = head_dim % x.dim()
    shape = list(x.shape)
    g = shape[dim] // n_kv_heads
    x = x.reshape(*shape[:dim], n_kv_heads, g, *shape[dim + 1 :])
    return x.sum(dim + 1) if reduce == "sum" else x.mean(dim + 1) if reduce == "mean" else x.amax(dim + 1)


def causal_window_probs(queries: Tensor, keys: Tensor, scaling: float | sm.ModelSemantics) -> Tensor:
    """Attention of the last w prompt queries over all n prompt keys, causally masked.

    queries: [L, Hq, w, d] at positions n-w .. n-1; keys: [L, Hkv, n, d]. Returns [L, Hq, w, n].
    ``scaling`` a ``ModelSemantics`` (one per layer of the L): each layer's window, soft-cap and sinks.
    """
    if isinstance(scaling, sm.ModelSemantics) and not scaling.plain:
        w, n = queries.shape[-2], keys.shape[-2]
        qpos, kpos = torch.arange(n - w, n, device=keys.device), torch.arange(n, device=keys.device)
        out = []
        for layer, s in enumerate(scaling.layers[: queries.shape[0]]):
            x = sm.logits(queries[layer].float(), keys[layer].float(), s)
            bias = sm.window_bias(s, qpos, kpos)
            out.append(sm.softmax(x if bias is None else x + bias, s))
        return torch.stack(out)
    if isinstance(scaling, sm.ModelSemantics):
        scaling = scaling[0].scaling
    # only the last w keys can lie in a query's future
    logits = sm.mask_future(sm.logits(queries.float(), keys.float(), scaling), queries.shape[-2])
    return torch.softmax(logits, dim=-1)


def on_positions(probs: Tensor, pos: Tensor, n: int | None = None) -> Tensor:
    """Weights of held keys spread onto token positions: probs [Hq, m], pos [Hkv, m] -> [Hq, n].

    ``pos`` holds each KV head's key positions (query head h reads KV head h // g); a position
    held twice gets the sum. ``n`` defaults to the largest position + 1.
    """
    hq, hkv = probs.shape[0], pos.shape[0]
    idx = pos.long().repeat_interleave(hq // hkv, dim=0)
    n = int(pos.max()) + 1 if n is None else n
    return probs.float().new_zeros(hq, n).scatter_add_(1, idx, probs.float())


def weights_on_positions(q: Tensor, k: Keys, pos: Tensor, scaling: Sem, logw: Tensor | None = None) -> Tensor:
    """Softmax weights of one query over held keys, by token position.

    q [Hq, 1, d]; k [Hkv, m, d] at positions pos [Hkv, m]; logw [Hkv, m] or None. Returns [Hq, n].
    """
    probs = sm.softmax(sm.logits(q.float(), k.float(), scaling, logw), scaling)[:, 0]
    return on_positions(probs, pos)


def tensor_bytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


__all__ = [
    "causal_window_probs",
    "on_positions",
    "pool_heads",
    "tensor_bytes",
    "weights_on_positions",
]
