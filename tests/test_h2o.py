"""H2O against attention computed independently (eager attention weights of the real model)."""

import pytest
import torch

from kvlab.core.budgets import Budget, exact_bytes
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import budget_search, get


@pytest.fixture(scope="module")
def eager_acc(lm, long_text):
    """Attention each prompt key receives summed over all prompt queries, from the model's own eager
    attention weights: [L, Hq, n]."""
    model = lm.model
    ids = lm.encode(long_text[:3000])
    old = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False, logits_to_keep=1)
    finally:
        model.config._attn_implementation = old
    return torch.stack([a[0].float().sum(-2) for a in out.attentions])


def test_prefill_keeps_heavy_hitters_and_recent_window(prefill_state, eager_acc, lm):
    n = prefill_state.n_tokens
    info = lm.info
    assert eager_acc.shape == (info.n_layers, info.n_heads, n)
    comp = get("h2o")(lm.info, Budget.parse("0.25"))
    knobs = budget_search.planned(comp, n)
    cap, heavy, recent = knobs["capacity"], knobs["heavy"], knobs["recent"]
    per_head = info.n_layers * info.n_kv_heads
    assert cap == int(0.25 * exact_bytes(info, n) / per_head // (info.head_dim * 2 * 2 + 4 + 4))  # 16-bit K and V
    assert heavy + recent == cap and abs(heavy - recent) <= 1
    comp.compress(prefill_state)
    pooled = eager_acc.view(info.n_layers, info.n_kv_heads, info.group_size, n).sum(2)  # each KV group's query heads
    for layer in range(info.n_layers):
        pos = comp.kept_positions(layer).long()
        for h in range(info.n_kv_heads):
            older = pooled[layer, h, : n - recent]
            top = torch.topk(older, heavy).indices
            expected = set(top.tolist()) | set(range(n - recent, n))
            got = set(pos[h].tolist())
            if got != expected:  # only an exchange at a numerical tie at the boundary is allowed
                ranked = older.sort(descending=True).values
                gap = (ranked[heavy - 1] - ranked[heavy]).abs()
                assert gap < 1e-4 and len(got ^ expected) == 2, f"layer {layer} head {h}"
        # its scores are the accumulated attention of the kept tokens
        torch.testing.assert_close(comp.scores[layer], torch.gather(pooled[layer], -1, pos), rtol=1e-4, atol=1e-3)


def test_decode_evicts_lowest_score_outside_recent_and_accumulates(prefill_state, lm):
    comp = get("h2o")(lm.info, Budget.parse("64t"))
    knobs = budget_search.planned(comp, prefill_state.n_tokens)
    comp.compress(prefill_state)
    n, recent = prefill_state.n_tokens, knobs["recent"]
    g = torch.Generator().manual_seed(1)
    info, layer = lm.info, 5
    hkv, hq, d = info.n_kv_heads, info.n_heads, info.head_dim
    for step in range(6):
        before_pos = comp.kept_positions(layer).clone()
        before = comp.scores[layer].clone()
        k = prefill_state.keys[layer, :, -1:] + 0.1 * torch.randn(hkv, 1, d, generator=g)
        comp.append(layer, k, prefill_state.values[layer, :, -1:], n + step)
        # the evicted token: the lowest score among the tokens that are not in the new recent window
        out_of_recent = before[:, : before.shape[1] - recent + 1]
        victim = torch.gather(before_pos, 1, out_of_recent.argmin(1, keepdim=True))
        pos = comp.kept_positions(layer)
        assert pos.shape == (hkv, 64)  # the 64-token budget
        assert not torch.isin(victim, pos).any() and (pos[:, -1] == n + step).all()
        kept_before = comp.scores[layer].clone()
        q = prefill_state.queries[layer, :, -1:] + 0.1 * torch.randn(hq, 1, d, generator=g)
        comp.attend(layer, q)
        keys = comp.layers[layer].views()[0].float().repeat_interleave(info.group_size, dim=0)  # [Hq, n, d]
        probs = torch.softmax((q @ keys.transpose(1, 2)).squeeze(1) * d**-0.5, -1)  # [Hq, n]
        pooled = probs.view(hkv, info.group_size, -1).sum(1)
        torch.testing.assert_close(comp.scores[layer] - kept_before, pooled, rtol=0, atol=1e-4)


def test_holds_budget_while_decoding(engine, lm, long_text):
    ids = lm.encode(long_text[:1200])
    res = engine.compare(ids, [RunSpec("h2o", Budget.parse("0.25"))], GenerationSettings(max_new_tokens=8))
    r = res.runs[0]
    target = 0.25 * exact_bytes(lm.info, len(ids))
    assert len(r.kv_bytes_per_step) == len(r.token_ids) > 4
    assert all(b == r.kv_bytes for b in r.kv_bytes_per_step)
    assert target * 0.97 <= r.kv_bytes <= target
    assert r.kv_bytes_breakdown["scores"] == r.params["capacity"] * 4 * lm.info.n_layers * lm.info.n_kv_heads


def test_full_budget_is_exact(engine, lm):
    ids = lm.encode("Write a haiku about autumn leaves.")
    runs = [RunSpec("exact"), RunSpec("h2o", Budget.parse("1.0")), RunSpec("scissorhands", Budget.parse("1.0"))]
    res = engine.compare(ids, runs, GenerationSettings(max_new_tokens=6))
    for r in res.runs[1:]:
        assert r.token_ids == res.runs[0].token_ids
        assert r.kv_bytes_per_step == res.runs[0].kv_bytes_per_step
