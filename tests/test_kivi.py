"""KIVI on the real prefill of the embedded model: error bounds, layout, bytes, residual, budget."""

import pytest
import torch

from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget, BudgetRefused, exact_bytes
from kvlab.methods import budget_search, get
from kvlab.methods.kivi import kivi_bytes


def _kivi(lm, state, budget="0.5", **params):
    comp = get("kivi")(lm.info, Budget.parse(budget), params)
    knobs = budget_search.planned(comp, state.n_tokens)
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
        # the residual is exact as the cache stores full-precision numbers: rounded to the 16-bit cache dtype
        # (held in it, read back widened to float32 without loss)
        cd, res = lm.info.torch_cache_dtype, comp.layers[layer]
        assert res.rk.view().dtype == res.rv.view().dtype == cd and k_hat.dtype == v_hat.dtype == torch.float32
        assert torch.equal(k_hat[:, nq:], k[:, nq:].to(cd).float())
        assert torch.equal(v_hat[:, nq:], v[:, nq:].to(cd).float())


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
        codes = comp.nbytes_by_kind()["keys_codes"] + comp.nbytes_by_kind()["values_codes"]
        coords = lm.info.n_layers * lm.info.n_kv_heads * knobs["quantized_tokens"] * lm.info.head_dim
        assert codes == 2 * coords * bits // 8  # 3-bit codes cost 3 bits (8 in 3 bytes)
    two, knobs = _kivi(lm, prefill_state, bits=2, residual=0)
    # against the 16-bit exact cache a quantized number costs (2 code bits + (16 + 16) / 32 bits of fp16 scale and
    # minimum) / 16 = 3/16, and the partial group left over (n - nq tokens) stays in 16 bits: 1 each. With n = 715,
    # nq = 704: (704 * 3/16 + 11) / 715 = 143 / 715 = 0.2 exactly.
    nq = knobs["quantized_tokens"]
    assert two.nbytes() * 16 * n == exact_bytes(lm.info, n) * (3 * nq + 16 * (n - nq))
    assert two.nbytes() < 0.201 * exact_bytes(lm.info, n)


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
    cd = lm.info.torch_cache_dtype  # newest token exact, as the cache stores it (16-bit)
    assert torch.equal(k_hat[:, -1:], k.to(cd).float()) and torch.equal(v_hat[:, -1:], v.to(cd).float())


def test_budget_maps_to_bits_and_residual(lm, prefill_state):
    # Against the 16-bit exact cache a budget fraction f buys 16 f bits per number. KIVI-B costs B code bits
    # (3 bits packed 8 in 3 bytes cost 3) + 32 / 32 bits of fp16 scale and minimum per group of 32: 5, 4 and 3 bits
    # for 4, 3 and 2. With the partial group (11 of n = 715 tokens) in 16 bits and no residual: KIVI-4 holds
    # (704 * 5/16 + 11) / 715 = 0.323 of exact, KIVI-3 (704 * 4/16 + 11) / 715 = 0.262, KIVI-2
    # (704 * 3/16 + 11) / 715 = 0.2. So 0.5 (8 bits) and 0.375 (6 bits) take 4 bits, 0.3 takes 3, 0.25 (4 bits)
    # takes 2, and 0.125 (2 bits) is below KIVI's smallest configuration.
    n = prefill_state.n_tokens
    seen = {}
    for budget in ("0.5", "0.375", "0.3", "0.25"):
        comp, knobs = _kivi(lm, prefill_state, budget)
        target = float(budget) * exact_bytes(lm.info, n)
        assert comp.nbytes() <= target and knobs["fits_budget"]
        # the residual is as long as fits: one more group of full-precision tokens would not
        assert kivi_bytes(lm.info, n, knobs["bits"], 32, knobs["residual"] + 32) > target
        seen[budget] = knobs["bits"]
    assert seen == {"0.5": 4, "0.375": 4, "0.3": 3, "0.25": 2}
    # no configuration holds 0.125: the plan refuses, naming the smallest budget that it can hold here
    with pytest.raises(BudgetRefused, match=r"kivi cannot fit budget 0.125 on a 715-token prompt") as refused:
        _kivi(lm, prefill_state, "0.125")
    smallest = refused.value.smallest
    assert 0.125 < smallest.fraction <= 0.25
    comp, knobs = _kivi(lm, prefill_state, smallest.label)
    assert knobs["bits"] == 2 and comp.nbytes() <= 1.05 * smallest.fraction * exact_bytes(lm.info, n)


def test_plan_holds_the_budget_while_the_residual_grows(lm, prefill_state):
    # between flushes the residual grows by up to group - 1 full-precision tokens: the plan leaves room for
    # them, so the bytes held just before the first flush still fit the budget's share of the tokens seen
    n, budget = prefill_state.n_tokens, Budget.parse("0.25")
    comp, knobs = _kivi(lm, prefill_state, "0.25")
    g, shape = knobs["group"], (lm.info.n_kv_heads, 1, lm.info.head_dim)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for step in range(g + 1):
        for layer in range(lm.info.n_layers):
            comp.append(layer, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), n + step)
        worst = max(worst, comp.nbytes() / budget.allowed_bytes(lm.info, n, step + 1, True))
    assert worst <= 1.0
    assert comp.layers[0].rk.n < knobs["residual"] + g  # a flush happened on the way


def test_full_budget_is_exact_and_more_bits_is_closer(lm, prefill_state):
    layer, state = 7, prefill_state
    q = state.queries[layer, :, -1:]
    cd = lm.info.torch_cache_dtype  # the exact cache as stored: 16-bit K/V
    ref = sm.attend(q, state.keys[layer].to(cd), state.values[layer].to(cd), state.scaling)
    full, knobs = _kivi(lm, state, "1.0")
    assert knobs["quantized_tokens"] == 0 and torch.equal(full.attend(layer, q), ref)
    errs = {}
    for bits in (2, 4):
        comp, _ = _kivi(lm, state, bits=bits, residual=0)
        errs[bits] = ((comp.attend(layer, q) - ref).norm() / ref.norm()).item()
    assert errs[4] < errs[2] / 2 and errs[4] < 0.15, errs


def test_forks_share_the_quantized_part_and_attend_together(lm, prefill_state, monkeypatch):
    """Forks of one compressed cache hold its quantized part itself and their own residual. One lockstep
    call (``attend_many``) dequantizes a shared part once and equals each fork's own ``attend``; a fork
    that flushed holds a part of its own."""
    import copy

    from kvlab.engine.batched_attention import attend_rows
    from kvlab.methods import kivi

    info, n = lm.info, prefill_state.n_tokens
    base, _ = _kivi(lm, prefill_state, "0.5", bits=2, residual=8, group=8)
    forks = [copy.deepcopy(base) for _ in range(2)] + [base]
    assert all(f.layers[3].kq is base.layers[3].kq for f in forks)
    assert len({id(f.layers[3].rk) for f in forks}) == 3
    g = torch.Generator().manual_seed(4)
    for f, steps in zip(forks, (2, 2, 9)):  # the last fork flushes a group
        for step in range(steps):
            for layer in range(info.n_layers):
                k, v = torch.randn(2, info.n_kv_heads, 1, info.head_dim, generator=g)
                f.append(layer, k.half(), v.half(), n + step)
    assert forks[0].layers[3].kq is forks[1].layers[3].kq is not forks[2].layers[3].kq
    calls = []
    real = kivi.dequantize_groups
    monkeypatch.setattr(kivi, "dequantize_groups", lambda x: calls.append(1) or real(x))
    q = torch.randn(len(forks), info.n_heads, 1, info.head_dim, generator=g)
    for layer in (0, 3):
        calls.clear()
        got = attend_rows(forks, layer, q)
        assert len(calls) == 2  # the shared part once, the flushed fork's own once
        for i, f in enumerate(forks):
            torch.testing.assert_close(got[i], f.attend(layer, q[i]), atol=1e-5, rtol=1e-4)
