"""SimLayerKV (and the split it shares with DuoAttention) against hand-made counts and, on a real prefill,
the lazy share computed plainly from the last query's attention."""

import torch
from kv_samples import compressed

from kvlab.core.budgets import exact_bytes
from kvlab.methods.sink_recent import split_counts


def test_split_by_hand():
    """Units of 10, 10, 10 and 4 tokens, a window of 3, 25 tokens in all, units 2 then 0 stream first: two
    must stream (each saves 7; 9 are needed); the 5 left widen their windows, 3 and 2."""
    counts, streaming = split_counts(torch.tensor([10, 10, 10, 4]), torch.tensor([2, 0, 1, 3]), 25, 3)
    assert counts.tolist() == [5, 10, 6, 4] and streaming.tolist() == [True, False, True, False]
    counts, streaming = split_counts(torch.tensor([10, 10, 10, 4]), torch.tensor([2, 0, 1, 3]), 40, 3)
    assert counts.tolist() == [10, 10, 10, 4] and not streaming.any()  # everything fits
    counts, _ = split_counts(torch.tensor([10, 10, 10, 4]), torch.tensor([3, 0, 1, 2]), 9, 3)
    assert counts.tolist() == [3, 3, 3, 3] and int(counts.sum()) <= 12  # all stream; unit 3 saves nothing


def test_real_prefill_lazy_layers(lm, prefill_state):
    state, info, n = prefill_state, lm.info, prefill_state.n_tokens
    comp, knobs = compressed(lm, state, "simlayerkv", "0.25")
    s, r = knobs["n_sink"], knobs["n_recent"]
    assert s == 4 and 0 < r < 1024  # 4 + 1024 shrunk to half a layer's share of the budget, the 4 sinks kept
    # the lazy share by hand: the last query's attention, heads averaged, on the first s and last r tokens
    q, k = state.queries[:, :, -1:].float(), state.keys.float()
    k = k.repeat_interleave(info.n_heads // info.n_kv_heads, dim=1)
    probs = torch.softmax(q @ k.transpose(-1, -2) * state.scaling, dim=-1)[:, :, 0].mean(1)  # [L, n]
    share = probs[:, :s].sum(-1) + probs[:, n - r :].sum(-1)
    torch.testing.assert_close(comp.lazy_shares, share, atol=1e-5, rtol=1e-4)
    counts = comp.head_counts()  # [L, Hkv]
    assert (counts == counts[:, :1]).all()  # a layer's heads alike
    lazy = counts[:, 0] < n
    assert 0 < int(lazy.sum()) < info.n_layers
    assert share[lazy].min() >= share[~lazy].max()  # the laziest layers
    assert int(counts.sum()) == knobs["tokens"]  # the budget's tokens, all used
    for layer in torch.nonzero(lazy).flatten().tolist():
        kept = comp.kept_positions(layer)[0].tolist()
        c = int(counts[layer, 0])
        assert kept == list(range(s)) + list(range(n - (c - s), n))  # sinks + a recent window (widened by the slack)
    assert comp.nbytes() <= 0.25 * exact_bytes(info, n) * 1.001


def test_the_papers_threshold_with_the_budget_as_a_cap(lm, prefill_state):
    """``lazy_threshold``: the layers whose share passes it are lazy and keep exactly sinks + recent (kvpress's
    press); a budget that binds makes more layers lazy, laziest first."""
    state, n = prefill_state, prefill_state.n_tokens
    roomy, knobs = compressed(lm, state, "simlayerkv", "0.99", lazy_threshold=0.9, window_share=1.0, n_recent=63)
    s, r = knobs["n_sink"], knobs["n_recent"]
    assert (s, r) == (4, 63)
    lazy = roomy.lazy_shares > 0.9
    assert 0 < int(lazy.sum()) < lm.info.n_layers
    counts = roomy.head_counts()[:, 0]
    assert torch.equal(counts < n, lazy) and (counts[lazy] == s + r).all()  # no widening
    tight, _ = compressed(lm, state, "simlayerkv", "0.25", lazy_threshold=0.9, n_recent=63)
    tight_lazy = tight.head_counts()[:, 0] < n
    assert int(tight_lazy.sum()) > int(lazy.sum()) and bool(tight_lazy[lazy].all())
    assert tight.nbytes() <= 0.25 * exact_bytes(lm.info, n) * 1.001
