"""KIVI on the real prefill of the embedded model: error bounds, layout, bytes, residual, budget."""

import pytest
import torch

from kvlab.budgets import Budget, exact_bytes
from kvlab.compressors import get
from kvlab.compressors.kivi import kivi_bytes
from kvlab.ops import dense_attention


def _kivi(lm, state, budget="0.25", **params):
    comp = get("kivi")(lm.info, Budget.parse(budget), params)
    knobs = comp.plan(state.n_tokens)
    comp.compress(state)
    return comp, knobs


def _group_bound(x, group, dim, bits):
    """Half a quantization step of each element's group, from the original tensor's own range."""
    xm = x.movedim(dim, -1)
    n = xm.shape[-1] // group * group
    g = xm[..., :n].reshape(*xm.shape[:-1], -1, group)
    step = (g.amax(-1) - g.amin(-1)) / (2**bits - 1)
    return step.repeat_interleave(group, -1), xm[..., :n]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequantized_error_within_bit_width_bound(lm, prefill_state, bits):
    comp, knobs = _kivi(lm, prefill_state, bits=bits, residual=0)
    nq = knobs["quantized_tokens"]
    assert nq == prefill_state.n_tokens // 32 * 32
    for layer in (0, 11, 29):
        k_hat, v_hat = comp.layers[layer].dequantized()
        k, v = prefill_state.keys[layer], prefill_state.values[layer]
        # keys: groups of 32 tokens per channel; values: groups of 32 channels per token
        kb, kx = _group_bound(k[:, :nq], 32, -2, bits)
        vb, vx = _group_bound(v[:, :nq], 32, -1, bits)
        k_err = (k_hat[:, :nq] - k[:, :nq]).abs().movedim(-2, -1)
        v_err = (v_hat[:, :nq] - v[:, :nq]).abs()
        slack = 2e-3 * torch.maximum(kx.abs(), torch.ones(()))  # float16 scale / minimum
        assert (k_err <= kb / 2 + slack).all()
        assert (v_err <= vb / 2 + 2e-3 * torch.maximum(vx.abs(), torch.ones(()))).all()
        assert k_err.max() > kb.max() / 20  # it really is quantized
        assert torch.equal(k_hat[:, nq:], k[:, nq:])  # the residual is exact


def test_keys_per_channel_values_per_token(lm, prefill_state):
    comp, knobs = _kivi(lm, prefill_state, bits=2, residual=0)
    h, d, nq = lm.info.n_kv_heads, lm.info.head_dim, knobs["quantized_tokens"]
    cache = comp.layers[0]
    assert cache.kq.scale.shape == (h, d, nq // 32)  # one scale per channel per 32 tokens
    assert cache.vq.scale.shape == (h, nq, d // 32)  # one scale per token per 32 channels
    assert cache.kq.codes.dtype == torch.uint8 and cache.kq.codes.numel() == h * d * nq * 2 // 8


def test_bytes_are_packed_storage(lm, prefill_state):
    n = prefill_state.n_tokens
    for bits, residual in ((2, 0), (4, 100), (3, 64)):
        comp, knobs = _kivi(lm, prefill_state, bits=bits, residual=residual)
        assert comp.nbytes() == kivi_bytes(lm.info, n, bits, 32, residual)
        per_elem = 4 if bits == 3 else bits  # 3-bit codes are stored in nibbles
        codes = comp.nbytes_by_kind()["keys_codes"] + comp.nbytes_by_kind()["values_codes"]
        coords = lm.info.n_layers * lm.info.n_kv_heads * knobs["quantized_tokens"] * lm.info.head_dim
        assert codes == 2 * coords * per_elem // 8
    two, _ = _kivi(lm, prefill_state, bits=2, residual=0)
    assert two.nbytes() < 0.11 * exact_bytes(lm.info, n)  # (2 + 1) / 32 of fp32, plus a partial group in fp32


def test_residual_flushed_in_groups(lm, prefill_state):
    n = prefill_state.n_tokens
    comp, knobs = _kivi(lm, prefill_state, bits=2, residual=40)
    cache = comp.layers[3]
    r0, nq0 = cache.rk.n, knobs["quantized_tokens"]
    assert 40 <= r0 < 72 and nq0 + r0 == n
    g = torch.Generator().manual_seed(0)
    sizes = []
    for step in range(40):
        shape = (lm.info.n_kv_heads, 1, lm.info.head_dim)
        k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        comp.append(3, k, v, n + step)
        sizes.append((cache.rk.n, cache.kq.length))
        assert 40 <= cache.rk.n < 72
    assert sizes[-1][1] == nq0 + 32  # one group of 32 flushed
    assert all(r + q == n + i + 1 for i, (r, q) in enumerate(sizes))
    k_hat, v_hat = cache.dequantized()
    assert torch.equal(k_hat[:, -1:], k) and torch.equal(v_hat[:, -1:], v)  # newest token exact


def test_budget_maps_to_bits_and_residual(lm, prefill_state):
    n = prefill_state.n_tokens
    seen = {}
    for budget in ("0.5", "0.25", "0.125"):
        comp, knobs = _kivi(lm, prefill_state, budget)
        target = float(budget) * exact_bytes(lm.info, n)
        assert comp.nbytes() <= target
        # the residual is as long as fits: one more group of full-precision tokens would not
        assert kivi_bytes(lm.info, n, knobs["bits"], 32, knobs["residual"] + 32) > target
        seen[budget] = knobs["bits"]
    assert seen == {"0.5": 4, "0.25": 4, "0.125": 2}


def test_full_budget_is_exact_and_more_bits_is_closer(lm, prefill_state):
    layer, state = 7, prefill_state
    q = state.queries[layer, :, -1:]
    ref = dense_attention(q, state.keys[layer], state.values[layer], state.scaling)
    full, knobs = _kivi(lm, state, "1.0")
    assert knobs["quantized_tokens"] == 0 and torch.equal(full.attend(layer, q), ref)
    errs = {}
    for bits in (2, 4):
        comp, _ = _kivi(lm, state, bits=bits, residual=0)
        errs[bits] = ((comp.attend(layer, q) - ref).norm() / ref.norm()).item()
    assert errs[4] < errs[2] / 2 and errs[4] < 0.15, errs
