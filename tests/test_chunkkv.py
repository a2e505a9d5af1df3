"""ChunkKV and its entropy-gated variant: the chunk choice on hand-made scores, and on a real prefill against
the algorithm written plainly (chunk by chunk, as kvpress's presses loop)."""

import math

import torch
from kv_samples import compressed

from kvlab.methods.chunkkv import chunk_keep


def _kept(mask):
    return set(torch.nonzero(mask).flatten().tolist())


def test_chunks_by_hand():
    """Chunks of 4: means 1, 2.25 (one spike), 2. Six tokens: chunk 1 whole, then chunk 2's first two (ties:
    the earlier token). Gated (spiky chunks keep 1): chunk 1 is at/above the median mean with the lowest
    entropy, so it keeps its spike alone; chunk 2 whole; one token of chunk 0. A forced token (the scorer's
    window) puts its chunk first."""
    scores = torch.tensor([[1.0, 1, 1, 1, 0, 0, 9, 0, 2, 2, 2, 2]])
    none = torch.zeros(12, dtype=torch.bool)
    six = torch.tensor([6])
    assert _kept(chunk_keep(scores, none, six, 4)[0]) == {4, 5, 6, 7, 8, 9}
    assert _kept(chunk_keep(scores, none, six, 4, spiky=1)[0]) == {6, 8, 9, 10, 11, 0}
    forced = none.clone()
    forced[3] = True
    assert _kept(chunk_keep(scores, forced, six, 4)[0]) == {0, 1, 2, 3, 6, 4}  # then chunk 1: its spike, then 4
    # layers are independent, each with its own count
    two = torch.cat([scores, scores.flip(-1)])
    keep = chunk_keep(two, none, torch.tensor([4, 5]), 4)
    assert _kept(keep[0]) == {4, 5, 6, 7} and _kept(keep[1]) == {4, 5, 6, 7, 0}


def _reference(summed, forced, count, chunk, spiky=None):
    """The choice of one layer written plainly: summed [n] head-summed scores, forced [n] bool."""
    n = len(summed)
    s = summed.tolist()
    chunks = [list(range(i, min(i + chunk, n))) for i in range(0, n, chunk)]
    means = [sum(s[j] for j in c) / len(c) for c in chunks]
    has_forced = [any(bool(forced[j]) for j in c) for c in chunks]
    takes = [len(c) for c in chunks]
    if spiky is not None:
        ents = []
        for c in chunks:
            x = [s[j] for j in c]
            low = min(min(x), 0.0)
            x = [v - low for v in x]
            p = [v / (sum(x) + 1e-8) for v in x]
            h = -sum(q * math.log(q + 1e-8) for q in p)
            ents.append(0.0 if len(c) == 1 else min(1.0, max(0.0, h / math.log(len(c)))))
        med_m, med_e = sorted(means)[(len(means) - 1) // 2], sorted(ents)[(len(ents) - 1) // 2]  # lower medians
        takes = [
            min(t, spiky) if (m >= med_m and e < med_e and not f) else t
            for t, m, e, f in zip(takes, means, ents, has_forced)
        ]
    order = sorted(range(len(chunks)), key=lambda i: (not has_forced[i], -means[i], i))
    kept, left = set(), count
    for i in order:
        take = min(takes[i], left)
        kept |= set(sorted(chunks[i], key=lambda j: (-s[j], j))[:take])
        left -= take
    if left > 0:  # the gate's leftovers: the best tokens not kept
        kept |= set(sorted((j for j in range(n) if j not in kept), key=lambda j: (-s[j], j))[:left])
    return kept


def test_real_prefill_against_the_plain_algorithm(lm, prefill_state):
    state, n = prefill_state, prefill_state.n_tokens
    snap, knobs = compressed(lm, state, "snapkv", "0.25")
    scores = snap.scores(state)  # [L, Hkv, n - window]
    h, window, cap = lm.info.n_kv_heads, knobs["window"], knobs["capacity"]
    forced = torch.zeros(n, dtype=torch.bool)
    forced[n - window :] = True
    for name, spiky in (("chunkkv-snapkv", None), ("entropy-chunkkv-snapkv", 4)):
        comp, ck = compressed(lm, state, name, "0.25")
        assert ck["capacity"] == cap and ck["chunk_length"] == 10 and comp.nbytes() == snap.nbytes()
        for layer in (0, 11, lm.info.n_layers - 1):
            summed = torch.full((n,), float(h * (scores[layer].max() + 1)))
            summed[: n - window] = scores[layer].float().sum(0)
            expected = _reference(summed, forced, cap, 10, spiky)
            kept = comp.kept_positions(layer).long()
            assert all(set(row.tolist()) == expected for row in kept), (name, layer)  # every head alike
    plain, _ = compressed(lm, state, "chunkkv-snapkv", "0.25")
    gated, _ = compressed(lm, state, "entropy-chunkkv-snapkv", "0.25")
    assert any(not torch.equal(plain.kept_positions(i), gated.kept_positions(i)) for i in range(lm.info.n_layers))
