"""CaM: StreamingLLM's cache with each evicted value merged into the values after it.

* The merge probability, written plainly: A_e / mean(A over the merge set), clamped to [0, 1]; 0 when
  neither got attention, 1 when only the evicted token did.
* On a real prefill: a step whose query attends to the evicted token as much as to its neighbours
  merges it (each of the m values after it gains exactly v_e / m); one that ignores it merges nothing;
  then the next append evicts it, as StreamingLLM does.
* Step by step beside StreamingLLM at the same budget: the same positions kept and the same keys at
  every step, values that differ once a token was merged, the same bytes; the same seed merges the
  same way.
"""

from __future__ import annotations

import torch
from kv_samples import compressed, new_token

from kvlab.methods.cam import merge_probability


def test_merge_probability():
    attn = torch.tensor([[0.2, 0.1, 0.3], [0.05, 0.1, 0.1], [0.0, 0.0, 0.0], [0.3, 0.0, 0.0]])
    p = merge_probability(attn, 0, slice(1, 3))
    torch.testing.assert_close(p, torch.tensor([1.0, 0.5, 0.0, 1.0]))


def test_a_merge_adds_the_evicted_value_to_the_next_m_values(lm, prefill_state):
    state = prefill_state
    comp, knobs = compressed(lm, state, "cam", "0.25", merge_budget=5)
    layer, cache = 2, comp.layers[2]
    e = knobs["start"]
    assert cache.n == comp.capacity and knobs["window"] == comp.capacity - e
    values = cache.views()[1].float().clone()
    h = values.shape[0]
    attn = torch.full((h, cache.n), 0.01)
    attn[0, e] = 0.02  # head 0: more than its neighbours (merged); head 1: none at all (kept apart)
    attn[1, e] = 0.0
    comp.merge_next(layer, attn)
    after = cache.views()[1].float()
    gained = values[0, e] / 5
    torch.testing.assert_close(after[0, e + 1 : e + 6], values[0, e + 1 : e + 6] + gained, atol=2e-3, rtol=1e-3)
    assert torch.equal(after[0, e + 6 :], values[0, e + 6 :]) and torch.equal(after[0, : e + 1], values[0, : e + 1])
    assert torch.equal(after[1], values[1])
    before = cache.positions().clone()
    k, v = new_token(state, layer, 0)
    comp.append(layer, k, v, state.n_tokens)  # the merged token leaves, the new one comes in
    pos = cache.positions()
    assert int(before[0, e]) not in pos[0].tolist() and int(pos[0, -1]) == state.n_tokens
    assert torch.equal(pos[:, :e], before[:, :e]) and cache.n == comp.capacity


def _trace(comp, state, steps: int) -> list:
    """``steps`` decode steps on layers 0 and 5; after each, those layers' (positions, keys, values)."""
    out = []
    for step in range(steps):
        for layer in (0, 5):
            k, v = new_token(state, layer, step)
            comp.append(layer, k, v, state.n_tokens + step)
            comp.attend(layer, state.queries[layer, :, -1 - step :][:, :1])
        out.append(
            [(comp.layers[i].positions().clone(), *(t.clone() for t in comp.layers[i].views()[:2])) for i in (0, 5)]
        )
    return out


def test_same_tokens_as_streamingllm_with_values_merged(lm, prefill_state):
    state, steps = prefill_state, 6
    cam, _ = compressed(lm, state, "cam", "0.25")
    stream, _ = compressed(lm, state, "streaming", "0.25", n_sink=cam.cfg["n_sink"], window=cam.cfg["window"])
    cam_trace, stream_trace = _trace(cam, state, steps), _trace(stream, state, steps)
    merged = False
    for a, b in zip(cam_trace, stream_trace):
        for (pa, ka, va), (pb, kb, vb) in zip(a, b):
            assert torch.equal(pa, pb) and torch.equal(ka, kb)
            merged |= not torch.equal(va, vb)
    assert merged and cam.nbytes() == stream.nbytes()
    again, _ = compressed(lm, state, "cam", "0.25")  # the same seed draws the same merges
    assert all(torch.equal(x[2], y[2]) for a, b in zip(cam_trace, _trace(again, state, steps)) for x, y in zip(a, b))
