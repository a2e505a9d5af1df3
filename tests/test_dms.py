"""DMS's threshold form on a real prefill: one ranking of every layer's and head's scores, the sliding window
and the scorer's window spared, the scorer's total kept; a given threshold keeps nothing below it."""

import torch
from kv_samples import compressed

from kvlab.core.budgets import exact_bytes


def _held(comp, layer, head):
    cache = comp.layers[layer]
    return cache.pos.split(cache.counts.tolist())[head].long()


def test_one_threshold_over_all_layers_and_heads(lm, prefill_state):
    state, info, n = prefill_state, lm.info, prefill_state.n_tokens
    snap, knobs = compressed(lm, state, "snapkv", "0.25")
    comp, dk = compressed(lm, state, "dms-snapkv", "0.25")
    w, cap = dk["sliding_window"], knobs["capacity"]
    assert w == 128 < cap
    scores = snap.scores(state)[..., : n - w]  # [L, Hkv, n - w]: the tokens that may be evicted
    total = info.n_layers * info.n_kv_heads * (cap - w)
    counts = comp.head_counts()
    assert int(counts.sum()) == info.n_layers * info.n_kv_heads * cap and counts.max() > counts.min()
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    for layer in range(info.n_layers):
        for head in range(info.n_kv_heads):
            pos = _held(comp, layer, head)
            assert set(range(n - w, n)) <= set(pos.tolist())  # the sliding window
            kept[layer, head, pos[pos < n - w]] = True
    assert int(kept.sum()) == total
    threshold = scores[kept].min()
    assert threshold >= scores[~kept].max()  # one threshold: every kept score above every evicted one
    assert comp.nbytes() == snap.nbytes() + info.n_layers * info.n_kv_heads * 4
    assert comp.nbytes() <= 0.25 * exact_bytes(info, n) * 1.05


def test_a_given_threshold_caps_within_the_budget(lm, prefill_state):
    state, n = prefill_state, prefill_state.n_tokens
    snap, _ = compressed(lm, state, "snapkv", "0.25")
    scores = snap.scores(state)[..., : n - 128]
    high = float(scores.flatten().quantile(0.99))
    comp, _ = compressed(lm, state, "dms-snapkv", "0.25", threshold=high)
    for layer in (0, 29):
        for head in range(lm.info.n_kv_heads):
            pos = _held(comp, layer, head)
            assert (scores[layer, head, pos[pos < n - 128]] >= high).all()
    assert comp.nbytes() < snap.nbytes()  # fewer tokens score above it than the budget allows
