"""QJL (kvlab/methods/qjl.py): the estimator's statistics, the storage format, budgets, real attention."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kernels.qjl import make_sketch
from kernels.quant import dequantize_groups, group_error_bound
from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget, BudgetRefused, exact_bytes, per_token_bytes
from kvlab.core.model import ModelInfo
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import budget_search
from kvlab.methods.base import Compressor
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import ParamError
from kvlab.methods.qjl import QJL, dense_key_estimate, estimate_scores, sketch_keys


def _pair(d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(d, generator=g), torch.randn(d, generator=g)
    k = 0.6 * q + 0.8 * k  # a clearly non-zero inner product
    return q, k


def _estimates(q: torch.Tensor, k: torch.Tensor, m: int, trials: int, orthogonalize: bool, seed: int) -> torch.Tensor:
    """One QJL estimate of <q, k> per independent sketch: [trials]."""
    d = q.shape[0]
    s = make_sketch(trials, m, d, torch.Generator().manual_seed(seed), orthogonalize)  # [T, m, d]
    bits, norms = sketch_keys(k.expand(trials, 1, 1, d), s)  # [T, 1, 1, m/8], [T, 1, 1]
    k_hat = dense_key_estimate(s.unsqueeze(1), bits, norms)  # [T, 1, 1, d]
    return (k_hat.reshape(trials, d) @ q).double()


@pytest.mark.parametrize("orthogonalize", [False, True])
def test_estimator_is_unbiased(orthogonalize):
    q, k = _pair(64)
    est = _estimates(q, k, m=64, trials=3000 if orthogonalize else 6000, orthogonalize=orthogonalize, seed=1)
    se = est.std() / math.sqrt(est.numel())
    assert abs(est.mean() - q @ k) < 3 * se
    # Lemma 3.5's scale: the spread is about sqrt(pi/2) ||q|| ||k|| / sqrt(m), not wildly off.
    assert 0.5 < est.std() / (math.sqrt(math.pi / 2) * q.norm() * k.norm() / 8) < 1.5


def test_estimator_error_shrinks_with_m():
    q, k = _pair(64, seed=3)
    rmse = [(_estimates(q, k, m, 400, False, seed=m) - q @ k).pow(2).mean().sqrt().item() for m in (32, 128, 512)]
    assert rmse[0] > rmse[1] > rmse[2]
    assert rmse[2] < rmse[0] / 2.5  # ~ 1/sqrt(m): a 16x larger sketch gives ~4x less error


def test_score_estimate_equals_linear_form():
    g = torch.Generator().manual_seed(4)
    d, m = 48, 96
    s = make_sketch(1, m, d, g)[0]
    k = torch.randn(2, 7, d, generator=g)
    q = torch.randn(6, 1, d, generator=g)  # 6 query heads over 2 KV heads
    bits, norms = sketch_keys(k[None], s[None])
    est = estimate_scores(q, s, bits[0], norms[0])  # [6, 1, 7]
    k_hat = dense_key_estimate(s, bits[0], norms[0])  # [2, 7, d]
    ref = torch.einsum("gjd,gnd->gjn", q.reshape(2, 3, d), k_hat).reshape(6, 1, 7)
    assert torch.allclose(est, ref, atol=1e-4)


def test_orthogonal_sketch_blocks():
    s = make_sketch(2, 160, 64, torch.Generator().manual_seed(5))
    assert s.shape == (2, 160, 64) and s.dtype == torch.float32
    block = s[0, :64]
    assert torch.allclose(block @ block.T, 64 * torch.eye(64), atol=1e-3)
    tail = s[1, 128:]  # a partial block: 32 orthogonal rows
    assert torch.allclose(tail @ tail.T, 64 * torch.eye(32), atol=1e-3)


# ----- the compressor on the real model's prefill ----------------------------------------------------
def _qjl(lm, budget="0.25", n=None, **params) -> QJL:
    c = QJL(lm.info, None if budget is None else Budget.parse(budget), params)
    budget_search.planned(c, n)
    return c


def test_packed_storage_layout(lm, prefill_state):
    st0 = prefill_state
    c = _qjl(lm, n=st0.n_tokens)
    c.compress(st0)
    layer = c.layers[20]
    m, m_out, n_q = layer.s.shape[0], layer.s_out.shape[0], layer.n_quantized
    keys = layer.keys
    assert n_q > 0 and n_q % 32 == 0
    assert keys.bits.dtype == torch.uint8 and keys.bits.shape == (3, n_q, m // 8)
    assert keys.norms.dtype == torch.float16 and keys.norms.shape == (3, n_q)
    assert keys.out_bits.shape == (3, n_q, m_out // 8) and keys.out_idx.shape == (3, n_q // 32, c.n_out)
    # Bits are sign(S k_inlier), LSB first, recomputed independently from the real keys.
    k = st0.keys[20, :, :n_q].float()
    mask = torch.zeros_like(k, dtype=torch.bool)
    idx = keys.out_idx.long().repeat_interleave(32, dim=1)
    mask.scatter_(-1, idx, True)
    k_in = k.masked_fill(mask, 0.0)
    proj = k_in @ layer.s.T
    byte, bit = 5, 3
    expect = proj[..., 8 * byte + bit] >= 0
    assert torch.equal(((keys.bits[..., byte] >> bit) & 1).bool(), expect)
    assert torch.allclose(keys.norms.float(), k_in.norm(dim=-1), rtol=1e-3)
    # Outlier channels are the largest-norm channels of their token group.
    top = k[:, :32].norm(dim=1).topk(c.n_out, dim=-1).indices.sort(-1).values
    assert torch.equal(keys.out_idx[:, 0].long().sort(-1).values, top)


def test_bytes_per_key_and_bits_per_coordinate(lm, prefill_state):
    n = prefill_state.n_tokens
    c = _qjl(lm, "0.5", n=n, m=128, n_outliers=0, value_bits=2, residual=64)
    c.compress(prefill_state)
    by = c.nbytes_by_kind()
    n_q = c.layers[0].n_quantized
    layers, heads, d = lm.info.n_layers, lm.info.n_kv_heads, lm.info.head_dim
    n_init = round(layers * 15 / 32)  # the reference's first 15 of 32 layers
    # m/8 bytes of bits per key (2m on the first layers) plus a float16 norm.
    assert by["key_bits"] == heads * n_q * (128 // 8) * (layers + n_init)
    assert by["key_norms"] == heads * n_q * 2 * layers
    assert by["value_codes"] == heads * n_q * d * 2 // 8 * layers
    assert by["value_scales"] == by["value_zero_points"] == heads * n_q * 2 * 2 * layers
    w = n - n_q
    assert by["residual_keys"] == by["residual_values"] == heads * w * d * 2 * layers  # the 16-bit cache dtype
    bpc = c.bits_per_coordinate()
    assert bpc["keys"] == pytest.approx((128 * (layers + n_init) / layers + 16) / d)
    assert bpc["values"] == pytest.approx(3.0)


def test_value_quantization_within_bound(lm, prefill_state):
    c = _qjl(lm, n=prefill_state.n_tokens, value_bits=2)
    c.compress(prefill_state)
    layer = c.layers[7]
    n_q = layer.n_quantized
    v = prefill_state.values[7, :, :n_q]
    err = (dequantize_groups(layer.values) - v).abs()
    assert (err <= group_error_bound(layer.values)).all()
    # 2 bits: at most half of a third of each 32-coordinate group's range.
    span = v.reshape(3, n_q, 2, 32)
    span = (span.amax(-1) - span.amin(-1)).repeat_interleave(32, -1)
    assert (err <= span / 6 * 1.01 + 1e-3).all()


def _rel_err(z: torch.Tensor, a: torch.Tensor) -> float:
    return ((z - a).norm(dim=-1) / a.norm(dim=-1)).mean().item()


def test_attention_close_to_exact_and_beats_uniform(lm, prefill_state):
    st = prefill_state
    n = st.n_tokens
    c = _qjl(lm, n=n)
    c.compress(st)
    assert c.nbytes() <= 0.25 * exact_bytes(lm.info, n)
    g = torch.Generator().manual_seed(0)
    errs, uni = [], []
    for layer in range(0, lm.info.n_layers, 3):
        q = st.queries[layer, :, -8:]
        a = sm.attend(q, st.keys[layer], st.values[layer], st.scaling)
        errs.append(_rel_err(c.attend(layer, q), a))
        keep = torch.randperm(n, generator=g)[: n // 4]  # uniform sampling at the same budget
        uni.append(_rel_err(sm.attend(q, st.keys[layer][:, keep], st.values[layer][:, keep], st.scaling), a))
    qjl_err, uni_err = sum(errs) / len(errs), sum(uni) / len(uni)
    # on the 16-bit axis 0.25 buys QJL ~4 bits per number (measured 0.58 vs uniform's 0.89)
    assert qjl_err < 0.7 * uni_err, (qjl_err, uni_err)


def test_more_budget_less_error(lm, prefill_state):
    st = prefill_state
    q, errs = st.queries[12, :, -8:], []
    a = sm.attend(q, st.keys[12], st.values[12], st.scaling)
    for b in ("0.1", "0.25", "0.6"):
        c = _qjl(lm, b, n=st.n_tokens)
        c.compress(st)
        errs.append(_rel_err(c.attend(12, q), a))
    assert errs[0] > errs[1] > errs[2]


def test_full_budget_is_exact(lm, prefill_state):
    st = prefill_state
    c = _qjl(lm, "1.0", n=st.n_tokens)
    c.compress(st)
    assert c.nbytes() == exact_bytes(lm.info, st.n_tokens)
    q = st.queries[3, :, -2:]
    k, v = st.keys[3].to(lm.info.torch_cache_dtype), st.values[3].to(lm.info.torch_cache_dtype)  # what exact holds
    assert torch.allclose(c.attend(3, q), sm.attend(q, k, v, st.scaling), atol=1e-5)


def test_streaming_flush_keeps_window_and_budget(lm, prefill_state):
    st = prefill_state
    n = st.n_tokens
    c = _qjl(lm, n=n)
    c.compress(st)
    r = c.qplan.residual
    g = torch.Generator().manual_seed(1)
    n_q0 = c.layers[0].n_quantized
    info = lm.info
    for step in range(40):
        for layer in range(info.n_layers):
            k, v = torch.randn(2, info.n_kv_heads, 1, info.head_dim, generator=g) * 4
            c.append(layer, k, v, n + step)
        layer0 = c.layers[0]
        assert 0 < layer0.res_k.shape[1] <= r
        assert layer0.n_quantized + layer0.res_k.shape[1] == n + step + 1
        assert c.nbytes() <= 0.25 * exact_bytes(lm.info, n + step + 1)
    assert c.layers[0].n_quantized > n_q0  # at least one group was flushed
    # The newest token is attended exactly: a query aligned with it puts most weight on it.
    k_new = c.layers[5].res_k[:, -1:]
    q = k_new.repeat_interleave(3, dim=0) * 3
    out = c.attend(5, q)
    assert _rel_err(out, c.layers[5].res_v[:, -1:].repeat_interleave(3, dim=0)) < 0.3
    assert torch.equal(c.kept_positions(5)[0, -1], torch.tensor(n + 39, dtype=torch.int32))


def test_feed_equals_token_by_token_across_flushes(lm, prefill_state):
    """A chunk fed at once equals the per-token loop (append, attend): the same outputs and the same
    quantized store and window, across several flushes (window of 16, groups of 8, 20 new tokens)."""
    st, c_len = prefill_state, 20
    n0 = st.n_tokens - c_len
    prompt = PrefillState(st.keys[..., :n0, :], st.values[..., :n0, :], st.queries[..., :0, :], st.scaling)
    chunked = _qjl(lm, n=n0, residual=16, outlier_group=8)
    chunked.compress(prompt)
    stepwise = copy.deepcopy(chunked)
    n_q0 = chunked.layers[0].n_quantized
    calls = []
    attend = chunked.attend
    chunked.attend = lambda *a, **kw: calls.append(1) or attend(*a, **kw)
    for layer in (0, lm.info.n_layers - 1):  # a first layer (larger sketch) and a later one
        q = st.queries[layer, :, -c_len:].float()
        k, v = st.keys[layer, :, -c_len:], st.values[layer, :, -c_len:]
        got = chunked.feed(layer, q, k, v, n0)
        want = Compressor.feed(stepwise, layer, q, k, v, n0)
        assert got.shape == q.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        a, b = chunked.layers[layer], stepwise.layers[layer]
        assert a.n_seen == b.n_seen == st.n_tokens and a.n_quantized >= n_q0 + 16  # at least two flushes
    assert len(calls) < c_len  # the chunk attended in a few calls per layer, not one per token
    held, ref = list(chunked.tensors()), list(stepwise.tensors())
    assert [kind for kind, _ in held] == [kind for kind, _ in ref]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(held, ref))


def test_runs_through_engine_and_holds_budget(engine, lm, long_text):
    ids = lm.encode(long_text[:1200])
    res = engine.compare(ids, [RunSpec("qjl", Budget.parse("0.25"))], GenerationSettings(max_new_tokens=6))
    r = res.runs[0]
    assert len(r.token_ids) == 6 and r.text
    assert r.params["fits_budget"] is True and r.params["m"] % 8 == 0
    for held, exact in zip(r.kv_bytes_per_step, r.exact_kv_bytes_per_step):
        assert held <= 0.25 * exact
    assert {"key_bits", "key_norms", "value_codes", "residual_keys"} <= set(r.kv_bytes_breakdown)


def test_any_head_dim_and_gqa_group():
    info = ModelInfo("synthetic", 2, 8, 2, 48, "float32", "cpu", 4096)  # group of 4, head_dim 48
    g = torch.Generator().manual_seed(7)
    n = 200
    k = torch.randn(2, 2, n, 48, generator=g)
    v = torch.randn(2, 2, n, 48, generator=g)
    q = torch.randn(2, 8, 4, 48, generator=g)
    from kvlab.methods.handover import PrefillState

    st = PrefillState(k, v, q, scaling=48**-0.5)
    errs = []
    for m in (32, 512):  # 512 sign bits + 8-bit values fit 0.8 of head_dim 48's 16-bit cache (small outlier sketch)
        params = {"m": m, "value_bits": 8, "residual": 32, "value_group": 16, "initial_factor": 1, "m_out_ratio": 0.125}
        c = QJL(info, Budget.parse("0.8"), params)
        budget_search.planned(c, n)
        c.compress(st)
        assert c.layers[1].keys.out_idx.shape[-1] == 3  # head_dim / 16
        out = c.attend(1, q[1])
        assert out.shape == (8, 4, 48)
        errs.append(_rel_err(out, sm.attend(q[1], k[1], v[1], st.scaling)))
    assert errs[1] < errs[0] / 3  # ~ 1/sqrt(m): 16x the sketch, ~4x less error


def test_bad_params_rejected(lm):
    with pytest.raises(ParamError):
        QJL(lm.info, Budget.parse("0.25"), {"m": 100})
    with pytest.raises(ParamError):
        QJL(lm.info, Budget.parse("0.25"), {"value_bits": 5})
    with pytest.raises(ParamError):
        QJL(lm.info, Budget.parse("0.25"), {"bogus": 1})


def test_planned_bytes_match_budget(lm):
    n = 1000
    # 0.1 of the 16-bit cache (25.6 bytes per token) is below QJL's default smallest configuration (m = 8,
    # 1-bit values, one 32-token window): the flush group (the smallest window) shrinks until it fits
    c = QJL(lm.info, Budget.parse("0.1"))
    knobs = budget_search.planned(c, n)
    assert knobs["outlier_group"] < 32 and knobs["fits_budget"]
    assert c.qplan.planned_bytes <= 0.1 * n * per_token_bytes(lm.info)
    # 0.05 is below even that (8 sign bits + 2 norm bytes + 1-bit values ~ 0.08): refused, with the way out
    with pytest.raises(BudgetRefused, match="qjl cannot fit budget 0.05 on a 1000-token prompt") as refused:
        budget_search.planned(QJL(lm.info, Budget.parse("0.05")), n)
    smallest = refused.value.smallest.fraction
    assert 0.05 < smallest <= 0.1 and budget_search.planned(QJL(lm.info, Budget(fraction=smallest)), n)["fits_budget"]
    for b in ("0.15", "0.25", "0.5"):
        c = QJL(lm.info, Budget.parse(b))
        knobs = budget_search.planned(c, n)
        target = float(b) * n * per_token_bytes(lm.info)
        assert knobs["fits_budget"] and c.qplan.planned_bytes <= target
        assert c.qplan.planned_bytes > 0.85 * target  # the budget is used, not wasted


def test_split_query_matches_masked_linear_form_and_lowers_error(lm, prefill_state):
    from kernels.qjl import outlier_mask
    from kvlab.methods.qjl import estimate_scores_split

    st = prefill_state
    n, errs = st.n_tokens, []
    for split in (False, True):
        c = _qjl(lm, n=n, split_query=split)
        c.compress(st)
        layer_errs = []
        for layer in (10, 20, lm.info.n_layers - 1):
            q = st.queries[layer, :, -8:]
            a = sm.attend(q, st.keys[layer], st.values[layer], st.scaling)
            layer_errs.append(_rel_err(c.attend(layer, q), a))
        errs.append(sum(layer_errs) / 3)
    assert errs[1] < 0.9 * errs[0], errs
    # The split estimate is <q, k_hat restricted to each part's channels>.
    lay = c.layers[20]
    kq, q = lay.keys, st.queries[20, :, -2:]
    info = lm.info
    mask = outlier_mask(kq.out_idx, info.head_dim, 32)
    k_hat = dense_key_estimate(lay.s, kq.bits, kq.norms).masked_fill(mask, 0.0)
    k_hat = k_hat + dense_key_estimate(lay.s_out, kq.out_bits, kq.out_norms).masked_fill(~mask, 0.0)
    grouped = q.reshape(info.n_kv_heads, -1, info.head_dim)  # [Hkv, group x 2 queries, d]
    ref = torch.einsum("gjd,gnd->gjn", grouped, k_hat).reshape(info.n_heads, 2, -1)
    est = estimate_scores_split(q, lay.s, kq.bits, kq.norms, kq.out_idx, 32, outliers=False)
    est = est + estimate_scores_split(q, lay.s_out, kq.out_bits, kq.out_norms, kq.out_idx, 32, outliers=True)
    assert torch.allclose(est, ref, rtol=1e-4, atol=1e-2)


def test_planner_picks_the_papers_configuration(lm):
    """At the budget of its bytes the planner picks the paper's configuration: m = 2 x head_dim,
    2-bit values in groups of 32, 128 recent tokens; the outlier sketch as large as m (reference)."""
    n, d = 1900, lm.info.head_dim
    frac = QJL(lm.info, Budget.parse("0.5"), {}).paper_fraction(n)
    c = _qjl(lm, budget=f"{frac:.9f}", n=n)
    knobs = c.qplan.knobs(d)
    assert (knobs["m"], knobs["value_bits"], knobs["residual"]) == (2 * d, 2, 128), knobs
    assert knobs["m_out"] == 2 * d and knobs["m_initial"] == 4 * d and knobs["fits_budget"]
    assert c.cfg["split_query"] and c.cfg["value_group"] == 32
    # ~3 bits per value coordinate (2-bit codes + fp16 scale and minimum per 32); keys: m + m_out bits
    assert knobs["value_bits_per_coord"] == 3.0
    print(f"qjl paper configuration at n={n}: budget {frac:.4f} of the 16-bit cache, {knobs}")


def test_budget_half_gives_about_8_bits_per_number(lm):
    """On the 16-bit axis a budget of 0.5 buys ~8 bits per stored number, not 16."""
    n = 1900
    c = _qjl(lm, budget="0.5", n=n)
    per_number = 8 * c.qplan.planned_bytes / (n * lm.info.head_dim * 2)
    assert 7.0 < per_number <= 8.0


def test_forks_share_segments_and_attend_together(lm, prefill_state, monkeypatch):
    """Forks of one compressed cache (questions asked after compression) hold its quantized segment
    itself; each flushes into a segment of its own. One lockstep call (``attend_many``) scores the
    shared segment once for all forks and equals each fork's own ``attend``."""
    from kvlab.engine.batched_attention import attend_rows

    st, info = prefill_state, lm.info
    base = _qjl(lm, n=st.n_tokens, residual=16, outlier_group=8)
    base.compress(st)
    forks = [copy.deepcopy(base) for _ in range(2)] + [base]
    shared = base.layers[0].segments[0]
    assert all(f.layers[0].segments[0] is shared for f in forks)
    g = torch.Generator().manual_seed(3)
    for step in range(12):  # different tokens per fork: at least one flush each
        for f in forks:
            for layer in range(info.n_layers):
                k, v = torch.randn(2, info.n_kv_heads, 1, info.head_dim, generator=g) * 4
                f.append(layer, k, v, st.n_tokens + step)
    assert all(len(f.layers[0].segments) == 2 and f.layers[0].segments[0] is shared for f in forks)
    assert len({id(f.layers[0].segments[1]) for f in forks}) == 3
    scored = []
    real = QJL._segment_scores

    def counted(self, layer_st, seg, qg):
        scored.append(qg.shape[1])
        return real(self, layer_st, seg, qg)

    monkeypatch.setattr(QJL, "_segment_scores", counted)
    q = torch.randn(len(forks), info.n_heads, 1, info.head_dim, generator=g)
    for layer in (0, info.n_layers - 1):
        scored.clear()
        got = attend_rows(forks, layer, q)
        assert sorted(scored) == [3, 3, 3, 9]  # the shared segment once with every fork's 3 query heads per KV head
        for i, f in enumerate(forks):
            torch.testing.assert_close(got[i], f.attend(layer, q[i]), atol=1e-5, rtol=1e-4)


def test_sketches_are_shared_state_unless_counted(lm, prefill_state):
    """S and S_out (float32, one per layer) are shown apart as shared across sequences; count_sketch=true moves
    them into the bytes a sequence holds, and the planner then shrinks m to make room."""
    n, d = prefill_state.n_tokens, lm.info.head_dim
    apart, counted = _qjl(lm, n=n), _qjl(lm, n=n, count_sketch=True)
    apart.compress(prefill_state)
    counted.compress(prefill_state)
    sizes = sum((st.s.shape[0] + st.s_out.shape[0]) * d * 4 for st in apart.layers)
    assert apart.shared_nbytes_by_kind() == {"sketch": sizes} and "sketch" not in apart.nbytes_by_kind()
    assert counted.shared_nbytes_by_kind() == {} and counted.nbytes_by_kind()["sketch"] > 0
    assert counted.qplan.m[-1] < apart.qplan.m[-1] and counted.nbytes() <= 1.05 * 0.25 * exact_bytes(lm.info, n)


def test_three_bit_values_cost_three_bits(lm, prefill_state):
    c = _qjl(lm, "0.5", n=prefill_state.n_tokens, m=128, n_outliers=0, value_bits=3, residual=64)
    c.compress(prefill_state)
    n_q, layers, heads, d = c.layers[0].n_quantized, lm.info.n_layers, lm.info.n_kv_heads, lm.info.head_dim
    assert c.nbytes_by_kind()["value_codes"] == heads * n_q * d * 3 // 8 * layers
    assert c.bits_per_coordinate()["values"] == pytest.approx(4.0)  # 3 code bits + 32 bits of scale/min per 32
