"""The padded dense attention of the decode-step A/B (``bench/padded_dense.py``) against the per-row path.

Every registered method is in one batch, at budgets that give rows of different cache lengths;
the per-row path (``comp.attend`` row by row) is the reference.
"""

import copy

import pytest
import torch

from bench.padded_dense import DenseRows, attend_padded, batched_dense_attention, length_buckets
from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget
from kvlab.engine.planning import make_compressors
from kvlab.engine.prefill import prefill_for
from kvlab.engine.specs import RunSpec
from kvlab.methods import names
from kvlab.methods.scored import ScoredEvictionCompressor

# every method at 0.25 (its own default for exact), plus rows of other cache lengths
SPECS = [RunSpec(m, None if m == "exact" else Budget.parse("0.25")) for m in names()] + [
    RunSpec("h2o", Budget.parse("0.5")),
    RunSpec("scissorhands", Budget.parse("1.0")),
    RunSpec("streaming", Budget.parse("0.1")),
    RunSpec("kivi", Budget.parse("1.0")),
    RunSpec("streaming+qjl", Budget.parse("0.5")),
]


def test_padded_batch_equals_dense_attention_per_row():
    """Rows of lengths 7, 30 and 1, with and without log-weights, in one call."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 6, 2, 16
    segs = []
    for n, weighted in ((7, True), (30, False), (1, True)):
        k, v = torch.randn(hkv, n, d, generator=g).half(), torch.randn(hkv, n, d, generator=g).half()
        segs.append((k, v, torch.rand(hkv, n, generator=g) if weighted else None))
    q = torch.randn(3, hq, 1, d, generator=g)
    out, probs = batched_dense_attention(q, segs, d**-0.5)
    for i, (k, v, lw) in enumerate(segs):
        ref, ref_p = sm.attend(q[i], k, v, d**-0.5, lw, return_probs=True)
        n = k.shape[-2]
        torch.testing.assert_close(out[i], ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(probs[i, ..., :n], ref_p, atol=1e-7, rtol=1e-5)
        assert (probs[i, ..., n:] == 0).all()


@pytest.fixture(scope="module")
def compressed(engine, lm, long_text):
    """Every spec compressed from one real ~280-token prefill: (engine, compressors)."""
    ids = lm.encode(long_text[:1200])
    comps, _ = make_compressors(engine.info, SPECS, len(ids), 0, 8)
    state, _, _ = prefill_for(engine.lm, ids, comps)
    for c in comps:
        c.compress(state)
    return comps


def test_one_layer_equals_per_row(compressed, lm):
    """Each layer, after one append: the same outputs as ``comp.attend`` row by row, the same scores."""
    info = lm.info
    batched, per_row = copy.deepcopy(compressed), copy.deepcopy(compressed)
    dense = DenseRows.collect(batched, 0)
    assert len(dense.rows) >= 14  # the dense methods and compositions, at least
    lengths = [seg[0].shape[-2] for seg in dense.segments]
    assert any(len({lengths[j] for j in b}) >= 3 for b in length_buckets(lengths))  # calls padding rows
    g = torch.Generator().manual_seed(1)
    pos = compressed[0].layers[0].n  # the exact row holds every prompt token
    for layer in range(info.n_layers):
        q = torch.randn(len(SPECS), info.n_heads, 1, info.head_dim, generator=g)
        k, v = (torch.randn(info.n_kv_heads, 1, info.head_dim, generator=g) for _ in range(2))
        for comp in batched + per_row:  # the contract: the new token first, then its query (evictions run here)
            comp.append(layer, k, v, pos)
        got = attend_padded(batched, layer, q)
        for row, comp in enumerate(per_row):
            torch.testing.assert_close(got[row], comp.attend(layer, q[row]), atol=2e-5, rtol=1e-4)
    scored = [(a, b) for a, b in zip(batched, per_row) if isinstance(a, ScoredEvictionCompressor) and a.scores]
    assert len(scored) >= 4  # h2o, scissorhands and their compositions fed this step's attention
    for a, b in scored:
        for sa, sb in zip(a.scores, b.scores, strict=True):
            torch.testing.assert_close(sa, sb, atol=1e-5, rtol=1e-5)


def test_length_buckets_bound_the_padding():
    assert length_buckets([400, 1900, 420, 380, 1800]) == [[1, 4, 2], [0, 3]]  # 5700 <= 1.5 x 4120 tokens
    assert length_buckets([5, 5, 5]) == [[0, 1, 2]]
    assert length_buckets([100, 10], max_padding=10.0) == [[0, 1]]
    for lengths in ([1, 2, 3, 50, 70, 1000, 999, 2], [7]):
        buckets = length_buckets(lengths)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
        for b in buckets:
            assert len(b) * max(lengths[i] for i in b) <= 1.5 * sum(lengths[i] for i in b)
