"""The batched lockstep attention (one call per layer for the dense rows) against the per-row path.

Every registered method is in one batch, at budgets that give rows of different cache lengths;
the per-row path (``comp.attend`` row by row) is the reference.
"""

import copy

import pytest
import torch

from kvlab.attention import LockstepDecode
from kvlab.batched_attention import DenseRows, attend_rows, batched_dense_attention, length_buckets
from kvlab.budgets import Budget
from kvlab.compressors import names
from kvlab.compressors.composed import ComposedStore
from kvlab.compressors.dense import DenseCompressor
from kvlab.compressors.scored import ScoredEvictionCompressor
from kvlab.compressors.subgen import SubGen
from kvlab.ops import dense_attention
from kvlab.probe import Probe
from kvlab.specs import GenerationSettings, RunSpec

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
        ref, ref_p = dense_attention(q[i], k, v, d**-0.5, lw, return_probs=True)
        n = k.shape[-2]
        torch.testing.assert_close(out[i], ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(probs[i, ..., :n], ref_p, atol=1e-7, rtol=1e-5)
        assert (probs[i, ..., n:] == 0).all()


@pytest.fixture(scope="module")
def compressed(engine, lm, long_text):
    """Every spec compressed from one real ~280-token prefill: (engine, compressors)."""
    ids = lm.encode(long_text[:1200])
    comps, _ = engine._make_compressors(SPECS, len(ids), 0, 8)
    state, _ = engine.prefill(ids, max(c.query_window() for c in comps), any(c.needs_acc_attn for c in comps))
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
        got = attend_rows(batched, layer, q)
        for row, comp in enumerate(per_row):
            torch.testing.assert_close(got[row], comp.attend(layer, q[row]), atol=2e-5, rtol=1e-4)
    scored = [(a, b) for a, b in zip(batched, per_row) if isinstance(a, ScoredEvictionCompressor) and a.scores]
    assert len(scored) >= 4  # h2o, scissorhands and their compositions fed this step's attention
    for a, b in scored:
        for sa, sb in zip(a.scores, b.scores, strict=True):
            torch.testing.assert_close(sa, sb, atol=1e-5, rtol=1e-5)


class Recorder(Probe):
    """Records every row's attention output (through the observers) and every cache's kept positions."""

    attends = True

    def __init__(self):
        self.outs, self.kept = [], []

    def on_prefill(self, state, logits, comps):
        self.comps = comps

    def on_attend(self, layer, row, q, out):
        self.outs.append((layer, row, out.clone()))

    def on_step(self, step, rows, logits):
        n_layers = len(self.outs) and 1 + max(layer for layer, _, _ in self.outs)
        self.kept.append([[c.kept_positions(layer) for layer in range(n_layers)] for c in self.comps])

    def finish(self, runs):
        pass


def _run(engine, ids, batched: bool):
    probe = Recorder()
    LockstepDecode.batched = LockstepDecode.dense_together = batched
    try:
        res = engine.compare(ids, SPECS, GenerationSettings(max_new_tokens=6), probes=[probe])
    finally:
        LockstepDecode.batched, LockstepDecode.dense_together = True, False
    return res, probe


def test_generation_equals_per_row(engine32, lm, long_text):
    """A short lockstep generation of every method: the same tokens, the same kept positions after
    every step (so the same evictions), the observers called with the same rows and outputs. float32
    caches: a 16-bit cache would round a new key's last-bit difference up to a 16-bit step."""
    ids = lm.encode(long_text[:1200])
    res_b, rec_b = _run(engine32, ids, True)
    res_p, rec_p = _run(engine32, ids, False)
    for rb, rp in zip(res_b.runs, res_p.runs):
        assert rb.token_ids == rp.token_ids, rb.method
        assert rb.kv_bytes_per_step == rp.kv_bytes_per_step, rb.method
    assert len(rec_b.kept) == len(rec_p.kept) >= 5
    for step_b, step_p in zip(rec_b.kept, rec_p.kept):
        for spec, kb, kp in zip(SPECS, step_b, step_p):
            for pb, pp in zip(kb, kp):
                assert (pb is None) == (pp is None) and (pb is None or torch.equal(pb, pp)), spec.label
    assert [(layer, row) for layer, row, _ in rec_b.outs] == [(layer, row) for layer, row, _ in rec_p.outs]
    # full-precision caches: last-bit differences carried through the model (a wrong mask or log-weight
    # moves outputs by far more). Rows storing codes are left out: a last-bit difference in a new token can
    # move its code one step, and that token's output by ~1%.
    full_precision = {i for i, c in enumerate(rec_b.comps) if isinstance(c, DenseCompressor | SubGen)}
    full_precision -= {i for i, c in enumerate(rec_b.comps) if isinstance(c, ComposedStore)}
    assert len(full_precision) >= 12
    for (layer, row, ob), (_, _, op) in zip(rec_b.outs, rec_p.outs):
        if row in full_precision:
            assert (ob - op).norm() <= 1e-4 * op.norm(), (layer, SPECS[row].label)


def test_length_buckets_bound_the_padding():
    assert length_buckets([400, 1900, 420, 380, 1800]) == [[1, 4, 2], [0, 3]]  # 5700 <= 1.5 x 4120 tokens
    assert length_buckets([5, 5, 5]) == [[0, 1, 2]]
    assert length_buckets([100, 10], max_padding=10.0) == [[0, 1]]
    for lengths in ([1, 2, 3, 50, 70, 1000, 999, 2], [7]):
        buckets = length_buckets(lengths)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
        for b in buckets:
            assert len(b) * max(lengths[i] for i in b) <= 1.5 * sum(lengths[i] for i in b)
