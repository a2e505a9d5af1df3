"""SubGen / ClusterGen: attention from key clusters and reservoir samples; and its k-center variant.

Zandieh, Han, Mirrokni, Karbasi. "SubGen: Token Generation in Sublinear Time and Memory",
arXiv:2402.06082 (2024); later version "ClusterGen" (same authors, same Algorithm 1).

``subgen`` implements Algorithm 1 (SubGen / CLUSTERGEN: Sublinear Streaming Attention), Sec. 2:

* UpdateSoftmaxNormalizer: each new key joins the nearest cluster representative if it lies within
  ``delta`` (its size ``n_i`` grows and each of the cluster's ``t`` reservoir slots takes the key with
  probability ``1 / n_i``), else it opens a cluster holding ``t`` copies of itself.
* UpdateMatrixProduct: ``s`` slots of (k, v); each slot takes the new pair with probability
  ``||v||^2 / (mu + ||v||^2)``, then ``mu += ||v||^2`` (so each slot is an i.i.d. draw with probability
  proportional to ``||v_i||^2``, Lemma 1 / 2.2).
* QueryStreamAttn: ``z = sum_M mu / (s ||v||^2) exp(<q, k>) v``, ``tau = sum_D n_i / t sum_S exp(<q, k>)``,
  output ``z / tau`` (logits scaled by 1/sqrt(d) as the model does; a common shift cancels in the ratio).

Beside the stream, ``subgen`` holds the first ``sink`` prompt tokens (attention sinks; kvlab's
choice) and a sliding window of the latest tokens (``recent_share`` of the budget's tokens; the
experiments' recent tokens, Sec. 3.2) exactly; a token leaving the window enters Algorithm 1, and
the exact terms join the numerator and the denominator. ``sink=0, recent_share=0`` is Algorithm 1
alone (its attention error on the embedded model is ~2.2 against ~0.6: docs/methods/subgen.md).

Local (sliding-window) layers: Algorithm 1 cannot drop the tokens that leave a window, so it runs
on the global layers only; a local layer holds its latest tokens exactly in a sliding ``DenseLayer``
(its whole window when the budget pays for it beside Algorithm 1, else its own share of the budget;
``SubGen.plan``). Keys use the key head size, values the value head size (they may differ: MLA).

The pass runs over the prompt at compress time and keeps running on every generated token. It is
sequential only in the cluster assignment, which runs over all L x Hkv streams together, in chunks
of tokens, looping once per opened cluster rather than once per token (``kvlab.methods.clustering``: the
same result as the token-by-token rule of ``tests/clustering_reference.py``). Over the prompt the
reservoirs are drawn from the closed form of their coin flips (the same distribution); while
decoding the coins are flipped token by token.

The radius delta. The paper assumes a clusterable stream: m clusters of radius delta, m sublinear in
n, the cluster count never capped. kvlab picks delta per stream (layer, KV head) so that leader
clustering of the prompt opens about ``m_cap`` clusters, ``m_cap`` being what the byte budget pays
for: the smallest such radius, by bisection on the prompt (``leader_delta``: each step only counts
the clusters; the prompt's clustering at the radius found is made once at the end). Deviation, for
the budget: the cluster count is still capped at ``m_cap`` while decoding; once a stream has
``m_cap`` clusters, a far key joins its nearest cluster anyway (the uniform reservoir still
estimates that cluster's sum without bias; only the variance grows). The plan reports the delta,
the clusters opened on the prompt and whether the cap bound (``cap_bound``); ``SubGen.cap_bound()``
counts it while decoding too. Representatives, samples and M are stored in the cache dtype (16-bit
by default).

``subgen-kcenter`` is the form of the experiments (Sec. 3.2 of SubGen, Sec. 4.1 of ClusterGen): keep
the most recent ``l`` tokens plus the ``k`` center tokens (their own keys and values) from one greedy
k-center pass (Gonzalez / Dyer-Frieze) over the remaining prompt keys; budget = l + k tokens.
Generated tokens are kept uncompressed (prefill-only method). The paper does not say how l and k
share the budget: ``recent_ratio`` (default half each).

``subgen-kcenter-w`` is kvlab's variant, not in the paper: a center stands for its whole cluster with
the log-weight ``log(cluster size)`` added to its logit and carries the cluster's mean value. Then
``size * exp(<q, x>) * mean(v)`` approximates ``sum_{i in C} exp(<q, k_i>) v_i`` when the keys of C
lie close to x.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kernels.tensor_ops import gather_tokens, group_queries, ungroup
from kvlab.core import semantics as sm
from kvlab.core.attention_ops import weights_on_positions
from kvlab.core.budgets import per_token_bytes
from kvlab.core.semantics import LayerSemantics, ModelSemantics
from kvlab.methods.base import Compressor
from kvlab.methods.clustering import (
    Clustering,
    cluster_stream,
    greedy_kcenter,
    leader_delta,
    nearest_center,
    open_or_join,
)
from kvlab.methods.dense import DenseCompressor, DenseLayer
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param

PAPER = (
    "Zandieh, Han, Mirrokni, Karbasi, SubGen: Token Generation in Sublinear Time and Memory, "
    "arXiv:2402.06082 (2024); ClusterGen (later version)"
)


# ----- reservoirs ----------------------------------------------------------------------------------
# Over the prompt, each slot's final content is drawn from the closed form of its coin flips: a slot
# that the i-th arrival overwrites with probability p_i ends up holding token i with probability
# p_i * prod_{j > i} (1 - p_j). For p = 1/rank (line 17) that is uniform over the cluster; for
# p = ||v_i||^2 / mu_i (line 26) the product telescopes to ||v_i||^2 / mu_n. Sampling these directly
# gives the reservoirs' exact distribution in O(n) instead of O(n * slots) coin flips. While decoding,
# ``SubGenState.append`` flips the coins one token at a time.
def uniform_reservoirs(assign: Tensor, m_cap: int, t: int, gen: torch.Generator) -> Tensor:
    """t i.i.d. uniform members of each cluster: assign [B, n] -> token indices [B, m_cap, t] (-1: empty)."""
    b, n = assign.shape
    sizes = torch.zeros(b, m_cap, dtype=torch.long, device=assign.device).scatter_add_(
        1, assign, torch.ones_like(assign)
    )
    order = torch.sort(assign, dim=1, stable=True).indices  # members of cluster 0, then 1, ... in arrival order
    start = sizes.cumsum(-1) - sizes
    rank = (torch.rand(b, m_cap, t, generator=gen).to(assign.device) * sizes.unsqueeze(-1)).long()
    pick = torch.gather(order, 1, (start.unsqueeze(-1) + rank).clamp_max(n - 1).flatten(1)).view(b, m_cap, t)
    return pick.masked_fill((sizes == 0).unsqueeze(-1), -1)


def norm_reservoir(values: Tensor, s: int, gen: torch.Generator) -> Tensor:
    """s i.i.d. token indices drawn with probability ||v_i||^2 / sum ||v||^2: values [B, n, d] -> [B, s]."""
    mass = (values * values).sum(-1).cumsum(-1)  # mu after each token
    u = torch.rand(values.shape[0], s, generator=gen).to(values.device) * mass[:, -1:]
    return torch.searchsorted(mass, u, right=True).clamp_max(values.shape[1] - 1)


def _replace(slots: Tensor, coins: Tensor, x: Tensor) -> None:
    """Write x [B, d] into the slots [B, s, d] whose coin [B, s] succeeded (in place)."""
    slots.copy_(torch.where(coins.unsqueeze(-1), x.unsqueeze(1), slots))


def _coins(p: Tensor, slots: int, gen: torch.Generator) -> Tensor:
    """One coin per slot with success probability p [B]: [B, slots] bool."""
    return torch.rand(p.shape[0], slots, generator=gen).to(p.device) < p.unsqueeze(-1)


# ----- the streaming data structure ----------------------------------------------------------------
@dataclass
class SubGenState:
    """Algorithm 1's data structure for L x H independent streams (one per layer and KV head).

    centers [L, H, m_cap, d] (cluster representatives x_i), sizes [L, H, m_cap] int32 (n_i; 0 =
    unused), samples [L, H, m_cap, t, d] (S_i, uniform within cluster), count [L, H] int32 (clusters
    open), delta [L, H] (radius), mk / mv [L, H, s, d] (M: (k, v) drawn proportional to ||v||^2),
    mu [L, H] (sum of ||v||^2).
    """

    centers: Tensor
    sizes: Tensor
    samples: Tensor
    count: Tensor
    delta: Tensor
    mk: Tensor
    mv: Tensor
    mu: Tensor
    cap_joins: Tensor  # [L, H] keys that joined a cluster farther than delta because of the cap (not held)
    assign: list[Tensor] | None = None  # per layer [H, n_seen] int32: each token's cluster (for the maps; not held)
    growable: bool = False  # no cluster cap (Theorem 1): the cluster tensors grow when a stream needs room

    def grow(self, extra: int = 16) -> None:
        """Room for ``extra`` more clusters in every stream (uncapped mode; zeros, count unchanged)."""
        pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], 2)  # noqa: E731
        self.centers, self.sizes, self.samples = pad(self.centers), pad(self.sizes), pad(self.samples)

    @property
    def m_cap(self) -> int:
        return self.centers.shape[2]

    @property
    def t(self) -> int:
        return self.samples.shape[3]

    @property
    def s(self) -> int:
        return self.mk.shape[2]

    @classmethod
    def build(
        cls,
        keys: Tensor,
        values: Tensor,
        delta: Tensor,
        t: int,
        s: int,
        m_cap: int,
        gen: torch.Generator,
        dtype: torch.dtype = torch.float16,
        clustering: Clustering | None = None,
    ) -> SubGenState:
        """Run Algorithm 1 over a prompt: keys, values [L, H, n, d]; delta [L, H]. The kept vectors
        (representatives, cluster samples, M's keys and values) are stored in ``dtype``.
        ``clustering``: the prompt's cluster pass at this delta when already known (``leader_delta``)."""
        n_layers, h, n, d = keys.shape
        dv = values.shape[-1]  # the value head size (differs from d with multi-head latent attention)
        flat_k, flat_v = keys.reshape(-1, n, d).float(), values.reshape(-1, n, dv).float()
        c = clustering or Clustering(*cluster_stream(flat_k, delta.reshape(-1).float(), m_cap))
        assign, centers, count, forced = c.assign, c.centers, c.count, c.forced
        sizes = torch.zeros(assign.shape[0], m_cap, dtype=torch.long).scatter_add_(1, assign, torch.ones_like(assign))
        pick = uniform_reservoirs(assign, m_cap, t, gen)
        samples = gather_tokens(flat_k, pick.clamp_min(0).flatten(1)).view(-1, m_cap, t, d)
        samples = samples * (pick >= 0).unsqueeze(-1)
        mpick = norm_reservoir(flat_v, s, gen)
        mu = (flat_v * flat_v).sum((-1, -2))
        lead = (n_layers, h)
        return cls(
            centers.view(*lead, m_cap, d).to(dtype),
            sizes.to(torch.int32).view(*lead, m_cap),
            samples.view(*lead, m_cap, t, d).to(dtype),
            count.to(torch.int32).view(lead),
            delta.float().clone(),
            gather_tokens(flat_k, mpick).view(*lead, s, d).to(dtype),
            gather_tokens(flat_v, mpick).view(*lead, s, dv).to(dtype),
            mu.view(lead),
            forced.view(lead),
            list(assign.to(torch.int32).view(*lead, n)),
        )

    def append(self, layer: int, k: Tensor, v: Tensor, gen: torch.Generator) -> None:
        """One new token for every head of ``layer``: k, v [H, d] (lines 4-6 of Algorithm 1)."""
        k, v = k.float(), v.float()
        if self.growable and int(self.count[layer].max()) >= self.m_cap:
            self.grow()
        centers, count = self.centers[layer], self.count[layer]
        cf = centers.float()
        unused = torch.arange(self.m_cap, device=k.device) >= count.unsqueeze(-1)
        csq = (cf * cf).sum(-1).masked_fill(unused, float("inf"))
        dmin, near = nearest_center(cf, csq, k)
        j, opened = open_or_join(dmin, near, count, self.delta[layer], self.m_cap)
        self.cap_joins[layer] += ((dmin > self.delta[layer] ** 2) & ~opened).to(self.cap_joins.dtype)
        rows = torch.arange(k.shape[0], device=k.device)
        centers[rows[opened], j[opened]] = k[opened].to(centers.dtype)
        count += opened.to(count.dtype)
        if self.assign is not None:
            self.assign[layer] = torch.cat([self.assign[layer], j.to(torch.int32).unsqueeze(-1)], -1)
        sizes = self.sizes[layer]
        sizes[rows, j] += 1
        cluster = self.samples[layer, rows, j]  # [H, t, d] (a copy: written back below)
        _replace(cluster, _coins(1.0 / sizes[rows, j].float(), self.t, gen), k)
        self.samples[layer, rows, j] = cluster
        vsq = (v * v).sum(-1)
        mu = self.mu[layer]
        p = torch.where(vsq > 0, vsq / (mu + vsq).clamp_min(1e-30), torch.zeros_like(vsq))
        coins = _coins(p, self.s, gen)
        _replace(self.mk[layer], coins, k)
        _replace(self.mv[layer], coins, v)
        mu += vsq

    def attend(
        self,
        layer: int,
        q: Tensor,
        scaling: LayerSemantics | float,
        exact_k: Tensor | None = None,
        exact_v: Tensor | None = None,
    ) -> Tensor:
        """QueryStreamAttn: q [Hq, w, d] -> z / tau [Hq, w, d].

        ``exact_k`` / ``exact_v`` [H, e, d]: tokens held exactly beside the stream (sink and recent
        tokens); their exact terms join both the numerator and the denominator. ``scaling`` a
        ``LayerSemantics``: every score (sampled, exact) soft-capped, the sinks added to tau."""
        sem = sm.as_semantics(scaling, q)
        scaling = sem.scaling
        h = self.centers.shape[1]
        m = max(1, int(self.count[layer].max()))
        qg = group_queries(q.float(), h)  # [H, g*w, d]
        samples = self.samples[layer, :, :m].reshape(h, m * self.t, -1).float()
        size = self.sizes[layer, :, :m].float()
        logw = torch.log(size / self.t).repeat_interleave(self.t, dim=-1)  # -inf for unused clusters
        sampled = sem.cap(torch.matmul(qg, samples.transpose(-1, -2)) * scaling)
        log_tau = sm.with_sinks(torch.logsumexp(sampled + logw.unsqueeze(1), -1), sem, q.shape[0])
        mk, mv, mu = self.mk[layer].float(), self.mv[layer].float(), self.mu[layer]
        vsq = (mv * mv).sum(-1).clamp_min(1e-30)
        logw_m = torch.log(mu.clamp_min(1e-30)).unsqueeze(-1) - math.log(self.s) - torch.log(vsq)
        logits = sem.cap(torch.matmul(qg, mk.transpose(-1, -2)) * scaling) + logw_m.unsqueeze(1)
        if exact_k is None or exact_k.shape[-2] == 0:
            out = torch.matmul(torch.exp(logits - log_tau.unsqueeze(-1)), mv)
        else:
            assert exact_v is not None, "exact_k needs its exact_v"
            le = sem.cap(torch.matmul(qg, exact_k.float().transpose(-1, -2)) * scaling)  # [H, g*w, e]
            shift = torch.maximum(log_tau, le.amax(-1)).unsqueeze(-1)  # a common shift cancels in the ratio
            pe = torch.exp(le - shift)
            num = torch.matmul(torch.exp(logits - shift), mv) + torch.matmul(pe, exact_v.float())
            out = num / (torch.exp(log_tau.unsqueeze(-1) - shift) + pe.sum(-1, keepdim=True))
        return ungroup(out, q.shape[0]).to(q.dtype)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """What is held; cluster tensors up to the largest cluster count of any stream (the padding used)."""
        m = int(self.count.max())
        yield "centers", self.centers[:, :, :m]
        yield "cluster_sizes", self.sizes[:, :, :m]
        yield "cluster_samples", self.samples[:, :, :m]
        yield "cluster_counts", self.count
        yield "delta", self.delta
        yield "sample_keys", self.mk
        yield "sample_values", self.mv
        yield "value_mass", self.mu

    def estimated_weights(
        self, layer: int, q: Tensor, scaling: LayerSemantics | float, exact_k: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The softmax weights QueryStreamAttn's denominator implies: q [Hq, 1, d] -> stream tokens [Hq, n]
        (in stream order) and the exactly held tokens ``exact_k`` [H, e, d] -> [Hq, e] (None without them).

        tau = sum_i n_i / t sum_{S_i} exp(<q, k>) (+ the exact tokens' exp(<q, k>)); a stream token of
        cluster i gets (1 / t) sum_{S_i} exp(<q, k>) / tau, its cluster's mean sampled score (the rows
        sum to 1: the sizes count the tokens assigned).
        """
        sem = sm.as_semantics(scaling, q)
        scaling = sem.scaling
        h, m = self.centers.shape[1], max(1, int(self.count[layer].max()))
        qg = group_queries(q.float(), h)  # [H, g, d]
        samples = self.samples[layer, :, :m].float()  # [H, m, t, d]
        scores = sem.cap(torch.einsum("hgd,hmtd->hgmt", qg, samples) * scaling)
        per_member = torch.logsumexp(scores, -1) - math.log(self.t)  # [H, g, m]
        logw = torch.log(self.sizes[layer, :, :m].float()).unsqueeze(1)  # -inf for unused clusters
        terms = per_member + logw
        le = None
        if exact_k is not None and exact_k.shape[-2]:
            le = sem.cap(torch.matmul(qg, exact_k.float().transpose(-1, -2)) * scaling)  # [H, g, e]
            terms = torch.cat([terms, le], -1)
        log_z = sm.with_sinks(torch.logsumexp(terms, -1, keepdim=True), sem, q.shape[0])
        assert self.assign is not None, "the token-to-cluster assignment is kept by build and append"
        idx = self.assign[layer].long().unsqueeze(1).expand(-1, qg.shape[1], -1)  # [H, g, n]
        w = torch.gather(torch.exp(per_member - log_z), -1, idx)
        we = None if le is None else ungroup(torch.exp(le - log_z), q.shape[0])[:, 0]
        return ungroup(w, q.shape[0])[:, 0], we


@dataclass
class ExactTokens:
    """Tokens ``subgen`` holds exactly beside Algorithm 1: the first ``sink`` prompt tokens and a sliding
    window of the ``recent`` latest tokens (the experiments' recent tokens, Sec. 3.2).

    keys / values [L, H, sink + recent, d]; the window is a ring over slots sink .. sink + recent - 1,
    ``head[layer]`` its oldest slot (attention does not depend on the order of the slots).
    """

    keys: Tensor
    values: Tensor
    sink: int
    head: list[int]

    @classmethod
    def make(cls, keys: Tensor, values: Tensor, sink: int) -> ExactTokens:
        return cls(keys.contiguous(), values.contiguous(), sink, [0] * keys.shape[0])

    @property
    def recent(self) -> int:
        return self.keys.shape[2] - self.sink

    def push(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """A new token k, v [H, d] enters the window; returns the token that leaves it (the new one
        itself when there is no window), which goes on into Algorithm 1's stream."""
        if self.recent == 0:
            return k, v
        slot = self.sink + self.head[layer]
        old_k, old_v = self.keys[layer, :, slot].clone(), self.values[layer, :, slot].clone()
        self.keys[layer, :, slot] = k.to(self.keys.dtype)
        self.values[layer, :, slot] = v.to(self.values.dtype)
        self.head[layer] = (self.head[layer] + 1) % self.recent
        return old_k, old_v


# ----- the compressors -----------------------------------------------------------------------------
@dataclass
class SubGenPlan:
    """Knobs from the budget: t, s, cluster cap, exact sink / recent tokens, per-stream bytes targeted and planned."""

    t: int
    s: int
    m_cap: int
    target_bytes_per_stream: int
    planned_bytes_per_stream: int
    sink: int = 0
    recent: int = 0


def plan_subgen(
    bytes_per_stream: float,
    d: int,
    elem: int,
    t: int,
    s: int | None,
    value_share: float,
    sink: int = 0,
    recent_share: float = 0.0,
    dv: int | None = None,
) -> SubGenPlan:
    """Share a per-stream byte budget between exact tokens (``sink`` + a ``recent_share`` of the budget's
    tokens, a key and a value each), M (s keys and values) and clusters ((1 + t) keys + a size each).
    ``d`` is the key head size, ``dv`` the value head size (None: d).

    Fixed per stream: the cluster counter, delta and mu (4 bytes each).
    """
    fixed = 12
    dv = d if dv is None else dv
    per_token = (d + dv) * elem
    recent = int(recent_share * bytes_per_stream // per_token)
    exact = min(sink + recent, max(0, int((bytes_per_stream - fixed) // per_token) - 2))  # leave room for M
    sink = min(sink, exact)
    recent = exact - sink
    room = max(0.0, bytes_per_stream - fixed - exact * per_token)
    if s is None:
        s = max(1, int(value_share * room // per_token))
    per_cluster = (1 + t) * d * elem + 4
    m_cap = max(1, int((room - per_token * s) // per_cluster))
    planned = fixed + exact * per_token + per_token * s + m_cap * per_cluster
    return SubGenPlan(t, s, m_cap, int(bytes_per_stream), planned, sink, recent)


class SubGen(Compressor):
    name = "subgen"
    title = "SubGen (streaming, Algorithm 1)"
    group = "paper"
    paper = PAPER
    summary = (
        "Clusters keys online (radius delta) with t uniform samples per cluster for the softmax "
        "denominator and s (k, v) samples drawn proportional to ||v||^2 for the numerator; streams while decoding."
    )
    streaming = True
    summarizes = True  # tokens outside the exact sink and window stand in the clusters and samples
    params = (
        Param(
            "delta",
            None,
            "cluster radius delta (None: per stream, the smallest radius at which leader clustering of the "
            "prompt opens at most m_cap clusters, found by bisection, times delta_scale)",
            minimum=0.0,
            kind=float,
        ),
        Param("t", 4, "uniform reservoir samples per cluster (softmax denominator)", minimum=1),
        Param(
            "s",
            None,
            "(k, v) samples drawn proportional to ||v||^2 (numerator); None: from the budget",
            minimum=1,
            kind=int,
        ),
        Param(
            "value_share",
            0.5,
            "share of the budget given to the s (k, v) samples when s is not set",
            minimum=0.0,
            maximum=1.0,
        ),
        Param("delta_scale", 1.0, "multiplies the automatic delta", minimum=0.0),
        Param("sink", 4, "first prompt tokens held exactly, outside the stream (not in Algorithm 1)", minimum=0),
        Param(
            "max_clusters",
            "budget",
            "the cluster cap: what the budget pays for, or none (Theorem 1: a fixed delta, as many clusters "
            "as the keys need, m growing with n; bytes are measured, not planned)",
            choices=("budget", "none"),
        ),
        Param(
            "recent_share",
            0.25,
            "share of the budget's tokens held exactly as a sliding window of the latest tokens (the "
            "experiments' recent tokens, Sec. 3.2); tokens leaving it enter Algorithm 1",
            minimum=0.0,
            maximum=1.0,
        ),
    )

    sem: ModelSemantics  # (``ModelInfo`` always fills its semantics)
    # set by ``plan``
    full: bool
    local_layers: list[int]  # sliding-window layers: an exact sliding store each
    global_layers: list[int]  # Algorithm 1's layers
    local_window: dict[int, int]  # a local layer's window (or chunk)
    local_cap: dict[int, int]  # tokens a local layer holds
    sg_plan: SubGenPlan | None  # Algorithm 1's knobs per global stream (None: no global layer)
    knobs: dict[str, Any]
    # set by ``compress``
    local: dict[int, DenseLayer]  # the local layers' sliding stores
    dense: dict[int, DenseLayer]  # the global layers' exact stores when the budget is full
    slot: dict[int, int]  # a global layer's index among Algorithm 1's streams
    state: SubGenState | None  # Algorithm 1 over the global layers (None: no global layer)
    exact: ExactTokens  # sink and recent tokens held exactly beside it
    clusters: float  # mean clusters per stream after the prompt

    def plan(self, n_prompt: int) -> dict:
        """Local (sliding-window) layers hold their latest tokens exactly in a sliding dense store: the
        whole window when the budget pays for it beside Algorithm 1 on the global layers, else each
        its own share of the budget (``_local_caps``); Algorithm 1 gets the rest, per global stream."""
        self.full = self.is_full
        self.local_window = {i: s.span for i, s in enumerate(self.sem.layers) if s.span is not None}
        self.local_layers = list(self.local_window)
        self.global_layers = [i for i, s in enumerate(self.sem.layers) if not s.is_local]
        if self.full:
            self.local_cap = self._local_caps(n_prompt, whole=True)
            return {"compressed": False}
        assert self.budget is not None  # no budget is a full one (returned above)
        target = self.budget.target_bytes(self.info, n_prompt)
        for whole in (True, False) if self.local_layers else (True,):  # a plan that does not fit is refused
            self.local_cap = self._local_caps(n_prompt, whole)
            if self._plan_global(target - self._local_bytes(n_prompt)):
                break
        knobs: dict[str, Any] = {}
        if self.local_layers:
            knobs = {"local_tokens": max(self.local_cap.values()), "local_whole_window": whole}
        if self.global_layers:
            p = self._planned
            knobs.update(t=p.t, s=p.s, m_cap=p.m_cap, planned_bytes_per_stream=p.planned_bytes_per_stream)
            knobs.update(sink=p.sink, recent=p.recent)
        self.knobs = knobs
        return self.knobs  # compress adds what the prompt's clustering found (delta, clusters, cap bound)

    def _local_caps(self, n_prompt: int, whole: bool) -> dict[int, int]:
        """Tokens each local layer holds: its window (``whole``), else its share of the budget,
        ``fraction x min(n_prompt, window)`` (at least 1): the latest ones in both cases."""
        if whole:
            return dict(self.local_window)
        assert self.budget is not None  # a share of the budget: planned under one only
        f = self.budget.fraction_of(n_prompt)
        return {i: max(1, int(f * min(n_prompt, w))) for i, w in self.local_window.items()}

    def _local_bytes(self, n_prompt: int) -> int:
        """Bytes the local layers' sliding stores hold at most over the plan's horizon."""
        seen = n_prompt + self.horizon(n_prompt)
        tokens = sum(min(cap, seen) for cap in self.local_cap.values())
        return self.info.n_kv_heads * tokens * per_token_bytes(self.info)

    def _plan_global(self, rest: float) -> bool:
        """Plan Algorithm 1 on the global layers with ``rest`` bytes (``self.sg_plan``); True if it fits."""
        if not self.global_layers:
            self.sg_plan = None
            return rest >= 0
        info, cfg = self.info, self.cfg
        per_stream = rest / (len(self.global_layers) * info.n_kv_heads)
        t0 = cfg["t"]  # not given and too large for the budget: fewer cluster samples (down to 1)
        for t in [t0] + ([x for x in (2, 1) if x < t0] if "t" not in self.params_given else []):
            self.sg_plan = plan_subgen(
                max(0.0, per_stream),
                info.head_dim,
                info.dtype_bytes,
                t,
                cfg["s"],
                cfg["value_share"],
                cfg["sink"],
                cfg["recent_share"],
                dv=info.v_head_dim,
            )
            if self.sg_plan.planned_bytes_per_stream <= per_stream:
                return True
        return False

    @property
    def _planned(self) -> SubGenPlan:
        """Algorithm 1's knobs per global stream (``plan`` on a model with global layers)."""
        assert self.sg_plan is not None, "Algorithm 1 is planned on global layers only"
        return self.sg_plan

    @property
    def _stream(self) -> SubGenState:
        """Algorithm 1's streams (``compress`` under a budget, on a model with global layers)."""
        assert self.state is not None, "Algorithm 1 runs on global layers only, under a budget"
        return self.state

    @property
    def uncapped(self) -> bool:
        return self.cfg["max_clusters"] == "none"

    def budget_ratio(self, n_prompt: int) -> float | None:
        """Held bytes never exceed the plan's (the clusters are capped; the local stores hold at most
        their caps); the allowance only grows. Uncapped (Theorem 1's regime), the bytes follow the
        keys' clusterability: not predicted."""
        if self.uncapped and self.global_layers:
            return None
        planned = self._local_bytes(n_prompt)
        if self.global_layers:
            planned += len(self.global_layers) * self.info.n_kv_heads * self._planned.planned_bytes_per_stream
        return planned / max(1.0, self.allowed(n_prompt, 0))

    def compress(self, state: PrefillState) -> None:
        n = state.n_tokens
        self.seen = [n] * self.info.n_layers  # tokens each layer has been given (for ``kept_positions``)
        self.local = {i: self._sliding(state, i) for i in self.local_layers}
        gl = self.global_layers
        self.slot = {layer: j for j, layer in enumerate(gl)}  # a global layer's index in Algorithm 1's streams
        if self.full:
            self.dense = {
                i: DenseLayer.make(
                    self.as_cached(state.keys[i]),
                    self.as_cached(state.values[i]),
                    torch.arange(n).expand(state.keys.shape[1], -1),
                )
                for i in gl
            }
            return
        self.state = None
        if not gl:
            return
        p = self._planned
        sink = min(p.sink, n - 1)
        recent = min(p.recent, n - 1 - sink)  # at least one token goes through Algorithm 1
        stream = slice(sink, n - recent)
        all_keys, all_values = state.keys[gl], state.values[gl]  # [Lg, H, n, d], [Lg, H, n, dv]
        keys, values = all_keys[:, :, stream], all_values[:, :, stream]
        m_cap = p.m_cap
        clustering: Clustering | None  # the prompt's cluster pass when the radius search made it
        if self.uncapped:  # Theorem 1: a fixed delta, as many clusters as the keys need
            delta, clustering, m_cap = self._uncapped_clusters(keys)
        else:
            delta, clustering = self._delta(keys, m_cap)
        self.state = SubGenState.build(
            keys, values, delta, p.t, p.s, m_cap, self.generator, self.cache_dtype, clustering
        )
        self.state.growable = self.uncapped
        held = torch.cat([torch.arange(sink), torch.arange(n - recent, n)])
        self.exact = ExactTokens.make(
            self.as_cached(all_keys[:, :, held]), self.as_cached(all_values[:, :, held]), sink
        )
        self.clusters = self.state.count.float().mean().item()
        bound = self.state.cap_joins > 0
        self.knobs.update(
            delta_mean=round(float(delta.mean()), 4),
            clusters_mean=round(self.clusters, 2),
            clusters_max=int(self.state.count.max()),
            cap_bound=bool(bound.any()),  # some stream reached m_cap and put a far key in a near cluster
            cap_bound_streams=round(float(bound.float().mean()), 4),
        )

    def _sliding(self, state: PrefillState, layer: int) -> DenseLayer:
        """A local layer's sliding store: its latest ``local_cap`` prompt tokens, exactly."""
        n = state.n_tokens
        first = max(0, n - self.local_cap[layer])
        pos = torch.arange(first, n).expand(state.keys.shape[1], -1)
        k, v = state.keys[layer][:, first:], state.values[layer][:, first:]
        return DenseLayer.make(self.as_cached(k), self.as_cached(v), pos)

    def _uncapped_clusters(self, keys: Tensor) -> tuple[Tensor, Clustering, int]:
        """delta [L, H] (the given one; without one, the automatic radius at the budget's cap), the
        prompt's leader clustering with no cap, and the cluster room to allocate (the most any
        stream opened, plus room to grow)."""
        n_layers, h, n, d = keys.shape
        if self.cfg["delta"] is None:
            delta, _ = self._delta(keys, self._planned.m_cap)
        else:
            delta = torch.full((n_layers, h), float(self.cfg["delta"]))
        assign, centers, count, forced = cluster_stream(keys.reshape(-1, n, d).float(), delta.reshape(-1).float(), n)
        m_cap = int(count.max()) + 16
        room = centers.new_zeros(centers.shape[0], m_cap, d)
        room[:, : min(n, m_cap)] = centers[:, :m_cap]
        return delta, Clustering(assign, room, count, forced), m_cap

    def _delta(self, keys: Tensor, m_cap: int) -> tuple[Tensor, Clustering | None]:
        """delta [L, H]: the given one, or per stream the smallest radius at which leader clustering
        of the prompt keys opens at most ``m_cap`` clusters (``leader_delta``), times ``delta_scale``;
        and the prompt's clustering at that delta when the search already made it (else None)."""
        if self.cfg["delta"] is not None:
            return torch.full(keys.shape[:2], float(self.cfg["delta"])), None
        n_layers, h, n, d = keys.shape
        scale = self.cfg["delta_scale"]
        radius, clustering = leader_delta(keys.reshape(n_layers * h, n, d).float(), m_cap, cluster=scale == 1.0)
        return (radius * scale).view(n_layers, h), clustering

    def cap_bound(self) -> dict:
        """How often the cluster cap bound so far (prompt and decoding): keys that joined a cluster
        farther than delta because their stream already had ``m_cap`` clusters."""
        if self.state is None:  # no global layer: no stream
            return {"cap_bound_keys": 0, "cap_bound_streams": 0.0}
        joins = self.state.cap_joins
        return {"cap_bound_keys": int(joins.sum()), "cap_bound_streams": round(float((joins > 0).float().mean()), 4)}

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        self.seen[layer] = pos + k.shape[-2]
        if layer in self.local:  # the sliding store drops the token that leaves it
            cache = self.local[layer]
            cache.append(k, v, pos)
            newest = pos + k.shape[-2] - 1  # a chunked layer's new chunk leaves the old one's tokens unseen
            cap = min(self.local_cap[layer], newest - self.sem[layer].visible_from(newest) + 1)
            if cache.n > cap:
                cache.keep(torch.arange(cache.n - cap, cache.n).expand(k.shape[0], -1))
        elif self.full:
            self.dense[layer].append(k, v, pos)
        else:
            j = self.slot[layer]
            self._stream.append(j, *self.exact.push(j, k[:, 0], v[:, 0]), self.generator)

    def _dense(self, layer: int) -> DenseLayer | None:
        """The dense store of ``layer``: a local layer's sliding store, or any layer's when full."""
        if layer in self.local:
            return self.local[layer]
        return self.dense[layer] if self.full else None

    def attend(self, layer: int, q: Tensor) -> Tensor:
        dense = self._dense(layer)
        if dense is not None:  # a local store holds only tokens inside the window
            k, v, _, _ = dense.views()
            return sm.attend(q, k, v, self.sem[layer])
        j = self.slot[layer]
        return self._stream.attend(j, q, self.sem[layer], self.exact.keys[j], self.exact.values[j])

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        stores = list(self.local.values()) + (list(self.dense.values()) if self.full else [])
        for store in stores:  # positions are implicit (the latest tokens)
            yield from ((kind, t) for kind, t in store.tensors() if kind != "positions")
        if not self.full and self.state is not None:
            yield from self.state.tensors()
            yield "keys", self.exact.keys
            yield "values", self.exact.values

    def kept_positions(self, layer: int) -> Tensor | None:
        """[Hkv, m] positions held exactly: a dense store's, else the first ``sink`` and the ``recent`` latest
        (the other tokens stand in Algorithm 1's clusters and samples, not at positions)."""
        dense = self._dense(layer)
        if dense is not None:
            return dense.positions()
        if self.state is None:
            return None
        n, sink, recent = self.seen[layer], self.exact.sink, self.exact.recent
        pos = torch.cat([torch.arange(min(sink, n)), torch.arange(max(sink, n - recent), n)]).to(torch.int32)
        return pos.expand(self.info.n_kv_heads, -1)

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """Each token weighted by its cluster's sampled scores (``SubGenState.estimated_weights``); on
        a dense store, the exact softmax at the held positions."""
        dense = self._dense(layer)
        if dense is not None:
            k, _, pos, _ = dense.views()
            return weights_on_positions(q, k, pos, self.sem[layer])
        ex, j = self.exact, self.slot[layer]
        stream, held = self._stream.estimated_weights(j, q, self.sem[layer], ex.keys[j])
        if held is None:
            return stream
        window = torch.roll(held[:, ex.sink :], -ex.head[j], dims=-1)  # ring slots -> oldest first
        return torch.cat([held[:, : ex.sink], stream, window], -1)  # by position: sinks, stream, window


class SubGenKCenter(DenseCompressor):
    """The experiments' form (SubGen Sec. 3.2, ClusterGen Sec. 4.1): recent tokens plus k center tokens."""

    name = "subgen-kcenter"
    title = "SubGen k-center (recent + centers)"
    group = "paper"
    paper = PAPER
    summary = (
        "Keeps the most recent l tokens plus the k center tokens of a greedy k-center pass over the rest "
        "(the papers' experiments); generated tokens kept."
    )
    params = (
        Param(
            "recent_ratio",
            0.5,
            "share of the budget's tokens kept as the recent window l (k = budget - l)",
            minimum=0.0,
            maximum=1.0,
        ),
        Param(
            "value",
            "center",
            "a center's value: its own (paper) or its cluster's mean value",
            choices=("center", "mean"),
        ),
        Param("weighted", False, "add log(cluster size) to a center's logit (not in the paper)"),
    )

    full: bool  # set by plan: no budget, nothing compressed

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        cap = self.tokens_for_budget(n_prompt, with_logw=self.cfg["weighted"])
        self.recent = min(cap, int(round(self.cfg["recent_ratio"] * cap)))
        self.k = cap - self.recent
        return {"l": self.recent, "k": self.k}

    def planned_tokens(self, n_prompt: int) -> int:
        return min(n_prompt, self.recent + self.k)

    def planned_logw(self) -> bool:
        return bool(self.cfg["weighted"])

    def select(self, state: PrefillState):  # compress is overridden; kept for the contract
        return [None] * state.keys.shape[0]

    def compress_tokens(self, state: PrefillState) -> None:
        n = state.n_tokens
        if self.full or self.recent + self.k >= n:
            return super().compress_tokens(state)
        n_layers, h = state.keys.shape[:2]
        weighted = bool(self.cfg["weighted"])
        shares = self.spread_over_layers(n, [self.recent + self.k] * n_layers)  # local layers' surplus to the others
        firsts = [max(sem.visible_from(n - 1), n - share) for sem, share in zip(self.sem.layers, shares)]
        local = [sem.is_local and first > 0 for sem, first in zip(self.sem.layers, firsts)]
        self.layers = [None] * n_layers  # type: ignore[list-item]  # every layer is set below
        self.n_prompt, self.local_held, self.local_reserve = n, {}, {}
        for share in sorted({c for c, loc in zip(shares, local) if not loc}):  # the layers of one share at once
            idx = [i for i, c in enumerate(shares) if c == share and not local[i]]
            if share >= n:
                ks, vs = state.keys[idx], state.values[idx]
                pos = torch.arange(n).expand(len(idx), h, n)
                logw = torch.zeros(pos.shape)
            else:
                ks, vs, pos, logw = kcenter_compress(
                    state.keys[idx], state.values[idx], self.recent, share - self.recent, self.cfg["value"]
                )
            for j, i in enumerate(idx):
                lw = logw[j] if weighted else None
                self.layers[i] = DenseLayer.make(self.as_cached(ks[j]), self.as_cached(vs[j]), pos[j], lw)
        for i, first in enumerate(firsts):  # a local layer: its newest tokens, as many as its share pays for
            if local[i]:
                self.layers[i] = DenseLayer.make(
                    self.as_cached(state.keys[i, :, first:]),
                    self.as_cached(state.values[i, :, first:]),
                    torch.arange(first, n).expand(h, -1),
                    torch.zeros(h, n - first) if weighted else None,
                )
                self.hold_as_compressed(i, n - first, shares[i])


class SubGenKCenterWeighted(SubGenKCenter):
    """kvlab's variant: each center stands for its cluster (log-size weight, the cluster's mean value)."""

    name = "subgen-kcenter-w"
    title = "SubGen k-center, weighted (kvlab variant)"
    group = "baseline"
    summarizes = True  # each center stands for its cluster
    summary = (
        "kvlab's variant of SubGen k-center: each center carries log(cluster size) on its logit and its "
        "cluster's mean value; recent tokens kept; generated tokens kept."
    )
    params = (
        SubGenKCenter.params[0],
        Param("value", "mean", "a center's value: its cluster's mean value or its own", choices=("mean", "center")),
        Param("weighted", True, "add log(cluster size) to a center's logit"),
    )


def kcenter_compress(
    keys: Tensor, values: Tensor, recent: int, k: int, value: str = "mean"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Recent window + greedy k-center centers, all layers and heads at once.

    keys, values [L, H, n, d]. Returns keys, values [L, H, k + recent, d], positions [L, H, k + recent]
    and log-weights [L, H, k + recent] (log cluster size for centers, 0 for recent tokens). Every
    cluster holds at least its center (``greedy_kcenter``), so sizes are >= 1 and nothing divides by 0.
    """
    n_layers, h, n, d = keys.shape
    old = n - recent
    xk = keys[:, :, :old].reshape(-1, old, d).float()
    kc = greedy_kcenter(xk, k)
    kk = kc.centers.shape[1]
    size = torch.zeros(xk.shape[0], kk).scatter_add_(1, kc.assign, torch.ones_like(kc.assign, dtype=torch.float))
    dv = values.shape[-1]  # the value head size (multi-head latent attention: not the key's)
    if value == "mean":
        xv = values[:, :, :old].reshape(-1, old, dv).float()
        sums = torch.zeros(xv.shape[0], kk, dv).scatter_add_(1, kc.assign.unsqueeze(-1).expand(-1, -1, dv), xv)
        cv = sums / size.clamp_min(1).unsqueeze(-1)
    else:
        cv = gather_tokens(values[:, :, :old].reshape(-1, old, dv), kc.centers)
    ck = gather_tokens(xk, kc.centers)
    lead = (n_layers, h)
    rpos = torch.arange(old, n).expand(*lead, recent)
    out_k = torch.cat([ck.view(*lead, kk, d).to(keys.dtype), keys[:, :, old:]], 2)
    out_v = torch.cat([cv.view(*lead, kk, dv).to(values.dtype), values[:, :, old:]], 2)
    pos = torch.cat([kc.centers.view(*lead, kk), rpos], 2)
    logw = torch.cat([size.clamp_min(1).log().view(*lead, kk), torch.zeros(*lead, recent)], 2)
    return out_k, out_v, pos, logw
