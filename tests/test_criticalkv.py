"""CriticalKV against its own maths on a real prefill: W_o read from the model, the two stages written
plainly, the scorer's bytes."""

from dataclasses import replace

import pytest
import torch
from kv_samples import compressed

from kvlab.engine.prefill import output_projections
from kvlab.methods import get


@pytest.fixture(scope="module")
def state(lm, prefill_state):
    """The shared ~600-token prefill with the model's output projections handed over."""
    return replace(prefill_state, out_proj=output_projections(lm))


def _o_proj(lm, layer):
    return lm.model.model.layers[layer].self_attn.o_proj.weight.detach().float()  # [hidden, Hq x dv]


def test_output_projections_are_the_models_weights(lm, state):
    info = lm.info
    assert len(state.out_proj) == info.n_layers
    for layer in (0, info.n_layers - 1):
        w = state.out_proj[layer]
        assert w.shape == (_o_proj(lm, layer).shape[0], info.n_heads, info.v_head_dim)
        assert w.data_ptr() == lm.model.model.layers[layer].self_attn.o_proj.weight.data_ptr()  # a view, not a copy
        h = 4
        torch.testing.assert_close(
            w[:, h].float(), _o_proj(lm, layer)[:, h * info.v_head_dim : (h + 1) * info.v_head_dim]
        )


def test_two_stages_on_a_real_prefill(lm, state):
    """Each head keeps the window, the scorer's best int(0.5 x capacity) - window tokens, and then the best by
    (score + epsilon) x mean over its query heads of ||W_o[:, h] v||_1, written token by token here."""
    info, n = lm.info, state.n_tokens
    snap, snap_knobs = compressed(lm, state, "snapkv", "0.25")
    crit, knobs = compressed(lm, state, "criticalkv-snapkv", "0.25")
    assert knobs["capacity"] == snap_knobs["capacity"] and knobs["first_stage_ratio"] == 0.5
    assert crit.nbytes() == snap.nbytes()  # the scorer's count in every head
    cap, window, eps = knobs["capacity"], knobs["window"], knobs["critical_epsilon"]
    budget, first = cap - window, int(0.5 * cap) - window
    scores = snap.scores(state)  # [L, Hkv, n - window]
    g, dv = info.n_heads // info.n_kv_heads, info.v_head_dim
    differs = 0
    for layer in (0, 13, info.n_layers - 1):
        w = _o_proj(lm, layer)
        kept = crit.kept_positions(layer).long()
        assert kept.shape == (info.n_kv_heads, cap)
        for head in range(info.n_kv_heads):
            s = scores[layer, head].tolist()
            v = state.values[layer, head, : n - window].float()  # [m, dv]
            norm = sum((v @ w[:, q * dv : (q + 1) * dv].T).abs().sum(-1) for q in range(head * g, (head + 1) * g)) / g
            stage1 = sorted(range(n - window), key=lambda j: (-s[j], j))[:first]
            rest = [j for j in range(n - window) if j not in set(stage1)]
            second = {j: (s[j] + eps) * float(norm[j]) for j in rest}
            got = set(kept[head].tolist())
            assert set(range(n - window, n)) <= got and set(stage1) <= got, (layer, head)
            picked = got - set(stage1) - set(range(n - window, n))
            assert len(picked) == budget - first
            left = [second[j] for j in rest if j not in picked]
            assert min(second[j] for j in picked) >= max(left) * (1 - 1e-5), (layer, head)  # the best, up to rounding
            snap_kept = set(snap.kept_positions(layer)[head].tolist())
            differs += len(got - snap_kept)
    assert differs > 0  # the second stage changes SnapKV's choice


def test_all_in_the_first_stage_is_the_scorer(lm, state):
    """first_stage_ratio 1: SnapKV's choice (its max-pooled votes tie: the kept tokens' scores are compared)."""
    snap, knobs = compressed(lm, state, "snapkv", "0.25")
    crit, _ = compressed(lm, state, "criticalkv-snapkv", "0.25", first_stage_ratio=1.0)
    scores, m = snap.scores(state), state.n_tokens - knobs["window"]
    for layer in (0, lm.info.n_layers - 1):
        for head, (a, b) in enumerate(zip(crit.kept_positions(layer).long(), snap.kept_positions(layer).long())):
            s = scores[layer, head]
            assert torch.equal(s[a[a < m]].sort().values, s[b[b < m]].sort().values)


def test_names_and_defaults():
    ea = get("criticalkv-expected-attention")
    assert ea.defaults()["use_vnorm"] is False  # kvpress's pairing: ||W_o v|| replaces the value norm
    assert get("criticalkv-knorm").inner is get("knorm") and get("criticalkv-snapkv").group == "recent"
