"""The lockstep decode step (rows of a class with ``attend_many`` in one call) against the per-row path.

Every registered method is in one batch, at budgets that give rows of different cache lengths;
the per-row path (``comp.attend`` row by row: ``DecodePaths(row_attention=attend_each)``) is the reference.
"""

import torch

from kvlab.core.budgets import Budget
from kvlab.engine.batched_attention import attend_each
from kvlab.engine.comparison import Engine
from kvlab.engine.probe import Probe
from kvlab.engine.rows import DecodePaths
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import names
from kvlab.methods.dense import DenseCompressor
from kvlab.methods.subgen import SubGen

# every method at 0.25 (its own default for exact), plus rows of other cache lengths
SPECS = [RunSpec(m, None if m == "exact" else Budget.parse("0.25")) for m in names()] + [
    RunSpec("h2o", Budget.parse("0.5")),
    RunSpec("scissorhands", Budget.parse("1.0")),
    RunSpec("streaming", Budget.parse("0.1")),
    RunSpec("kivi", Budget.parse("1.0")),
    RunSpec("streaming+qjl", Budget.parse("0.5")),
]


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
    paths = DecodePaths() if batched else DecodePaths(row_attention=attend_each)
    res = Engine(engine.lm, engine.time_limit_s, paths).compare(
        ids, SPECS, GenerationSettings(max_new_tokens=6), probes=[probe]
    )
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
    full_precision -= {i for i, c in enumerate(rec_b.comps) if isinstance(c, DenseCompressor) and c.storage}
    assert len(full_precision) >= 12
    for (layer, row, ob), (_, _, op) in zip(rec_b.outs, rec_p.outs):
        if row in full_precision:
            assert (ob - op).norm() <= 1e-4 * op.norm(), (layer, SPECS[row].label)
