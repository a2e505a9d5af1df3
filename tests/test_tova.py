"""TOVA against the paper's loop written plainly, on a real prefill, and holding its budget while decoding."""

import torch
from kv_samples import planned

from kvlab.core.budgets import Budget, exact_bytes
from kvlab.engine.specs import GenerationSettings, RunSpec


def _head_mean_attention(q, keys, info, scaling):
    """q [Hq, d], keys [Hkv, m, d] -> the softmax attention averaged over all Hq heads: [m]."""
    k = keys.float().repeat_interleave(info.group_size, dim=0)  # [Hq, m, d]
    return torch.softmax((k @ q.float().unsqueeze(-1)).squeeze(-1) * scaling, -1).mean(0)


def test_attends_to_the_reference_loops_tokens_step_for_step(lm, prefill_state):
    """The reference: a multi-state of m tokens per layer; the prompt reduced to the m tokens the last
    prompt query attends to most (heads averaged); then each step appends the new token, its query
    attends, and the least attended token is dropped. TOVA must attend to the same set every step."""
    info, state, layer = lm.info, prefill_state, 7
    n, steps = state.n_tokens, 6
    comp, knobs = planned(lm, "tova", "64t", n)
    m = knobs["multi_state"]
    assert knobs["capacity"] == 64 and m == 63
    comp.compress(state)
    # the prompt is ranked by the prefill's own attention; decode queries attend to the 16-bit cache
    first = _head_mean_attention(state.queries[layer, :, -1], state.keys[layer], info, state.scaling)
    cd = info.torch_cache_dtype
    keys = state.keys[layer].to(cd)  # [Hkv, n, d] as the cache holds them
    ref = sorted(torch.topk(first, m).indices.tolist())
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        k = state.keys[layer, :, -1 - step :][:, :1] + 0.3 * torch.randn(info.n_kv_heads, 1, info.head_dim, generator=g)
        v = state.values[layer, :, -1 - step :][:, :1]
        q = state.queries[layer, :, -2 - step :][:, :1] + 0.3 * torch.randn(info.n_heads, 1, info.head_dim, generator=g)
        comp.append(layer, k, v, n + step)
        keys = torch.cat([keys, k.to(cd)], 1)
        ref = ref + [n + step]  # the reference appends, then its query attends over ref
        pos = comp.kept_positions(layer).long()
        assert (pos == pos[0]).all(), "every KV head keeps the same tokens"
        assert pos[0].tolist() == ref, f"step {step}"
        comp.attend(layer, q)
        attn = _head_mean_attention(q[:, 0], keys[:, ref], info, state.scaling)
        # the scores TOVA holds are this attention, for every KV head
        torch.testing.assert_close(comp.scores[layer], attn.expand(info.n_kv_heads, -1), rtol=1e-3, atol=1e-6)
        ref.pop(int(attn.argmin()))  # the reference drops the least attended token


def test_prefill_keeps_the_last_querys_favourites(lm, prefill_state):
    state, info = prefill_state, lm.info
    comp, knobs = planned(lm, "tova", "0.25", state.n_tokens)
    comp.compress(state)
    probs = state.window_probs(1)[..., -1, :].float().mean(1)  # [L, n]
    cap = knobs["capacity"]
    for layer in (0, info.n_layers - 1):
        pos = comp.kept_positions(layer).long()
        assert pos.shape == (info.n_kv_heads, cap) and (pos == pos[0]).all()
        best = set(torch.topk(probs[layer, :-1], cap - 1).indices.tolist()) | {state.n_tokens - 1}
        assert set(pos[0].tolist()) == best


def test_holds_its_budget_while_decoding(engine, lm, long_text):
    ids = lm.encode(long_text[:800])
    r = engine.compare(ids, [RunSpec("tova", Budget.parse("0.25"))], GenerationSettings(max_new_tokens=6)).runs[0]
    target = 0.25 * exact_bytes(lm.info, len(ids))
    assert len(r.kv_bytes_per_step) == len(r.token_ids) == 6
    assert all(b == r.kv_bytes for b in r.kv_bytes_per_step)  # streaming: the same bytes at every step
    assert target * 0.97 <= r.kv_bytes <= target
    assert r.kv_bytes_breakdown["scores"] == r.params["capacity"] * 4 * lm.info.n_layers * lm.info.n_kv_heads
