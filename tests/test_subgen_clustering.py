"""SubGen's clustering (``kvlab.methods.clustering``), batched over streams, against the sequential rules it
computes (``tests/clustering_reference.py``): the same clusters, centers and radii, token for token."""

import clustering_reference as ref
import pytest
import torch

from kvlab.methods import clustering
from kvlab.methods.clustering import cluster_stream, greedy_kcenter, leader_delta
from kvlab.methods.subgen import SubGenState


def test_cluster_pass_matches_token_by_token_rule():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 300, 8, generator=g, dtype=torch.float64)
    delta = torch.tensor([2.0, 3.0, 3.5, 4.0, 5.0, 3.0], dtype=torch.float64)
    assign, centers, count, forced = cluster_stream(keys, delta, 40, chunk=64)  # chunks, as on long prompts
    for b in range(6):
        want, reps = ref.leader_clusters(keys[b], float(delta[b]), 40)
        assert torch.equal(assign[b], want)
        assert torch.equal(centers[b, : int(count[b])], reps)  # every representative is its cluster's first key
    assert torch.equal(cluster_stream(keys, delta, 40, chunk=300)[0], assign)
    assert count.tolist()[0] == 40 and count.tolist()[4] < 10  # the cap binds for small delta only
    far = (keys - torch.gather(centers, 1, assign.unsqueeze(-1).expand_as(keys))).norm(dim=-1) > delta.unsqueeze(-1)
    assert torch.equal(forced, far.sum(-1)) and forced[0] > 0 and forced[4] == 0  # keys the cap forced in


def test_leader_delta_is_the_bisection_of_the_sequential_count():
    """20 streams of different spread, in chunks of 32 tokens: the bisection steps decide each stream
    as the sequential count would (streams leave the batch once decided; more than ``GEMM_MIN_COLS``
    clusters and ``NEAREST_GROUP`` streams, so the grouped products run), and the clustering returned
    at the radius found is the sequential one."""
    g = torch.Generator().manual_seed(1)
    scale = torch.linspace(0.5, 2.0, 20, dtype=torch.float64).view(-1, 1, 1)
    keys = scale * torch.randn(20, 160, 8, generator=g, dtype=torch.float64)
    delta, c = leader_delta(keys, 16, chunk=32)
    assert c is not None and int(c.count.max()) > clustering.GEMM_MIN_COLS
    for b in range(20):
        assert torch.equal(delta[b], ref.leader_delta(keys[b], 16))
        want, reps = ref.leader_clusters(keys[b], float(delta[b]), 16)
        assert torch.equal(c.assign[b], want) and int(c.count[b]) == reps.shape[0] <= 16
    assert int(c.forced.sum()) == 0  # at the radius found the cap never binds
    assert leader_delta(keys, 16, chunk=32, cluster=False)[1] is None


@pytest.mark.parametrize("group_bytes", [None, 2 * 200 * 8 * 8])  # all streams in one pass, or two at a time
def test_greedy_kcenter_matches_farthest_point_rule(monkeypatch, group_bytes):
    if group_bytes is not None:
        monkeypatch.setattr(clustering, "KCENTER_BYTES", group_bytes)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 200, 8, generator=g, dtype=torch.float64)
    kc = greedy_kcenter(x, 10)
    for b in range(5):
        centers, assign, radius = ref.greedy_kcenter(x[b], 10)
        assert torch.equal(kc.centers[b], centers) and torch.equal(kc.assign[b], assign)
        torch.testing.assert_close(kc.radius[b], radius)


@pytest.mark.parametrize("growable", [False, True])
def test_decoding_continues_the_sequential_rule(growable):
    """Algorithm 1 over an 80-token prompt, then 160 tokens one at a time (``nearest_center`` and
    ``open_or_join``, the decode step): every token's cluster is the sequential rule's over all 240.
    Capped at 12 clusters (far keys join their nearest, counted in ``cap_joins``), or uncapped with
    room that grows (Theorem 1's regime)."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 4, 240, 8, generator=g)
    values = torch.randn(1, 4, 240, 8, generator=g)
    delta = torch.tensor([[2.0, 2.5, 3.0, 3.5]])
    m_cap = 80 if growable else 12
    gen = torch.Generator().manual_seed(0)
    st = SubGenState.build(keys[:, :, :80], values[:, :, :80], delta, 2, 2, m_cap, gen, torch.float32)
    st.growable = growable
    for i in range(80, 240):
        st.append(0, keys[0, :, i], values[0, :, i], gen)
    assert st.assign is not None
    for h in range(4):
        want, reps = ref.leader_clusters(keys[0, h], float(delta[0, h]), 240 if growable else 12)
        assert torch.equal(st.assign[0][h].long(), want) and int(st.count[0, h]) == reps.shape[0]
        far = (keys[0, h] - reps[want]).norm(dim=-1) > delta[0, h]
        assert int(st.cap_joins[0, h]) == int(far.sum())  # keys the cap put in a far cluster, prompt and decode
    assert (st.m_cap > 80 and int(st.count.max()) > 80) if growable else bool((st.cap_joins > 0).all())
