"""Compositions with the per-token quantizers (kvlab/methods/with_token_quant.py): ``METHOD+turboquant``,
``METHOD+polarquant``, ``METHOD+fp8``. The store holds the codes the quantizer alone gives the same tokens,
attention scores them directly, the budget pays for them in bytes, and the inner method chooses as alone.
Real prefill of the embedded model (``prefill_state``)."""

from __future__ import annotations

import pytest
import torch
from kv_samples import compressed, new_token

from kernels.tensor_ops import gather_tokens, group_queries
from kvlab.core import semantics as sm
from kvlab.core.attention_ops import tensor_bytes
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import get, names
from kvlab.methods.dense import DenseLayer
from kvlab.methods.h2o import H2O
from kvlab.methods.params import ParamError
from kvlab.methods.registry import UnknownMethodError
from kvlab.methods.snapkv import SnapKV
from kvlab.methods.streaming import StreamingLLM
from kvlab.methods.turboquant import TurboQuant
from kvlab.methods.with_token_quant import (
    AUTO_FLOOR,
    CodedDenseLayer,
    CodedKeys,
    FP8Storage,
    PolarQuantStorage,
    TurboQuantStorage,
)

# (composition, the quantizer alone, the composition's parameters, the same setting as the quantizer's)
SAME_SETTING = [
    ("snapkv+turboquant", "turboquant", {"turbo_bits": 3.5}, {"bits": 3.5}),
    ("h2o+turboquant", "turboquant", {"turbo_bits": 2, "turbo_keys": "mse"}, {"bits": 2, "keys": "mse"}),
    ("snapkv+polarquant", "polarquant", {}, {}),
    ("snapkv+fp8", "fp8", {}, {}),
    ("streaming+fp8", "fp8", {"fp8_scales": "token"}, {"scales": "token"}),
]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_names_resolve_and_refuse():
    assert {"snapkv+turboquant", "h2o+fp8"} <= set(names())
    for name, inner, storage in (
        ("snapkv+turboquant", SnapKV, TurboQuantStorage),
        ("h2o+fp8", H2O, FP8Storage),
        ("snapkv+polarquant", SnapKV, PolarQuantStorage),
        ("streaming+turboquant", StreamingLLM, TurboQuantStorage),
        ("h2o+polarquant", H2O, PolarQuantStorage),
    ):
        cls = get(name)
        assert cls == get(name) and cls.inner is inner and cls.storage is storage, name
        assert [p.name for p in cls.params][: len(inner.params)] == [p.name for p in inner.params]
    assert {"turbo_bits", "turbo_keys"} <= {p.name for p in get("snapkv+turboquant").params}
    for bad in (
        "exact+turboquant",
        "turboquant+fp8",
        "kivi+polarquant",
        "qjl+fp8",
        "snapkv+qjl+fp8",
        "snapkv+fp8+kivi2",
        "snapkv+turboquantx",
        "nope+polarquant",
        "snapkv+fp16",
    ):
        with pytest.raises(UnknownMethodError):
            get(bad)


def test_bad_parameters_rejected(lm):
    budget = Budget.parse("0.25")
    for name, params in (
        ("snapkv+turboquant", {"turbo_bits": 5}),
        ("snapkv+turboquant", {"turbo_bits": 2.75}),
        ("snapkv+turboquant", {"turbo_keys": "both"}),
        ("snapkv+fp8", {"fp8_scales": "tensor"}),
        ("snapkv+polarquant", {"polar_level_bits": "4,9"}),
        ("snapkv+polarquant", {"polar_level_bits": "many"}),
    ):
        with pytest.raises(ParamError):
            get(name)(lm.info, budget, params)


@pytest.mark.parametrize("name,alone,params,same", SAME_SETTING)
def test_store_holds_the_quantizers_own_codes(lm, prefill_state, name, alone, params, same):
    """Each kept token's codes are, bit for bit, those the quantizer alone (no window) gives that token, with
    the same per-head constants; the store reads them back as the quantizer does."""
    state = prefill_state
    comp, _ = compressed(lm, state, name, "150t", **params)
    ref, _ = compressed(lm, state, alone, "0.99", residual=0, **same)
    assert ref.layers[0].n_coded == state.n_tokens and ref.layers[0].res_k.shape[1] == 0
    for layer in (0, 13, lm.info.n_layers - 1):
        st, full = comp.layers[layer], ref.layers[layer]
        assert isinstance(st, CodedDenseLayer) and st.n == 150
        pos = st.positions().long()
        assert set(st.coded.codes) == set(full.codes)
        for kind, t in st.coded.codes.items():
            whole = full.codes[kind]
            expect = torch.gather(whole, 1, pos) if whole.dim() == 2 else gather_tokens(_as_bytes(whole), pos)
            assert torch.equal(_as_bytes(t), expect), (name, layer, kind)
        for kind, t in st.coded.extra.items():
            assert torch.equal(t, full.extra[kind]), (name, layer, kind)
        k_hat, v_hat, _, _ = st.views()
        args = (layer, full) if isinstance(ref, TurboQuant) else (full,)
        k_ref, v_ref = ref.dequantize(*args)
        torch.testing.assert_close(k_hat, gather_tokens(k_ref, pos))
        torch.testing.assert_close(v_hat, gather_tokens(v_ref, pos))


@pytest.mark.parametrize("name,params", [("snapkv+turboquant", {"turbo_bits": 3}), ("snapkv+polarquant", {})])
def test_attention_scores_the_codes(lm, prefill_state, name, params):
    """Attention reads the keys as the quantizer's logits (TurboQuant-prod: the unbiased estimate, never a
    rebuilt key), which equal q . k_hat of the quantizer's reconstruction."""
    state, layer = prefill_state, 11
    comp, _ = compressed(lm, state, name, "200t", **params)
    st = comp.layers[layer]
    keys, values = st.read_kv()
    assert isinstance(keys, CodedKeys) and keys.shape == (lm.info.n_kv_heads, 200, lm.info.head_dim)
    q = state.queries[layer, :, -1:]
    k_hat, v_hat, _, _ = st.views()
    qg = group_queries(q.float() * state.scaling, lm.info.n_kv_heads)
    direct = comp.storage.quantizer.code_logits(layer, qg, st.coded)
    torch.testing.assert_close(keys.scores(qg), direct)
    torch.testing.assert_close(direct, qg @ k_hat.transpose(-1, -2), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(values, v_hat)
    torch.testing.assert_close(comp.attend(layer, q), sm.attend(q, k_hat, v_hat, state.scaling), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "inner,name", [("snapkv", "snapkv+turboquant"), ("h2o", "h2o+fp8"), ("snapkv", "snapkv+polarquant")]
)
def test_same_tokens_kept_as_alone(lm, prefill_state, inner, name):
    """At a token count every method can keep, the inner method keeps the prompt positions it keeps alone."""
    state = prefill_state
    comp, knobs = compressed(lm, state, name, "120t")
    ref, ref_knobs = compressed(lm, state, inner, "120t")
    assert knobs == {**ref_knobs, **{k: v for k, v in knobs.items() if k not in ref_knobs}}  # the inner's plan
    for layer in range(lm.info.n_layers):
        assert torch.equal(comp.kept_positions(layer), ref.kept_positions(layer)), layer


def test_streaming_keeps_streamings_positions_while_decoding(lm, prefill_state):
    """Score-free eviction: generated tokens are coded as they come and evicted as StreamingLLM evicts them."""
    state, n = prefill_state, prefill_state.n_tokens
    alone, _ = compressed(lm, state, "streaming", "100t")
    comp, _ = compressed(lm, state, "streaming+turboquant", "100t", turbo_bits=3.25)
    for step in range(3):
        for layer in range(lm.info.n_layers):
            k, v = new_token(state, layer, step)
            for c in (alone, comp):
                c.append(layer, k, v, n + step)
    for layer in range(lm.info.n_layers):
        assert torch.equal(comp.kept_positions(layer), alone.kept_positions(layer))
        codes = comp.layers[layer].coded.codes
        assert all(t.shape[:2] == (lm.info.n_kv_heads, 100) for t in codes.values())


def test_every_token_fits_where_it_would_not_alone(lm, prefill_state):
    """The budget pays for a coded token: at 0.25-0.3 SnapKV keeps under a third of the prompt, SnapKV + a
    quantizer every token (PolarQuant's 62 bytes a token + its position pass 0.25 of 256)."""
    state, n = prefill_state, prefill_state.n_tokens
    alone, _ = compressed(lm, state, "snapkv", "0.3")
    assert alone.layers[0].n < n / 3
    for name, budget in (("snapkv+turboquant", "0.25"), ("snapkv+polarquant", "0.3")):
        comp, knobs = compressed(lm, state, name, budget)
        assert comp.layers[0].n == n, name
        ref, _ = compressed(lm, state, "snapkv", "1.0")  # every position, the exact cache's
        for layer in (0, lm.info.n_layers - 1):
            assert torch.equal(comp.kept_positions(layer), ref.kept_positions(layer))


def test_turboquant_bits_from_the_budget(lm, prefill_state):
    state, info = prefill_state, lm.info
    n, lh = state.n_tokens, info.n_layers * info.n_kv_heads
    exact = exact_bytes(info, n)
    chosen = {}
    for budget in ("0.05", "0.125", "0.25", "0.5"):
        comp, knobs = compressed(lm, state, "snapkv+turboquant", budget)
        chosen[budget] = knobs["bits"]
        assert comp.nbytes() <= float(budget) * exact, budget
        if comp.layers[0].n == n:  # every token fits at these bits, and not at the next setting up
            assert knobs["bits"] == 4.0 or comp.nbytes() > 0.8 * float(budget) * exact, (budget, knobs)
        else:  # not every token fits even at the floor: the floor, and as many tokens as the budget pays for
            assert knobs["bits"] == AUTO_FLOOR and comp.nbytes() > 0.95 * float(budget) * exact, (budget, knobs)
    assert chosen["0.05"] == AUTO_FLOOR and chosen["0.5"] == 4.0
    assert chosen["0.05"] <= chosen["0.125"] <= chosen["0.25"] <= chosen["0.5"]
    given, knobs = compressed(lm, state, "snapkv+turboquant", "0.5", turbo_bits=1.5)
    assert knobs["bits"] == 1.5 and knobs["outlier_channels"] == info.head_dim // 2
    assert given.nbytes_by_kind()["key_outlier_channels"] == lh * info.head_dim // 2  # uint8 indices, per head


@pytest.mark.parametrize("name", ["snapkv+turboquant", "h2o+fp8", "snapkv+polarquant", "streaming+turboquant"])
def test_bytes_are_the_tensors_held_and_fit_the_budget(lm, prefill_state, name):
    state, info = prefill_state, lm.info
    n, lh = state.n_tokens, info.n_layers * info.n_kv_heads
    for budget in ("0.5", "0.25", "0.125"):
        comp, knobs = compressed(lm, state, name, budget)
        got = comp.nbytes()
        assert got == sum(tensor_bytes(t) for _, t in comp.tensors())
        assert 0 < got <= float(budget) * exact_bytes(info, n), (name, budget, got / exact_bytes(info, n))
        kept = sum(comp.layers[i].n for i in range(info.n_layers)) * info.n_kv_heads
        fixed = lh * comp.storage.fixed_bytes()
        assert got == kept * comp.per_token_bytes() + fixed  # the bytes the planner counted are the real ones
        by = comp.nbytes_by_kind()
        assert "keys" not in by or by["keys"] == kept * info.head_dim  # fp8: one byte per number
        assert ("scores" in by) == name.startswith("h2o")
        shared = comp.shared_nbytes_by_kind()
        if "fp8" in name:
            assert not shared
        else:  # rotations (sketches, codebooks): per-model state, shown apart, never in the held bytes
            assert shared.get("rotation", 0) > 0 and "rotation" not in by


@pytest.mark.parametrize("name", ["snapkv+turboquant", "h2o+fp8", "snapkv+polarquant"])
@pytest.mark.parametrize("budget", ["0.25", "0.5"])
def test_holds_the_budget_through_the_engine(engine, lm, long_text, name, budget):
    """Prefill, compression and 4 greedy steps: every step's bytes (counted from the tensors) within what the
    budget allows; the prompt's share nearly used unless every prompt token fits."""
    ids = lm.encode(long_text[:900])
    b = Budget.parse(budget)
    r = engine.compare(ids, [RunSpec(name, b)], GenerationSettings(max_new_tokens=4)).runs[0]
    assert not r.error and len(r.kv_bytes_per_step) == len(r.token_ids) == 4
    for step, held in enumerate(r.kv_bytes_per_step):
        assert held <= b.allowed_bytes(lm.info, len(ids), step, streaming=False), (step, held)
    exact = exact_bytes(lm.info, len(ids))
    every_token = r.params.get("capacity", len(ids)) >= len(ids)
    assert every_token or r.kv_bytes_per_step[0] >= 0.9 * b.fraction * exact, r.kv_bytes_per_step[0] / exact
    assert r.shared_bytes or "fp8" in name


def test_full_budget_is_the_exact_cache(lm, prefill_state):
    state, n, layer = prefill_state, prefill_state.n_tokens, 9
    comp, knobs = compressed(lm, state, "snapkv+turboquant", "1.0")
    assert "bits" not in knobs and all(isinstance(st, DenseLayer) for st in comp.layers)
    k, v = new_token(state, layer, 0)
    comp.append(layer, k, v, n)
    q = state.queries[layer, :, -1:]
    cd = lm.info.torch_cache_dtype
    ref = sm.attend(
        q, torch.cat([state.keys[layer], k], -2).to(cd), torch.cat([state.values[layer], v], -2).to(cd), state.scaling
    )
    torch.testing.assert_close(comp.attend(layer, q), ref, atol=1e-5, rtol=1e-4)
