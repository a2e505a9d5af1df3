"""Online (leader) clustering and greedy k-center of key streams, batched over streams.

The clustering inside SubGen: Zandieh, Han, Mirrokni, Karbasi, "SubGen: Token Generation in
Sublinear Time and Memory", arXiv:2402.06082 (2024) (later version: ClusterGen).

* Leader clustering (Algorithm 1, UpdateSoftmaxNormalizer, lines 11-22): each key joins the nearest
  cluster representative opened before it if that lies within ``delta``, else it opens a cluster with
  itself as representative (a delta-net of the stream: representatives are more than delta apart,
  every key lies within delta of one). Past ``m_cap`` clusters a key joins its nearest cluster anyway
  (kvlab's cap, for the byte budget). ``cluster_stream`` runs it over a whole prompt;
  ``nearest_center`` and ``open_or_join`` are one token's step while decoding; ``leader_delta``
  finds the smallest delta at which a prompt opens at most ``m_cap`` clusters.
* Greedy k-center (Gonzalez 1985; Dyer-Frieze), the experiments' clustering (SubGen Sec. 3.2,
  ClusterGen Sec. 4.1): ``greedy_kcenter``.

Every function works on B independent streams at once (B = layers x KV heads, flattened): keys
[B, n, d]. The sequential rules they compute, one stream and one key at a time, are in
``tests/clustering_reference.py``; the batched forms give the same result (tests compare them). Squared
distances come from batched products expanded as |x|^2 + |c|^2 - 2 <x, c>; where several passes must
agree to the last bit (``leader_delta``'s bisection steps and its final clustering) they measure every
distance with a product of the same layout, since the rounding of a product depends on its shape.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor


def _sqdist(x: Tensor, xsq: Tensor, c: Tensor, csq: Tensor) -> Tensor:
    """Squared distances of points x [B, n, d] to points c [B, m, d] given their squared norms: [B, n, m].

    Expanded as |x|^2 + |c|^2 - 2 <x, c> (may dip a rounding error below 0; callers only compare).
    """
    return torch.baddbmm(xsq.unsqueeze(-1) + csq.unsqueeze(-2), x, c.transpose(-1, -2), alpha=-2)


# ----- greedy k-center -----------------------------------------------------------------------------
@dataclass
class KCenter:
    """Greedy k-center result per stream: centers [B, k] (token indices), assign [B, n], radius [B]."""

    centers: Tensor
    assign: Tensor
    radius: Tensor


KCENTER_BYTES = 16 << 20  # keys of the streams one greedy k-center pass works on together


def greedy_kcenter(x: Tensor, k: int) -> KCenter:
    """Gonzalez' greedy k-center (a 2-approximation) on every stream.

    x: [B, n, d]. Starts from token 0; each round adds the point farthest from the chosen centers.
    Returns the chosen token indices, each point's nearest center (index into ``centers``) and the
    final cover radius. A chosen point belongs to its own cluster and is never chosen twice, so
    every cluster has at least one member even when keys repeat (k distinct tokens for k <= n).

    Each round reads all keys of its streams, so the streams go in groups of at most
    ``KCENTER_BYTES`` of keys (at least two streams, which keeps the batched products' rounding),
    the k rounds of a group reading from cache rather than memory.
    """
    b, n, d = x.shape
    step = max(2, KCENTER_BYTES // max(1, n * d * x.element_size()))
    if step >= b:
        return _greedy_kcenter(x, k)
    parts = [_greedy_kcenter(x[i : i + step], k) for i in range(0, b, step)]
    return KCenter(*(torch.cat(t) for t in zip(*((p.centers, p.assign, p.radius) for p in parts))))


def _greedy_kcenter(x: Tensor, k: int) -> KCenter:
    """``greedy_kcenter`` on all streams of x [B, n, d] in lockstep.

    Each round measures every point against the new center with one batched product (the new
    center's key as a [B, d, 1] view: the product's rounding depends on its layout) and updates the
    running nearest distance and center in place (assign kept in int32 until the end).
    """
    b, n, d = x.shape
    k = min(k, n)
    xsq = (x * x).sum(-1)
    flat, flat_sq, first = x.reshape(-1, d), xsq.view(-1), torch.arange(b, device=x.device) * n
    xsq = xsq.unsqueeze(-1)
    d2 = torch.empty_like(xsq)  # [B, n, 1]: each round's squared distances, written in place
    best = torch.full((b, n), float("inf"), dtype=x.dtype, device=x.device)
    assign = torch.zeros(b, n, dtype=torch.int32, device=x.device)
    closer = torch.empty(b, n, dtype=torch.bool, device=x.device)
    cur = torch.zeros(b, dtype=torch.long, device=x.device)
    picks = []
    for j in range(k):
        picks.append(cur)
        at = first + cur
        c, csq = flat.index_select(0, at), flat_sq.index_select(0, at)
        torch.add(xsq, csq.view(b, 1, 1), out=d2).baddbmm_(x, c.unsqueeze(1).transpose(-1, -2), alpha=-2)
        torch.lt(d2.view(b, n), best, out=closer)
        torch.minimum(best, d2.view(b, n), out=best)  # = where(closer, d2, best): no NaN; equal values are equal
        assign.masked_fill_(closer, j)
        assign.view(-1).index_fill_(0, at, j)
        best.view(-1).index_fill_(0, at, -1.0)  # chosen: distance 0, below every unchosen point's
        cur = best.argmax(-1)
    return KCenter(torch.stack(picks, 1), assign.long(), best.amax(-1).clamp_min(0).sqrt())


# ----- leader clustering, one token at a time (decoding) ------------------------------------------
def nearest_center(centers: Tensor, csq: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Nearest center of each stream's key: centers [B, m, d], csq [B, m] (inf = unused), k [B, d].

    Returns (squared distance [B], index [B]).
    """
    d2 = _sqdist(k.unsqueeze(1), (k * k).sum(-1, keepdim=True), centers, csq).squeeze(1)
    return d2.min(-1)


def open_or_join(dmin: Tensor, j: Tensor, count: Tensor, delta: Tensor, m_cap: int) -> tuple[Tensor, Tensor]:
    """Line 13 of Algorithm 1: open a cluster when the nearest is farther than delta (and room is left).

    Returns (cluster index [B], opened [B] bool).
    """
    opened = (dmin > delta * delta) & (count < m_cap)
    return torch.where(opened, count.long(), j), opened


# ----- leader clustering of a whole prompt ---------------------------------------------------------
GEMM_MIN_COLS = 12  # products with fewer columns take another (small-matrix) path with another rounding
NEAREST_GROUP = 16  # streams per product in ``_nearest_open``


@overload
def _nearest_open(
    x: Tensor, xsq: Tensor, centers: Tensor, csq: Tensor, count: Tensor, index: Literal[False] = False
) -> Tensor: ...
@overload
def _nearest_open(
    x: Tensor, xsq: Tensor, centers: Tensor, csq: Tensor, count: Tensor, index: Literal[True]
) -> tuple[Tensor, Tensor]: ...
def _nearest_open(
    x: Tensor, xsq: Tensor, centers: Tensor, csq: Tensor, count: Tensor, index: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Squared distance of each key of a chunk x [B, c, d] (xsq [B, c]) to the nearest of its stream's
    ``count`` [B] representatives (centers [B, m, d], csq [B, m]; inf for none): [B, c], and with
    ``index`` also the nearest one's index [B, c].

    The streams go in groups of ``NEAREST_GROUP`` with similar counts, one product per group over
    the most representatives of its streams: the same rounding as one product over the most any
    stream has (the unused ones are at infinity), less the padding. While the most is below
    ``GEMM_MIN_COLS`` the single product is kept (another rounding).
    """
    used = max(1, int(count.max()))
    if used < GEMM_MIN_COLS:
        d2 = _sqdist(x, xsq, centers[:, :used], csq[:, :used])
        return d2.min(-1) if index else d2.amin(-1)
    best = x.new_empty(x.shape[:2])
    near = torch.empty(x.shape[:2], dtype=torch.long, device=x.device) if index else None
    ranked, order = torch.sort(count, stable=True)
    for g in range(0, count.numel(), NEAREST_GROUP):
        rows = order[g : g + NEAREST_GROUP]
        m = max(int(ranked[g : g + NEAREST_GROUP][-1]), GEMM_MIN_COLS)
        cg, cgsq = centers[:, :m].index_select(0, rows), csq[:, :m].index_select(0, rows)
        d2 = _sqdist(x.index_select(0, rows), xsq.index_select(0, rows), cg, cgsq)
        if near is not None:
            v, i = d2.min(-1)
            best.index_copy_(0, rows, v)
            near.index_copy_(0, rows, i)
        else:
            best.index_copy_(0, rows, d2.amin(-1))
    return best if near is None else (best, near)


@dataclass
class Clustering:
    """The cluster pass over B streams' prompt keys: assign [B, n], centers [B, m_cap, d], count [B],
    forced [B] (keys that joined a cluster farther than delta because of the cap)."""

    assign: Tensor
    centers: Tensor
    count: Tensor
    forced: Tensor


def cluster_stream(
    keys: Tensor, delta: Tensor, m_cap: int, chunk: int = 256, first: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """UpdateSoftmaxNormalizer's cluster assignment over a whole prompt, for B streams in lockstep.

    Exactly the sequential rule (a key joins the nearest representative opened before it if within
    delta, else opens one; past ``m_cap`` clusters it joins the nearest), computed in chunks of
    tokens: one matrix product gives every key of the chunk its nearest earlier representative,
    then the chunk loops once per representative it opens (the first key of a stream that nothing
    covers opens the next one, visible only to keys from there on). Python loops over opened
    clusters, not over tokens.

    keys [B, n, d], delta [B]; ``first``: the first chunk's ``_pair_dists`` when already made.
    Returns assign [B, n], centers [B, m_cap, d], count [B] and forced [B]: how many keys joined a
    cluster farther than delta because the cap was reached.
    """
    b, n, d = keys.shape
    ksq = (keys * keys).sum(-1)
    centers = keys.new_zeros(b, m_cap, d)
    csq = torch.full((b, m_cap), float("inf"), dtype=keys.dtype, device=keys.device)
    count = torch.zeros(b, dtype=torch.long, device=keys.device)
    assign = torch.empty(b, n, dtype=torch.long, device=keys.device)
    forced = torch.zeros(b, dtype=torch.long, device=keys.device)
    delta2 = (delta * delta).unsqueeze(-1)
    for a in range(0, n, chunk):
        x, xsq = keys[:, a : a + chunk], ksq[:, a : a + chunk]
        best, near = _nearest_open(x, xsq, centers, csq, count, index=True)
        _open_in_chunk(x, xsq, best, near, centers, csq, count, delta2, first if a == 0 else None)
        assign[:, a : a + chunk] = near
        forced += (best > delta2).sum(-1)
    return assign, centers, count, forced


def leader_delta(
    keys: Tensor, m_cap: int, iters: int = 10, chunk: int = 256, cluster: bool = True
) -> tuple[Tensor, Clustering | None]:
    """The smallest radius (to 2^-iters of the keys' diameter bound) at which Algorithm 1's leader
    clustering of each stream opens at most ``m_cap`` clusters: bisection on the prompt.

    keys [B, n, d] float32. Returns delta [B] and the clustering at that delta. Any delta >= the
    diameter gives one cluster, so the upper end always fits; each step counts the clusters of all
    streams in lockstep (``_fits``, which needs no assignments), and the clustering at the radius
    found is made once at the end (``cluster_stream``: the same pass as the accepting step's; None
    without ``cluster``). The first chunk's distances, which every pass needs, are measured once
    (``_pair_dists``). Every distance comes from the same product as in ``cluster_stream`` (the same
    rounding), so the steps, delta and clustering are those of running it in full at every step.
    """
    keys = keys.contiguous()  # (the prompt's keys come as a view)
    hi = 2 * keys.norm(dim=-1).amax(-1) + 1e-6
    lo = torch.zeros_like(hi)
    first = _pair_dists(keys[:, :chunk])
    ksq = (keys * keys).sum(-1)
    for _ in range(iters):
        mid = (lo + hi) / 2
        fits = _fits(keys, ksq, mid, m_cap, chunk, first)
        hi, lo = torch.where(fits, mid, hi), torch.where(fits, lo, mid)
    return hi, Clustering(*cluster_stream(keys, hi, m_cap, chunk, first)) if cluster else None


def _pair_dists(x: Tensor) -> Tensor:
    """Squared distances within a chunk x [B, c, d] as ``_open_in_chunk`` measures them (the product of
    the keys from p on with key p, so the same rounding): [B, c, c], [:, p, i] = |x_i - x_p|^2 for i >= p
    (0 below)."""
    b, c, _ = x.shape
    xsq = (x * x).sum(-1)
    out = x.new_zeros(b, c, c)
    for p in range(c):
        out[:, p, p:] = _sqdist(x[:, p:], xsq[:, p:], x[:, p : p + 1], xsq[:, p : p + 1]).squeeze(-1)
    return out


def _fits(
    keys: Tensor, ksq: Tensor, delta: Tensor, m_cap: int, chunk: int = 256, first: Tensor | None = None
) -> Tensor:
    """Whether leader clustering (``cluster_stream``) of each stream opens at most ``m_cap``
    clusters: keys [B, n, d], their squared norms ksq [B, n], delta [B] -> bool [B]; ``first`` as in
    ``cluster_stream``.

    Only the count matters here, so a key needs only its distance to the nearest representative of
    the earlier chunks: the keys of a chunk that these leave uncovered are its only candidates to
    open one, and its openers are found among them alone (``_open_among``). A stream is decided
    once it opens cluster m_cap + 1; it then leaves the lockstep batch, so the rest of the prompt is
    clustered only for the streams still undecided (a step of the bisection whose radius is too
    small stops early for most streams).
    """
    b, n, d = keys.shape
    cap = m_cap + 1
    live = torch.arange(b, device=keys.device)  # streams still undecided, as rows of the full batch
    rest, rsq, delta2 = keys.contiguous(), ksq, (delta * delta).unsqueeze(-1)  # live streams, from ``start`` on
    start = 0
    centers = keys.new_zeros(b, cap, d)
    csq = torch.full((b, cap), float("inf"), dtype=keys.dtype, device=keys.device)
    count = torch.zeros(b, dtype=torch.long, device=keys.device)
    over = torch.zeros(b, dtype=torch.bool, device=keys.device)
    for a in range(0, n, chunk):
        x, xsq = rest[:, a - start : a - start + chunk], rsq[:, a - start : a - start + chunk]
        if a == 0:  # nothing open yet: every key is a candidate
            _open_among(x, xsq, torch.full_like(xsq, float("inf")), centers, csq, count, delta2, first)
        else:
            best = _nearest_open(x, xsq, centers, csq, count)
            rows = torch.arange(live.numel(), device=keys.device) * rest.shape[1] + (a - start)
            _open_among(x, xsq, best, centers, csq, count, delta2, src=(rest.view(-1, d), rows))
        done = count >= cap
        if 4 * int(done.sum()) >= live.numel():  # drop the decided streams once they are a quarter
            over[live[done]] = True
            keep = ~done
            live, delta2, centers, csq, count = live[keep], delta2[keep], centers[keep], csq[keep], count[keep]
            rest, rsq, start = rest[keep, a + chunk - start :], rsq[keep, a + chunk - start :], a + chunk
            if first is not None:
                first = first[keep]
            if live.numel() == 0:
                break
    over[live[count >= cap]] = True
    return ~over


def _open_among(
    x: Tensor,
    xsq: Tensor,
    best: Tensor,
    centers: Tensor,
    csq: Tensor,
    count: Tensor,
    delta2: Tensor,
    dist: Tensor | None = None,
    src: tuple[Tensor, Tensor] | None = None,
) -> None:
    """The representatives one chunk opens, in order, for the cluster count only; updates centers,
    csq and count in place (past ``centers.shape[1]`` clusters a stream opens none).

    x [B, c, d], xsq [B, c]: the chunk's keys; best [B, c]: squared distance to the nearest
    representative of the earlier chunks; ``dist``: the chunk's ``_pair_dists`` when measured;
    ``src``: the keys as rows [N, d] of a matrix and the row [B] of each stream's first key of the
    chunk (x's rows are gathered from there).
    A key stays uncovered while every representative it sees is farther than delta; the first
    uncovered key of each stream opens the next one. Only keys beyond delta of the earlier
    representatives can open one, so without ``dist`` they are gathered (in order, padded with
    covered keys) and each new representative is measured against them with the same product as
    ``_open_in_chunk`` (the same rounding). Streams with nothing left to open leave the batch once
    they are half of it (at least two streams stay: a batch of one takes another product path).
    """
    b = x.shape[0]
    cap = centers.shape[1]
    free = best > delta2
    if dist is None:
        free &= (count < cap).unsqueeze(-1)
        per = free.sum(-1)
        u = int(per.max())
        if u == 0:
            return
        slot = torch.where(free, free.cumsum(-1) - 1, u)  # the candidates' places, in order; the rest: spare column
        take = torch.zeros(b, u + 1, dtype=torch.long, device=x.device)
        take.scatter_(1, slot, torch.arange(x.shape[1], device=x.device).expand_as(slot))
        take = take[:, :u]
        if src is None:
            x = x[torch.arange(b, device=x.device).unsqueeze(-1), take]
        else:
            x = src[0].index_select(0, (src[1].unsqueeze(-1) + take).view(-1)).view(b, u, -1)
        xsq = torch.gather(xsq, 1, take)
        free = torch.arange(u, device=x.device) < per.unsqueeze(-1)
    keys, ksq = x, xsq
    width = x.shape[1]
    ids, room, lim = torch.arange(b, device=x.device), cap - count, delta2.squeeze(-1)
    opened = torch.zeros_like(room)
    base = ids * width  # each stream's first row in x.view(-1, d)
    # per round: the batch's streams, their first uncovered keys, which opened
    who: list[Tensor] = []
    at: list[Tensor] = []
    did: list[Tensor] = []
    for rnd in itertools.count():
        has, p = torch.max(free, dim=-1)  # the first uncovered key
        has &= opened < room
        lo = int(p.masked_fill(~has, width).min())  # no key before lo sees a new representative
        if lo == width:
            break
        if rnd % 4 == 3 and ids.numel() > 2 and 2 * int(has.sum()) <= ids.numel():
            keep = has.nonzero().squeeze(-1)  # the streams done with this chunk leave the batch
            if keep.numel() == 1:
                keep = torch.cat([keep, (~has).nonzero()[0]])
            ids, free, room, opened, lim, has, p = (
                t.index_select(0, keep) for t in (ids, free, room, opened, lim, has, p)
            )
            if dist is None:
                x, xsq = x.index_select(0, keep), xsq.index_select(0, keep)
                base = torch.arange(ids.numel(), device=x.device) * width
        who.append(ids)
        at.append(p)
        did.append(has)
        cut = lim.masked_fill(~has, -float("inf")).unsqueeze(-1)  # streams without an opener keep their keys
        if dist is not None:
            free &= dist.view(-1, width).index_select(0, ids * width + p) > cut
        else:
            flat = base + p
            c, c_sq = x.view(-1, x.shape[-1]).index_select(0, flat), xsq.view(-1).index_select(0, flat)
            free[:, lo:] &= _sqdist(x[:, lo:], xsq[:, lo:], c.unsqueeze(1), c_sq.unsqueeze(1)).squeeze(-1) > cut
        opened += has
    if who:
        opener = torch.cat(did)
        s, p = torch.cat(who)[opener], torch.cat(at)[opener]
        order = torch.sort(s, stable=True).indices  # by stream, each in order of opening
        s, p = s[order], p[order]
        per = torch.bincount(s, minlength=b)
        slot = count[s] + torch.arange(s.numel(), device=s.device) - (per.cumsum(0) - per)[s]
        centers[s, slot], csq[s, slot] = keys[s, p], ksq[s, p]
        count += per


def _open_in_chunk(
    x: Tensor,
    xsq: Tensor,
    best: Tensor,
    near: Tensor,
    centers: Tensor,
    csq: Tensor,
    count: Tensor,
    delta2: Tensor,
    dist: Tensor | None = None,
) -> None:
    """Open representatives inside one chunk, in order; updates best / near [B, c], centers, csq, count in place.

    x [B, c, d], xsq [B, c]: the chunk's keys; best / near: squared distance to, and index of, the
    nearest representative visible to each key so far; ``dist``: the chunk's ``_pair_dists`` when
    already measured (else each new representative's distances are measured here).
    """
    b, c, _ = x.shape
    m_cap = centers.shape[1]
    rows, tok = torch.arange(b, device=x.device), torch.arange(c, device=x.device)
    while True:
        has, p = torch.max(best > delta2, dim=-1)  # the first key no earlier representative covers
        has &= count < m_cap
        if not bool(has.any()):
            return
        slot = count.clamp_max(m_cap - 1)
        opened = torch.where(has.unsqueeze(-1), x[rows, p], centers[rows, slot])
        centers[rows, slot] = opened
        csq[rows, slot] = torch.where(has, xsq[rows, p], csq[rows, slot])
        p = p.masked_fill_(~has, c)  # streams without a new representative update nothing
        lo = int(p.min())  # no key before lo sees a new representative
        if dist is not None:
            d2 = dist[rows, p.clamp_max(c - 1), lo:]
        else:
            psq = xsq[rows, p.clamp_max(c - 1)].unsqueeze(1)
            d2 = _sqdist(x[:, lo:], xsq[:, lo:], opened.unsqueeze(1), psq).squeeze(-1)
        upd = (d2 < best[:, lo:]) & (tok[lo:] >= p.unsqueeze(-1))
        best[:, lo:] = torch.where(upd, d2, best[:, lo:])
        near[:, lo:] = torch.where(upd, slot.unsqueeze(-1), near[:, lo:])
        count += has
