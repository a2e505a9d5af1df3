"""Compositions (kvlab/methods/composed.py, with_kivi.py, with_qjl.py), mainly ``METHOD+qjl``: an eviction
method's selection with QJL-sketched keys and quantized values. Real prefill of the embedded model
(``prefill_state``)."""

from __future__ import annotations

import pytest
import torch
from kv_samples import compressed, new_token

from kernels.quant import dequantize_groups
from kernels.tensor_ops import group_queries
from kvlab.core import semantics as sm
from kvlab.core.attention_ops import tensor_bytes
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.methods import get, names
from kvlab.methods.dense import DenseLayer
from kvlab.methods.h2o import H2O
from kvlab.methods.params import ParamError
from kvlab.methods.qjl import dense_key_estimate, estimate_scores, estimate_scores_split
from kvlab.methods.registry import UnknownMethodError
from kvlab.methods.streaming import StreamingLLM
from kvlab.methods.with_qjl import QJLDenseLayer, QJLStorage


def test_qjl_compositions_resolve_on_demand_and_are_listed():
    assert {"snapkv+qjl", "h2o+qjl"} <= set(names()) and get("h2o+qjl").inner is H2O
    cls = get("streaming+qjl")
    assert cls == get("streaming+qjl") and cls.inner is StreamingLLM and cls.storage is QJLStorage
    assert [p.name for p in cls.params][: len(StreamingLLM.params)] == [p.name for p in StreamingLLM.params]
    assert {"qjl_m", "qjl_outliers", "value_bits", "value_group", "count_sketch"} <= {p.name for p in cls.params}
    for bad in ("exact+qjl", "qjl+qjl", "kivi+qjl", "snapkv+kivi2+qjl", "h2o+qjl+kivi2", "snapkv+qjlx", "nope+qjl"):
        with pytest.raises(UnknownMethodError):
            get(bad)


def test_bad_qjl_params_rejected(lm):
    cls = get("streaming+qjl")
    for params in (
        {"qjl_m": 100},
        {"qjl_m": 4},
        {"qjl_m": "many"},
        {"qjl_outliers": lm.info.head_dim},
        {"value_bits": 5},
    ):
        with pytest.raises(ParamError):
            cls(lm.info, Budget.parse("0.25"), params)
    assert cls(lm.info, Budget.parse("0.25"), {}).storage.sketch_rows == 2 * lm.info.head_dim  # before plan() fits it


def test_streaming_qjl_keeps_streamings_positions(lm, prefill_state):
    """Score-free eviction: at the same token count the kept positions are StreamingLLM's, prefill and decode."""
    state, n = prefill_state, prefill_state.n_tokens
    alone, _ = compressed(lm, state, "streaming", "100t")
    comp, knobs = compressed(lm, state, "streaming+qjl", "100t", qjl_outliers=4)
    assert knobs["window"] == 96 and isinstance(comp.layers[0], QJLDenseLayer)
    for step in range(3):
        for layer in range(lm.info.n_layers):
            k, v = new_token(state, layer, step)
            for c in (alone, comp):
                c.append(layer, k, v, n + step)
    for layer in range(lm.info.n_layers):
        pos = comp.kept_positions(layer)
        assert pos.shape == (lm.info.n_kv_heads, 100) and torch.equal(pos, alone.kept_positions(layer))
        st = comp.layers[layer]
        assert st.keys.bits.shape[-2] == st.keys.out_idx.shape[-2] == st.v.codes.shape[-3] == 100


@pytest.mark.parametrize("inner,budget", [("h2o", "120t"), ("scissorhands", "100t")])
def test_scored_eviction_runs_on_the_key_estimates(lm, prefill_state, inner, budget):
    """The prefill choice is the inner method's own (exact prompt attention); while decoding, METHOD+qjl evicts
    exactly as METHOD would holding k_hat and the dequantized values: same positions, scores and outputs."""
    state, n = prefill_state, prefill_state.n_tokens
    comp, knobs = compressed(lm, state, f"{inner}+qjl", budget)
    ref, ref_knobs = compressed(lm, state, inner, budget)
    assert knobs == {**ref_knobs, **{k: v for k, v in knobs.items() if k not in ref_knobs}}  # the inner's plan
    assert knobs["qjl_m"] == 2 * lm.info.head_dim
    layers = (2, lm.info.n_layers - 1)
    for layer in layers:
        assert torch.equal(comp.kept_positions(layer), ref.kept_positions(layer))
        k_hat, v_hat, pos, _ = comp.layers[layer].views()
        ref.layers[layer] = DenseLayer.make(k_hat, v_hat, pos)
    dropped = 0
    for step in range(6):
        for layer in layers:
            k, v = new_token(state, layer, step)
            before = comp.kept_positions(layer).clone()
            comp.append(layer, k, v, n + step)
            k_new, v_new, _, _ = comp.layers[layer].views()  # the new token is the most recent: never evicted
            ref.append(layer, k_new[:, -1:], v_new[:, -1:], n + step)
            dropped += int((~torch.isin(before, comp.kept_positions(layer))).sum())
            q = state.queries[layer, :, -1 - step :][:, :1]
            torch.testing.assert_close(comp.attend(layer, q), ref.attend(layer, q), atol=1e-5, rtol=1e-5)
            assert torch.equal(comp.kept_positions(layer), ref.kept_positions(layer)), (layer, step)
            torch.testing.assert_close(comp.scores[layer], ref.scores[layer], atol=1e-6, rtol=1e-5)
    assert dropped > 0  # the test did exercise decode-time eviction


@pytest.mark.parametrize("outliers,split", [(0, False), (4, False), (4, True)])
def test_logits_are_qjl_estimates_from_the_stored_bits(lm, prefill_state, outliers, split):
    state, layer = prefill_state, 11
    comp, knobs = compressed(lm, state, "snapkv+qjl", "200t", qjl_outliers=outliers, split_query=split)
    st = comp.layers[layer]
    q = state.queries[layer, :, -1:]  # [Hq, 1, d]
    k_hat, v_hat, _, _ = st.views()
    kq = st.keys
    assert knobs["qjl_m_out"] == (knobs["qjl_m"] if outliers else 0) and st.n_out == outliers
    # QJL's own score path over the stored bits (no dense k_hat involved)
    if not outliers:
        est = estimate_scores(q, st.s, kq.bits, kq.norms)
        torch.testing.assert_close(k_hat, dense_key_estimate(st.s, kq.bits, kq.norms))
    elif split:
        est = estimate_scores_split(q, st.s, kq.bits, kq.norms, kq.out_idx, 1, outliers=False)
        est = est + estimate_scores_split(q, st.s_out, kq.out_bits, kq.out_norms, kq.out_idx, 1, outliers=True)
    else:
        est = estimate_scores(q, st.s, kq.bits, kq.norms) + estimate_scores(q, st.s_out, kq.out_bits, kq.out_norms)
    logits = torch.matmul(group_queries(q.float(), k_hat.shape[0]), k_hat.transpose(-1, -2))
    torch.testing.assert_close(logits.reshape(est.shape), est, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(v_hat, dequantize_groups(st.v))
    torch.testing.assert_close(comp.attend(layer, q), sm.attend(q, k_hat, v_hat, state.scaling), atol=1e-5, rtol=1e-5)


def test_key_estimates_track_exact_logits_and_improve_with_m(lm, prefill_state):
    """Logit error vs exact logits over the kept keys: well below that of unrelated keys, shrinking with m."""
    state = prefill_state
    g = torch.Generator().manual_seed(0)
    errs: dict[int, float] = {}
    for m in (64, 256):
        comp, _ = compressed(lm, state, "streaming+qjl", "0.5", qjl_m=m)  # everything fits: all tokens kept
        num = den = rnd = 0.0
        for layer in (3, 15, lm.info.n_layers - 1):
            k, pos = state.keys[layer].float(), comp.kept_positions(layer)
            assert pos.shape[-1] == state.n_tokens
            qg = group_queries(state.queries[layer, :, -8:].float(), k.shape[0])
            exact = qg @ k.transpose(-1, -2)
            est = qg @ comp.layers[layer].views()[0].transpose(-1, -2)
            other = qg @ k[:, torch.randperm(k.shape[1], generator=g)].transpose(-1, -2)
            num, den, rnd = num + (est - exact).norm() ** 2, den + exact.norm() ** 2, rnd + (other - exact).norm() ** 2
        errs[m], unrelated = float((num / den).sqrt()), float((rnd / den).sqrt())
    assert errs[256] < 0.5 * unrelated, (errs, unrelated)
    assert errs[256] < 0.7 * errs[64], errs  # ~ 1/sqrt(m): 4x the bits, about half the error


@pytest.mark.parametrize("name,inner", [("snapkv+qjl", "snapkv"), ("h2o+qjl", "h2o"), ("streaming+qjl", "streaming")])
def test_bytes_are_the_tensors_held_and_fit_the_budget(lm, prefill_state, name, inner):
    state, info = prefill_state, lm.info
    n, lh = state.n_tokens, info.n_layers * info.n_kv_heads
    for budget in ("0.5", "0.25", "0.125", "0.03"):
        comp, knobs = compressed(lm, state, name, budget)
        got = comp.nbytes()
        assert got == sum(tensor_bytes(t) for _, t in comp.tensors())
        assert 0 < got <= 1.05 * float(budget) * exact_bytes(info, n), (name, budget, got / exact_bytes(info, n))
        kept = sum(comp.layers[i].n for i in range(info.n_layers)) * info.n_kv_heads
        assert got == kept * comp.per_token_bytes()  # the per-token bytes the planner used are the real ones
        by = comp.nbytes_by_kind()
        m, d = knobs["qjl_m"], info.head_dim
        assert by["key_bits"] == kept * m // 8 and by["key_norms"] == kept * 2
        assert by["value_codes"] == kept * d * 2 // 8  # 2-bit values
        assert "keys" not in by and "values" not in by and "sketch" not in by
        assert ("scores" in by) == (inner == "h2o") and ("positions" in by) == (inner != "streaming")
    alone, _ = compressed(lm, state, inner, "0.03")
    assert comp.layers[0].n > 5 * alone.layers[0].n  # ~10x cheaper tokens: many more kept at the same bytes
    # count_sketch: the sketches are held bytes too, paid for with fewer tokens
    comp, _ = compressed(lm, state, name, "0.06")
    counted, _ = compressed(lm, state, name, "0.06", count_sketch=True)
    sketch = info.n_layers * knobs["qjl_m"] * d * 4
    assert counted.nbytes_by_kind()["sketch"] == sketch
    assert counted.nbytes() <= 1.05 * 0.06 * exact_bytes(info, n) and counted.layers[0].n < comp.layers[0].n < n
    assert lh * (comp.layers[0].n - counted.layers[0].n) * comp.per_token_bytes() == pytest.approx(sketch, rel=0.05)


def test_sketch_size_from_the_budget(lm, prefill_state):
    """Without qjl_m: 2 x head_dim while tokens are evicted; once every token fits, the budget buys bits."""
    state, info = prefill_state, lm.info
    n, d, exact = state.n_tokens, info.head_dim, exact_bytes(info, prefill_state.n_tokens)
    lh, exact_token = info.n_layers * info.n_kv_heads, 2 * d * info.dtype_bytes  # 256 bytes: 16-bit K and V
    # one h2o+qjl token at m = 2 x head_dim: m/8 + 2 (sign bits + fp16 norm) + d/4 + 2 x 4 (2-bit values, fp16
    # scale and minimum per 32) + 4 (position) + 4 (score) = 18 + 24 + 8 = 50 bytes. The planner fits the sketch
    # counting a 4-byte log-weight too (54 bytes), which h2o does not hold: once every token fits, the bytes held
    # are below the budget by less than one more sketch byte plus that log-weight per token, 5 / 256 of exact.
    smallest, slack = 2 * d // 8 + 2 + d * 2 // 8 + 2 * 4 + 4 + 4, (1 + 4) / exact_token
    ms = {}
    for budget in ("0.03", "0.125", "0.25", "0.5"):
        comp, knobs = compressed(lm, state, "h2o+qjl", budget)
        ms[budget] = knobs["qjl_m"]
        assert ms[budget] % 8 == 0 and 2 * d <= ms[budget] <= 16 * d
        frac = comp.nbytes() / exact
        if float(budget) * exact_token < smallest + 4:
            # 0.03 and 0.125 (32 bytes a token on the 16-bit axis, < 54): not every token fits at the smallest
            # sketch, so the budget goes to tokens: m = 2 x head_dim and as many 50-byte tokens as fit
            assert ms[budget] == 2 * d and comp.layers[0].n == int(float(budget) * exact) // lh // smallest < n
        else:
            assert comp.layers[0].n == n
            # all tokens kept; the sketch grows until one more byte of it per token would not fit (or 16 x head_dim)
            assert frac <= float(budget) and (ms[budget] == 16 * d or frac > float(budget) - slack), (budget, frac)
    # every token fits: the planner's token costs m / 8 + 38 bytes (with the log-weight), so m is 8 x (the bytes a
    # token may cost - 38), at most 16 x head_dim; with n = 715: 0.25 buys 64 bytes a token (m = 208), 0.5 buys 128
    # (m = 720). Against a fp32 reference these were twice as many, and 0.125 kept every token too.
    for budget in ("0.25", "0.5"):
        per_token = int(float(budget) * exact) / lh / n
        assert ms[budget] == min(16 * d, 8 * int(per_token - (smallest + 4 - 2 * d // 8))), (budget, ms)
    assert ms["0.125"] < ms["0.25"] < ms["0.5"]
    fixed, knobs = compressed(lm, state, "h2o+qjl", "0.25", qjl_m=96)
    assert knobs["qjl_m"] == 96 and fixed.layers[0].keys.bits.shape[-1] == 12
    counted, knobs = compressed(lm, state, "h2o+qjl", "0.25", count_sketch=True)
    assert knobs["qjl_m"] < ms["0.25"] and counted.nbytes() <= 0.25 * exact


@pytest.mark.parametrize("name", ["snapkv+qjl", "h2o+qjl", "streaming+qjl"])
def test_full_budget_is_the_exact_cache(lm, prefill_state, name):
    state, n, layer = prefill_state, prefill_state.n_tokens, 9
    comp, knobs = compressed(lm, state, name, "1.0")
    assert "qjl_m" not in knobs and all(isinstance(st, DenseLayer) for st in comp.layers)
    k, v = new_token(state, layer, 0)
    comp.append(layer, k, v, n)
    q = state.queries[layer, :, -1:]
    cd = lm.info.torch_cache_dtype  # the exact cache as stored: 16-bit K/V, the new token's too
    assert all(t.dtype == cd for kind, t in comp.tensors() if kind in ("keys", "values"))
    ref = sm.attend(
        q, torch.cat([state.keys[layer], k], -2).to(cd), torch.cat([state.values[layer], v], -2).to(cd), state.scaling
    )
    torch.testing.assert_close(comp.attend(layer, q), ref, atol=1e-5, rtol=1e-4)
    assert comp.nbytes() >= exact_bytes(lm.info, n) * 0.999
