"""AdaKV: the joint top-k with its safeguard on hand-checked scores, the ragged cache on a real prefill,
and the method through the engine holding SnapKV's bytes in both question protocols."""

import pytest
import torch
from kv_samples import compressed, new_token

from kvlab.core import semantics as sm
from kvlab.core.budgets import TOLERANCE, Budget, exact_bytes
from kvlab.engine.specs import GenerationSettings, Question, RunSpec
from kvlab.methods import get
from kvlab.methods.adakv import joint_allocation, ranked_keep
from kvlab.methods.params import ParamError
from kvlab.methods.registry import UnknownMethodError

# three heads of four tokens: head 0 spreads its attention, head 1 puts it on two tokens, head 2 on none
SCORES = torch.tensor(
    [
        [[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.01, 0.0], [0.03, 0.02, 0.01, 0.0]],
        [[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.01, 0.0], [0.03, 0.02, 0.01, 0.0]],
    ]
)


@pytest.mark.parametrize(
    "alpha, expect",
    [
        # joint top 6 (B = 2): head 0's four, head 1's two -> f = (4, 2, 0); B = 1: top 3 all head 0's
        (0.0, [[4, 2, 0], [3, 0, 0]]),
        # 0.3 * 2 + 0.7 * f = (3.4, 2.0, 0.6): floors (3, 2, 0), the one left goes to the largest remainder
        (0.3, [[3, 2, 1], [3, 0, 0]]),  # B = 1: (2.4, 0.3, 0.3) -> (3, 0, 0)
        (0.5, [[3, 2, 1], [2, 1, 0]]),  # B = 1: (2.0, 0.5, 0.5): a tie, the first head of it wins
        (1.0, [[2, 2, 2], [1, 1, 1]]),  # SnapKV's uniform budgets
    ],
)
def test_joint_allocation_by_hand(alpha, expect):
    budgets = joint_allocation(SCORES, torch.tensor([2, 1]), alpha)
    assert budgets.tolist() == expect
    assert budgets.sum(-1).tolist() == [6, 3]


def test_each_head_keeps_its_best_and_alpha_zero_is_the_joint_top():
    keep = ranked_keep(SCORES, torch.tensor([[3, 2, 1], [4, 2, 0]]))
    assert keep[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]
    joint = torch.zeros(12, dtype=torch.bool)
    joint[torch.topk(SCORES[0].reshape(-1), 6).indices] = True  # layer 0's top H x B = 6, all heads at once
    pure = ranked_keep(SCORES, joint_allocation(SCORES, torch.tensor([2, 1]), 0.0))
    assert torch.equal(pure[0], joint.view(3, 4))


def _kept_scores(comp, layer, scores, m):
    """The scores of the prefix tokens each head of ``layer`` holds, sorted per head, head after head."""
    pos = comp.kept_positions(layer).long()
    return torch.cat([scores[h][p[p < m]].sort().values for h, p in enumerate(pos)])


def test_real_prefill_allocation_and_ragged_cache(lm, prefill_state):
    """On a real prefill: alpha 0 keeps exactly the joint top of SnapKV's scores, alpha 1 exactly SnapKV's
    tokens; the default's heads hold different counts summing to SnapKV's, at SnapKV's bytes (+ the counts)."""
    state, n, h = prefill_state, prefill_state.n_tokens, lm.info.n_kv_heads
    snap, knobs = compressed(lm, state, "snapkv", "0.25")
    w, b = knobs["window"], knobs["prefix_kept"]
    scores = snap.scores(state)  # [L, Hkv, n - w]
    uniform, _ = compressed(lm, state, "ada-snapkv", "0.25", alpha=1.0)
    pure, _ = compressed(lm, state, "ada-snapkv", "0.25", alpha=0.0)
    ada, ada_knobs = compressed(lm, state, "ada-snapkv", "0.25")
    assert ada_knobs["alpha"] == 0.2 and ada_knobs["capacity"] == knobs["capacity"]
    for layer in (0, 14, 29):  # max-pooled votes tie: compare the scores of what is kept
        s = scores[layer]
        assert torch.equal(_kept_scores(uniform, layer, s, n - w), _kept_scores(snap, layer, s, n - w))
        joint = torch.topk(s.reshape(-1), h * b).values.sort().values
        assert torch.equal(_kept_scores(pure, layer, s, n - w).sort().values, joint), layer
    counts = ada.head_counts()
    assert (counts.sum(-1) == h * knobs["capacity"]).all()
    assert (counts.min(-1).values < counts.max(-1).values).sum() >= 25  # heads differ in nearly every layer
    assert counts.min() >= w + int(0.2 * b)  # the safeguard and the window
    assert ada.nbytes() == snap.nbytes() + lm.info.n_layers * h * 4  # ragged, not padded: + one int32 per head
    # decoding appends to every head; attention over the ragged cache is attention over what each head holds
    for step in range(2):
        k, v = new_token(state, 7, step)
        ada.append(7, k, v, n + step)
    q = state.queries[7, :, -1:]
    out = ada.attend(7, q)
    held = ada.layers[7]
    g = lm.info.n_heads // h
    for head, (ks, vs) in enumerate(zip(held.k.split(held.counts.tolist()), held.v.split(held.counts.tolist()))):
        tk, tv = held.tail.views()[0][head], held.tail.views()[1][head]
        ref = sm.attend(
            q[head * g : (head + 1) * g], torch.cat([ks, tk])[None], torch.cat([vs, tv])[None], state.scaling
        )
        torch.testing.assert_close(out[head * g : (head + 1) * g], ref, atol=1e-5, rtol=1e-4)


def test_a_chunk_equals_token_by_token(lm, prefill_state):
    state, n = prefill_state, prefill_state.n_tokens
    chunk, steps = (compressed(lm, state, "ada-snapkv", "0.25")[0] for _ in range(2))
    ks, vs = zip(*(new_token(state, 3, s) for s in range(4)))
    k, v, q = torch.cat(ks, 1), torch.cat(vs, 1), state.queries[3, :, -4:]
    got = chunk.feed(3, q, k, v, n)
    ref = []
    for i in range(4):
        steps.append(3, k[:, i : i + 1], v[:, i : i + 1], n + i)
        ref.append(steps.attend(3, q[:, i : i + 1]))
    torch.testing.assert_close(got, torch.cat(ref, 1), atol=1e-5, rtol=1e-4)
    assert chunk.nbytes() == steps.nbytes()


def test_names_resolve_and_refuse(lm):
    """``ada-NAME`` wraps any prompt-time scorer; streaming methods, compositions and ``ada-ada-`` do not resolve,
    and storing the ragged cache compressed is refused by name, with the reason."""
    pyr = get("ada-pyramidkv")
    assert pyr == get("ada-pyramidkv") and pyr.inner is get("pyramidkv") and pyr.group == "recent"
    assert get("ada-knorm").inner is get("knorm") and [p.name for p in get("ada-knorm").params][-1] == "alpha"
    for bad in ("ada-tova", "ada-streaming", "ada-ada-snapkv", "ada-snapkv+kivi2x", "ada-nope", "ada-kvzip"):
        with pytest.raises(UnknownMethodError):
            get(bad)
    with pytest.raises(ParamError, match="ada-snapkv cannot be composed: its heads hold different token counts"):
        get("ada-snapkv+kivi2")


def test_holds_snapkvs_bytes_with_a_question_after_compression(engine, lm, long_text):
    """Through the engine, the question fed after compression (the query-agnostic protocol; the shared
    matrices run the query-aware one): SnapKV's bytes at every step plus the counts, within the budget."""
    ids = lm.encode(long_text[:1200])
    specs = [RunSpec("snapkv", Budget.parse("0.25")), RunSpec("ada-snapkv", Budget.parse("0.25"))]
    question = Question(lm.encode(" What does the assert statement do?"))
    snap, ada = engine.compare(ids, specs, GenerationSettings(max_new_tokens=4), questions=[question]).runs
    assert not ada.error and len(ada.token_ids) == 4 and len(ada.kv_bytes_per_step) >= 3
    counts = lm.info.n_layers * lm.info.n_kv_heads * 4
    assert [b - counts for b in ada.kv_bytes_per_step] == snap.kv_bytes_per_step
    assert ada.kv_bytes_per_step[0] <= 0.25 * exact_bytes(lm.info, len(ids)) * (1 + TOLERANCE)
