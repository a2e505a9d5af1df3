"""The sequential rules ``kvlab.methods.clustering`` computes in batches: one stream, one key at a time.

Written as the papers state them (SubGen / ClusterGen, arXiv:2402.06082: Algorithm 1's leader
clustering; Gonzalez' greedy k-center), with plain loops over tokens and exact distances
``||x - c||``. Far too slow for a real prompt, they are the specification the batched forms are
tested against (``tests/test_subgen_clustering.py``); the product never calls them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def leader_clusters(keys: Tensor, delta: float, m_cap: int) -> tuple[Tensor, Tensor]:
    """Algorithm 1, lines 11-22 (UpdateSoftmaxNormalizer's clusters) over one stream, key by key.

    A key joins the nearest representative opened before it if it lies within ``delta``, else it
    opens a cluster with itself as representative; once ``m_cap`` are open it joins the nearest
    anyway. keys [n, d] -> assign [n] (each key's cluster), representatives [m, d] (m <= m_cap).
    """
    reps: list[Tensor] = []
    assign: list[int] = []
    for k in keys:
        if reps:
            dist, j = (torch.stack(reps) - k).norm(dim=-1).min(0)
            if dist <= delta or len(reps) >= m_cap:
                assign.append(int(j))
                continue
        reps.append(k)
        assign.append(len(reps) - 1)
    return torch.tensor(assign), torch.stack(reps)


def leader_delta(keys: Tensor, m_cap: int, iters: int = 10) -> Tensor:
    """The smallest radius at which ``leader_clusters`` of one stream keys [n, d] opens at most
    ``m_cap`` clusters, by ``iters`` steps of bisection on [0, 2 max ||k|| + 1e-6] (any radius at
    least the diameter gives one cluster): a 0-dim tensor, the upper end of the last interval."""
    hi = 2 * keys.norm(dim=-1).amax() + 1e-6
    lo = torch.zeros_like(hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        opened = leader_clusters(keys, float(mid), m_cap + 1)[1].shape[0]
        hi, lo = (mid, lo) if opened <= m_cap else (hi, mid)
    return hi


def greedy_kcenter(x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gonzalez' greedy k-center over one stream x [n, d]: start from token 0, then k - 1 times add
    the token farthest from the centers chosen so far (never one already chosen).

    Returns the centers' token indices [min(k, n)], each token's nearest center (index into the
    centers, the earliest on a tie; a center is its own) [n], and the cover radius (0-dim).
    """
    n = x.shape[0]
    centers = [0]
    while len(centers) < min(k, n):
        dist = (x.unsqueeze(1) - x[centers]).norm(dim=-1).amin(-1)
        dist[centers] = -1.0
        centers.append(int(dist.argmax()))
    dist = (x.unsqueeze(1) - x[centers]).norm(dim=-1)  # [n, k]
    assign = dist.argmin(-1)
    assign[centers] = torch.arange(len(centers))
    return torch.tensor(centers), assign, dist.gather(-1, assign.unsqueeze(-1)).amax()
