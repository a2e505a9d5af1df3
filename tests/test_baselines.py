"""Baselines (StreamingLLM, uniform, SnapKV, PyramidKV) on a real prefill of the embedded model."""

import pytest
import torch

from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.methods import budget_search, get
from kvlab.methods.pyramidkv import pyramid_budgets


def _make(lm, name, budget, **params):
    comp = get(name)(lm.info, Budget.parse(budget), params)
    return comp, comp.plan


def _compressed(lm, state, name, budget, **params):
    comp = get(name)(lm.info, Budget.parse(budget), params)
    knobs = budget_search.planned(comp, state.n_tokens)
    comp.compress(state)
    return comp, knobs


def _kept(comp, layer):
    return comp.kept_positions(layer).tolist()


def test_streaming_keeps_sinks_and_window(lm, prefill_state):
    n = prefill_state.n_tokens
    comp, knobs = _compressed(lm, prefill_state, "streaming", "0.25", n_sink=4)
    sink, window = knobs["n_sink"], knobs["window"]
    expect = list(range(sink)) + list(range(n - window, n))
    for layer in (0, 17, 29):
        assert all(row == expect for row in _kept(comp, layer))
    k = torch.randn(lm.info.n_kv_heads, 1, lm.info.head_dim)
    for step in range(3):  # one eviction per new token: the window slides, the sinks stay
        comp.append(0, k, k, n + step)
    expect = list(range(sink)) + list(range(n - window + 3, n + 3))
    assert all(row == expect for row in _kept(comp, 0))


def _direct_snapkv(state, layer, head, window, kernel, group):
    """SnapKV's votes for one layer / KV head, written out plainly: per query head, per window query,
    a causal softmax; summed over the window; max-pooled over neighbours; summed over the group."""
    n = state.n_tokens
    k = state.keys[layer, head].float()  # [n, d]
    total = torch.zeros(n - window)
    for qh in range(head * group, (head + 1) * group):
        votes = torch.zeros(n - window)
        for j, q in enumerate(state.queries[layer, qh, -window:].float()):
            logits = (k[: n - window + j + 1] @ q) * state.scaling
            votes += torch.softmax(logits, 0)[: n - window]
        total += torch.stack([votes[max(0, i - kernel // 2) : i + kernel // 2 + 1].max() for i in range(n - window)])
    return total


def test_snapkv_matches_direct_computation(lm, prefill_state):
    comp, knobs = _compressed(lm, prefill_state, "snapkv", "0.25")
    assert knobs["window"] == 32 and knobs["capacity"] == knobs["window"] + knobs["prefix_kept"]
    for layer, head in ((0, 0), (13, 2), (29, 1)):
        got = _kept(comp, layer)[head]
        votes = _direct_snapkv(prefill_state, layer, head, 32, 7, lm.info.group_size)
        n, w = prefill_state.n_tokens, knobs["window"]
        assert len(got) == knobs["capacity"] and got[-w:] == list(range(n - w, n))
        # max-pooling makes plateaus of equal votes, so compare as "a top-k of the direct votes":
        # every kept prefix token scores at least as high as every dropped one
        chosen = torch.zeros(n - w, dtype=torch.bool)
        chosen[got[:-w]] = True
        assert chosen.sum() == knobs["prefix_kept"]
        assert votes[chosen].min() >= votes[~chosen].max() - 1e-5, (layer, head)


def test_snapkv_pooling_changes_choice(lm, prefill_state):
    pooled, _ = _compressed(lm, prefill_state, "snapkv", "0.25")
    plain, _ = _compressed(lm, prefill_state, "snapkv", "0.25", kernel=1)
    assert _kept(pooled, 5) != _kept(plain, 5)


def test_uniform_keeps_ends_and_count(lm, prefill_state):
    n = prefill_state.n_tokens
    comp, knobs = _compressed(lm, prefill_state, "uniform", "0.25", n_first=8, n_last=16)
    first, last, cap = knobs["first"], knobs["last"], knobs["capacity"]
    assert (first, last) == (8, 16) and knobs["sampled"] == cap - 24
    rows = [row for layer in range(lm.info.n_layers) for row in _kept(comp, layer)]
    for row in rows:
        assert len(row) == len(set(row)) == cap
        assert row[:first] == list(range(first)) and row[-last:] == list(range(n - last, n))
        assert all(first <= p < n - last for p in row[first:-last])
    assert len({tuple(r) for r in rows}) > len(rows) // 2  # independent draws per layer and head
    again, _ = _compressed(lm, prefill_state, "uniform", "0.25", n_first=8, n_last=16)
    assert _kept(again, 3) == _kept(comp, 3)  # seeded


def test_uniform_middle_is_uniform(lm, prefill_state):
    """Over all layers and heads, the sampled middle positions spread evenly (no bias to an end)."""
    n = prefill_state.n_tokens
    comp, knobs = _compressed(lm, prefill_state, "uniform", "0.25", n_first=0, n_last=0)
    pos = torch.tensor([p for layer in range(lm.info.n_layers) for row in _kept(comp, layer) for p in row]).float()
    assert abs(pos.mean().item() / (n - 1) - 0.5) < 0.03


def test_pyramid_budgets_decrease_and_sum():
    b = pyramid_budgets(30 * 100, 30, 20.0, cap=10_000)
    assert sum(b) == 3000 and b[0] > b[-1] and all(x >= y for x, y in zip(b, b[1:]))
    assert b[-1] == 5 and b[0] == 195  # 100/20 at the top, 2*100 - 100/20 at the bottom
    clipped = pyramid_budgets(30 * 100, 30, 20.0, cap=150)  # a prompt too short for the bottom layers
    assert sum(clipped) == 3000 and max(clipped) == 150 and all(x >= y for x, y in zip(clipped, clipped[1:]))


def test_pyramidkv_layers_shrink_with_depth(lm, prefill_state):
    comp, knobs = _compressed(lm, prefill_state, "pyramidkv", "0.25")
    sizes = [len(_kept(comp, layer)[0]) for layer in range(lm.info.n_layers)]
    assert sizes == knobs["layer_capacity"]
    assert sizes[0] > sizes[-1] and all(x >= y for x, y in zip(sizes, sizes[1:]))
    assert sum(sizes) == lm.info.n_layers * knobs["capacity"]  # same total as SnapKV at this budget
    snap, _ = _compressed(lm, prefill_state, "snapkv", "0.25")
    assert comp.nbytes() == snap.nbytes()
    # every layer keeps SnapKV's best tokens for its own size: the top layer's set is within SnapKV's
    top = len(_kept(comp, 29)[0])
    assert top < knobs["capacity"] and set(_kept(comp, 29)[0]) <= set(_kept(snap, 29)[0])


@pytest.mark.parametrize("name", ["uniform", "snapkv", "pyramidkv"])
def test_prefill_only_keeps_generated_tokens(lm, prefill_state, name):
    comp, knobs = _compressed(lm, prefill_state, name, "0.25")
    before = comp.nbytes()
    k = torch.randn(lm.info.n_kv_heads, 1, lm.info.head_dim)
    for step in range(4):
        comp.append(2, k, k, prefill_state.n_tokens + step)
    kept = _kept(comp, 2)[0]
    assert kept[-4:] == [prefill_state.n_tokens + s for s in range(4)]
    assert comp.nbytes() > before


def test_uniform_reweighted_estimate_is_unbiased(lm, prefill_state):
    """Each kept middle token carries log(n_middle / kept): over seeds, the weighted softmax
    denominator and numerator of the kept tokens average to the exact ones (unbiased), and the
    unweighted sample under-counts the middle's mass by that factor."""

    st, layer = prefill_state, 12
    q = st.queries[layer, :, -1:]  # [Hq, 1, d]
    logits = sm.logits(q.float(), st.keys[layer].float(), st.scaling)[:, 0]  # [Hq, n]
    shift = logits.amax(-1, keepdim=True)
    exact_den = torch.exp(logits - shift).sum(-1)
    g = lm.info.group_size
    vals = st.values[layer].float().repeat_interleave(g, 0)  # [Hq, n, d]
    exact_num = torch.einsum("hn,hnd->hd", torch.exp(logits - shift), vals)
    dens, nums, unweighted = [], [], []
    for seed in range(48):
        c = get("uniform")(lm.info, Budget.parse("0.25"), {"n_first": 16, "n_last": 16}, seed=seed)
        budget_search.planned(c, st.n_tokens)
        c.compress(st)
        k, v, pos, lw = c.layers[layer].views()
        assert lw is not None
        lg = sm.logits(q.float(), k.float(), st.scaling)[:, 0] + lw.repeat_interleave(g, 0)
        w = torch.exp(lg - shift)
        dens.append(w.sum(-1))
        nums.append(torch.einsum("hn,hnd->hd", w, v.float().repeat_interleave(g, 0)))
        unweighted.append(torch.exp(lg - lw.repeat_interleave(g, 0) - shift).sum(-1))
    den, num = torch.stack(dens).mean(0), torch.stack(nums).mean(0)
    assert ((den - exact_den).abs() / exact_den).max() < 0.05
    assert ((num - exact_num).norm(dim=-1) / exact_num.norm(dim=-1)).max() < 0.1
    # Unweighted, the middle's mass is under-counted by exactly the weight n_middle / kept: in
    # expectation the first/last tokens' mass plus the middle's mass times kept / n_middle. (How much
    # that lowers the denominator depends on the head's share of middle mass, small on sink-heavy heads.)
    n_mid = st.n_tokens - c.first - c.last
    p = torch.exp(logits - shift)
    ends = p[:, : c.first].sum(-1) + p[:, st.n_tokens - c.last :].sum(-1)
    expected = ends + p[:, c.first : st.n_tokens - c.last].sum(-1) * c.sampled / n_mid
    assert n_mid / c.sampled > 2
    got = torch.stack(unweighted).mean(0)
    assert ((got - expected).abs() / expected).max() < 0.05
    assert (got < exact_den).all() and (got < 0.8 * exact_den).any()


def test_uniform_reweight_knob(lm, prefill_state):
    off, _ = _compressed(lm, prefill_state, "uniform", "0.25", reweight=False)
    assert off.layers[0].views()[3] is None
    on, knobs = _compressed(lm, prefill_state, "uniform", "0.25")
    assert knobs["middle_weight"] > 1 and on.nbytes() <= 0.25 * exact_bytes(lm.info, prefill_state.n_tokens)
