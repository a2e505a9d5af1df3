"""CurDKV against its own maths: a hand-made cache whose answer is known, and the real prefill scored by a plain
loop over the windows of 16 tokens (squared norms, each token's share of its window, key x value, normalised)."""

import torch
from kv_samples import compressed
from test_keydiff import _state


def test_keeps_the_largest_key_times_value_shares_on_a_hand_made_cache(lm):
    """Two windows of 4 (local_window=4), no sinks. Window 1: key norms^2 1, 1, 1, 1 and value norms^2 4, 1, 1, 2
    give shares 1/4 x (4/8, 1/8, 1/8, 2/8); window 2: keys 9, 1, 0, 0 and values 1, 1, 1, 1 give 9/10 x 1/4, 1/10 x
    1/4, 0, 0. Products: .125, .031, .031, .0625 | .225, .025, 0, 0 -> the best three: 4, 0, 3."""
    info = lm.info
    L, h, d = info.n_layers, info.n_kv_heads, info.head_dim
    k_norm2 = torch.tensor([1.0, 1, 1, 1, 9, 1, 0, 0])
    v_norm2 = torch.tensor([4.0, 1, 1, 2, 1, 1, 1, 1])
    keys, values = torch.zeros(L, h, 8, d), torch.zeros(L, h, 8, d)
    keys[..., 0], values[..., 1] = k_norm2.sqrt(), v_norm2.sqrt()
    state = _state(keys, info)
    state.values = values
    comp, knobs = compressed(lm, state, "curdkv", "3t", n_sink=0, local_window=4)
    assert knobs["capacity"] == 3
    assert comp.kept_positions(0).tolist() == [[0, 3, 4]] * h
    comp, _ = compressed(lm, state, "curdkv", "3t", n_sink=2, local_window=4)  # the sinks 0, 1, then the best: 4
    assert comp.kept_positions(L - 1).tolist() == [[0, 1, 4]] * h


def test_real_prefill_scores_match_the_window_loop(lm, prefill_state):
    state, w = prefill_state, 16
    k2 = state.keys.double().square().sum(-1)
    v2 = state.values.double().square().sum(-1)
    n = k2.shape[-1]
    ref = torch.zeros_like(k2)
    for start in range(0, n, w):  # each window's shares, the last one shorter
        end = min(n, start + w)
        ref[..., start:end] = (k2[..., start:end] / k2[..., start:end].sum(-1, keepdim=True)) * (
            v2[..., start:end] / v2[..., start:end].sum(-1, keepdim=True)
        )
    ref = ref / ref.sum(-1, keepdim=True)
    ref[..., :4] = 1.0
    comp, knobs = compressed(lm, state, "curdkv", "0.25")
    torch.testing.assert_close(comp.scores(state).double(), ref, rtol=1e-4, atol=1e-7)
    cap = knobs["capacity"]
    for layer in (0, lm.info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        assert (kept[:, :4] == torch.arange(4)).all()
        bound = ref[layer].sort(-1, descending=True).values[:, cap - 1 : cap]
        assert (ref[layer].gather(-1, kept) >= bound * (1 - 1e-5)).all()


def test_random_projection_is_seeded_and_changes_the_scores(lm, prefill_state):
    plain, _ = compressed(lm, prefill_state, "curdkv", "0.25")
    a, _ = compressed(lm, prefill_state, "curdkv", "0.25", random_projection=True)
    b, _ = compressed(lm, prefill_state, "curdkv", "0.25", random_projection=True)
    sa, sb = a.scores(prefill_state), b.scores(prefill_state)
    assert torch.equal(sa, sb) and not torch.allclose(sa, plain.scores(prefill_state))
    assert torch.isfinite(sa).all()
