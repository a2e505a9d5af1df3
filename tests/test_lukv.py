"""LU-KV: the loss curves, their convex hulls, the greedy and the rounding by hand; on the embedded model the
oracle against an exact prefill of context + later tokens, and each head keeping its best-scored tokens."""

import pytest
import torch
from kv_samples import compressed

from kvlab.engine.prefill import prefill
from kvlab.methods import PrefillNeeds
from kvlab.methods.lukv import apportion, convex_gains, eviction_curves, greedy_fractions

CALIB = {"calib_texts": 1, "calib_tokens": 160, "future": 32}  # a small profile: the test stays cheap


def test_curves_hulls_greedy_and_rounding_by_hand():
    # a head ranks 4 tokens 0, 1, 2, 3; later queries use them 0, 5, 1, 2: evicted importance at 0..4 kept
    curves = eviction_curves(torch.tensor([[[4.0, 3, 2, 1]]]), torch.tensor([[[0.0, 5, 1, 2]]]), 4)
    assert curves.tolist() == [[[8.0, 8.0, 3.0, 2.0, 0.0]]]
    # gains 0, 5, 1, 2; the lower convex hull of (0, 8) (2, 3) (4, 0): slopes 2.5, 2.5, 1.5, 1.5
    assert convex_gains(curves[0]).tolist() == [[2.5, 2.5, 1.5, 1.5]]
    # three steps to the largest gains: 3 (unit 0), then 2 and 2 (unit 1)
    assert greedy_fractions(torch.tensor([[3.0, 1.0], [2.0, 2.0]]), 3).tolist() == [0.5, 1.0]
    assert apportion(torch.tensor([1.0, 1.0, 2.0]), 7, 3).tolist() == [2, 2, 3]  # unit 2 capped, the rest shared
    assert apportion(torch.tensor([1.0, 2.0, 3.0]), 5, 10).tolist() == [1, 2, 2]  # largest remainders


@pytest.fixture(scope="module")
def state(lm, long_text):
    ids = lm.encode(long_text[:1600])
    return prefill(lm, ids, PrefillNeeds(query_window=32, model_access=True))[0]


def test_oracle_is_the_later_queries_largest_attention(lm, state):
    """``oracle`` runs the later tokens on the context's exact cache; an exact prefill of context + later
    tokens gives the same attention of those queries over the context."""
    comp, _ = compressed(lm, state, "lukv-snapkv", "0.25", **CALIB)
    context, future = state.model.prompt_ids[:120], state.model.prompt_ids[120:136]
    ctx = prefill(lm, context, PrefillNeeds(model_access=True))[0]
    got = comp.oracle(ctx.model, future, len(context))  # [L, Hkv, 120]
    whole = prefill(lm, context + future, PrefillNeeds(query_window=len(future)))[0]
    probs = whole.window_probs()[..., : len(context)]  # [L, Hq, 16, 120]
    g = lm.info.n_heads // lm.info.n_kv_heads
    expected = probs.amax(-2).view(lm.info.n_layers, lm.info.n_kv_heads, g, -1).amax(2)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)


def test_heads_keep_their_best_scored_tokens_within_the_scorers_total(lm, state):
    info, n = lm.info, state.n_tokens
    snap, knobs = compressed(lm, state, "snapkv", "0.25")
    comp, lk = compressed(lm, state, "lukv-snapkv", "0.25", **CALIB)
    assert lk["calib_tokens"] == 160 and lk["capacity"] == knobs["capacity"]
    counts = comp.head_counts()  # [L, Hkv]
    assert int(counts.sum()) == info.n_layers * info.n_kv_heads * knobs["capacity"]  # the scorer's total
    assert counts.max() > counts.min()  # spread unevenly over layers and heads
    assert comp.nbytes() == snap.nbytes() + info.n_layers * info.n_kv_heads * 4  # + each head's count
    scores, window = snap.scores(state), knobs["window"]
    for layer in (0, 15, info.n_layers - 1):
        for head in range(info.n_kv_heads):
            kept = comp.layers[layer].pos.split(comp.layers[layer].counts.tolist())[head].long()
            assert set(range(n - window, n)) <= set(kept.tolist())
            prefix = kept[kept < n - window]
            s = scores[layer, head]
            best = torch.topk(s, len(prefix)).values.sort().values
            assert torch.equal(s[prefix].sort().values, best)  # its best-scored tokens (ties: any of them)
    # the profile is computed once per model and scorer setting
    again, _ = compressed(lm, state, "lukv-snapkv", "0.25", **CALIB)
    assert torch.equal(again.head_counts(), counts)
