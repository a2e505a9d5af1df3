"""The attention maps: each method's own weight estimate (``Compressor.estimated_weights``) and the figure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quant import dequantize_groups
from kernels.tensor_ops import group_queries, ungroup
from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget
from kvlab.core.results import CompareResult, RunResult
from kvlab.engine.probe import Probe
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure.metrics import answer_positions
from kvlab.methods import budget_search
from kvlab.methods.dense import DenseCompressor
from kvlab.methods.registry import get, names
from kvlab.report import comparison_figures as plots

LAYER = 15


class WeightsProbe(Probe):
    """Calls every run's ``estimated_weights`` at one layer on each decode step, with the real query."""

    sees_layers = True

    def on_prefill(self, state, logits, compressors) -> None:
        self.comps, self.seen = compressors, {}

    def on_step(self, step, rows, logits) -> None:
        pass

    def on_layer(self, layer, rows, pos, q, k, v, out) -> None:
        if layer == LAYER:
            for r, i in enumerate(rows):
                kept = self.comps[i].kept_positions(layer) if isinstance(self.comps[i], DenseCompressor) else None
                self.seen[i] = (pos, self.comps[i].estimated_weights(layer, q[r]), kept)

    def finish(self, runs) -> None:
        pass


@pytest.mark.slow
def test_every_method_estimates_weights_over_true_positions(engine, lm, long_text):
    """Every registered method, through the engine on real prose: finite, non-negative weights over
    every position seen so far, summing to 1 per head; dense methods weigh exactly what they keep.
    A fixed format that cannot shrink to budget 0.25 (fp8, llama.cpp's and vLLM's cache types) runs at 0.6."""
    from kvlab.methods.engine_flags import FLAGS

    fixed = {"fp8", "ggml", "vllm-turboquant", *(f.name for f in FLAGS)}
    ids = lm.encode(long_text[:900])
    specs = [RunSpec(m, None if m == "exact" else Budget.parse("0.6" if m in fixed else "0.25")) for m in names()]
    probe = WeightsProbe()
    result = engine.compare(ids, specs, GenerationSettings(max_new_tokens=3), probes=[probe])
    assert [r.finish_reason for r in result.runs].count("refused") == 0, [r.error for r in result.runs if r.error]
    assert len(probe.seen) == len(specs)
    for i, spec in enumerate(specs):
        pos, w, kept = probe.seen[i]
        assert w is not None, spec.method
        assert w.shape == (lm.info.n_heads, pos + 1), spec.method
        assert torch.isfinite(w).all() and (w >= 0).all(), spec.method
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[0]), atol=1e-4), spec.method
        if kept is not None:  # zero exactly where the method evicted, positive where it keeps
            g = lm.info.n_heads // lm.info.n_kv_heads
            held = torch.zeros_like(w, dtype=torch.bool)
            held.scatter_(1, kept.long().repeat_interleave(g, 0), True)
            assert (w[~held] == 0).all() and (w[held] > 0).all(), spec.method
    evicting = [s.method for i, s in enumerate(specs) if probe.seen[i][2] is not None and probe.seen[i][1].eq(0).any()]
    assert "streaming" in evicting and "qjl" not in evicting


def test_qjl_weights_follow_exact_attention_on_real_keys(lm, prefill_state):
    """QJL's weights are the softmax its ``attend`` takes (sketched scores + exact window): they
    reproduce its output from its own values and track exact attention over the prompt."""
    state, n = prefill_state, prefill_state.n_tokens
    qjl = get("qjl")(lm.info, Budget.parse("0.25"))
    budget_search.planned(qjl, n)
    qjl.compress(state)
    corr = []
    for layer in range(0, lm.info.n_layers, 3):
        q = state.queries[layer][:, -1:]
        exact = torch.softmax(sm.logits(q.float(), state.keys[layer].float(), state.scaling), -1)[:, 0]
        w = qjl.estimated_weights(layer, q)
        assert w.shape == exact.shape
        corr += [float(torch.corrcoef(torch.stack([w[h], exact[h]]))[0, 1]) for h in range(w.shape[0])]
        st = qjl.layers[layer]
        values = torch.cat([dequantize_groups(st.values).float(), st.res_v.float()], -2)
        rebuilt = ungroup(torch.matmul(group_queries(w[:, None], st.res_v.shape[0]), values), w.shape[0])
        assert torch.allclose(rebuilt, qjl.attend(layer, q).float(), atol=1e-4)
    assert np.mean(corr) > 0.5 and np.median(corr) > 0.5, corr


def test_subgen_weights_spread_each_cluster_over_its_tokens(lm, prefill_state):
    """SubGen's estimate gives every token of a cluster the same weight, summing to 1 over the prompt,
    and puts more than chance of exact's top positions' mass there."""
    state, n = prefill_state, prefill_state.n_tokens
    sg = get("subgen")(lm.info, Budget.parse("0.25"))
    budget_search.planned(sg, n)
    sg.compress(state)
    layer = 21
    q = state.queries[layer][:, -1:]
    w = sg.estimated_weights(layer, q)
    assign = sg.state.assign[layer]  # [Hkv, n_stream]: the tokens between the sinks and the recent window
    assert w.shape == (lm.info.n_heads, n) and torch.allclose(w.sum(-1), torch.ones(w.shape[0]), atol=1e-4)
    stream = w[:, sg.exact.sink : sg.exact.sink + assign.shape[-1]]
    h, kv = 4, 4 // (lm.info.n_heads // lm.info.n_kv_heads)
    for c in assign[kv].unique()[:20]:
        members = stream[h, assign[kv] == c]
        assert torch.allclose(members, members[0].expand_as(members))
    exact = torch.softmax(sm.logits(q.float(), state.keys[layer].float(), state.scaling), -1)[:, 0]
    top = exact.topk(16, -1).indices
    assert (w.gather(1, top).sum(-1) > 16 / n).all()


def _scattered_result(n: int = 4000, runs: int = 12, steps: int = 8, seed: int = 0) -> CompareResult:
    """A 4k-position result whose runs each keep a random quarter of the prompt (hundreds of evicted spans)."""
    rng = np.random.default_rng(seed)
    exact = rng.exponential(1.0, (steps, n))
    exact[:, 0] = 50 * n  # an attention sink
    exact[:, 2345] = 5 * n  # the needle
    exact /= exact.sum(-1, keepdims=True)
    out = [RunResult("exact", None, {})]
    for i in range(runs):
        kept = np.sort(rng.choice(n, n // 4, replace=False))
        method = np.zeros((steps, n))
        method[:, kept] = exact[:, kept] / exact[:, kept].sum(-1, keepdims=True)
        extras = {
            "attn_map": {"layer": 15, "head": 0, "steps": list(range(1, steps + 1)), "exact": exact.tolist()},
            "kept_positions": kept.tolist(),
        }
        extras["attn_map"]["method"] = method.tolist()
        out.append(RunResult("uniform", f"0.{i + 10}", {}, extras=extras))
    settings = {"answer_positions": [2345]}
    return CompareResult({"n_layers": 30}, "", n, list(range(n)), settings, {}, out)


def test_scattered_evictions_draw_a_bounded_figure():
    result = _scattered_result()
    spans = sum(1 for r in result.runs[1:] for a, b in zip(plots.kept_of(r), plots.kept_of(r)[1:]) if b > a + 1)
    assert spans > 12 * 500  # thousands of evicted spans over the runs
    fig = plots.attention_heatmaps(result)
    assert len(fig.data) == 2 * 12  # per run: weights and one kept row, whatever the spans
    assert len(fig.layout.shapes) == 1  # the answer's line, nothing per span
    weights, held = fig.data[0], fig.data[1]
    assert len(weights.x) <= plots.MAX_COLUMNS and np.asarray(weights.z).shape[1] == len(weights.x)
    assert "largest weight of 4 positions" in fig.layout.xaxis12.title.text
    assert np.asarray(held.z).mean() == pytest.approx(0.25, abs=0.01)  # the share kept
    col = int(np.searchsorted(np.asarray(weights.x), 2345, side="right")) - 1
    z = np.asarray(weights.z, dtype=float)
    assert z[0, col] == 1.0 and np.nanmedian(z[0]) < 0.9  # max-pooling keeps the needle at full colour
    assert fig.layout.shapes[0].x0 == 2345


def test_answer_positions_cover_the_number(lm):
    from kvlab.tasks import make_task, prompt_ids

    task = make_task("passkey", 300, 0, lm.encode)
    ids = prompt_ids(lm, task)
    pos = answer_positions(ids, task.answer, lm.decode)
    assert pos == list(range(pos[0], pos[-1] + 1)) and task.answer in lm.decode([ids[p] for p in pos])
    assert task.answer not in lm.decode(ids[pos[0] + 1 : pos[-1] + 1]) + lm.decode(ids[pos[0] : pos[-1]])
    assert answer_positions(ids, "no such answer", lm.decode) == []
