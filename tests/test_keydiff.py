"""KeyDiff against its own maths: the kept keys are the least similar (cosine) to the mean normalized key."""

import torch
from kv_samples import assert_holds_budget_on_model, compressed

from kvlab.core.budgets import exact_bytes
from kvlab.methods import PrefillState


def _state(keys: torch.Tensor, info) -> PrefillState:
    """A prefill state around hand-made keys [L, Hkv, n, d] (values: the keys; no queries needed)."""
    queries = torch.zeros(keys.shape[0], info.n_heads, 0, keys.shape[-1])
    return PrefillState(keys, keys.clone(), queries, info.head_dim**-0.5)


def test_keeps_the_keys_least_like_the_anchor_on_a_hand_made_cache(lm):
    """Six keys in the (e0, e1) plane: e0, 2 e0, 3 e0, e1, -e0 + 0.1 e1, e0 + e1. The anchor (mean of
    the unit keys) points along ~(0.83, 0.55); the two least similar are -e0 + 0.1 e1 (cos -0.77) and e1 (0.55)."""
    info = lm.info
    L, h, d = info.n_layers, info.n_kv_heads, info.head_dim
    plane = torch.tensor([[1.0, 0], [2, 0], [3, 0], [0, 1], [-1, 0.1], [1, 1]])
    keys = torch.zeros(L, h, 6, d)
    for head in range(h):  # each head: the same keys rolled by its index
        keys[:, head, :, :2] = plane.roll(head, dims=0)
    comp, knobs = compressed(lm, _state(keys, info), "keydiff", "2t")
    assert knobs["capacity"] == 2
    for layer in (0, L - 1):
        kept = comp.kept_positions(layer).tolist()
        assert kept == [sorted((i + head) % 6 for i in (3, 4)) for head in range(h)]


def test_real_prefill_keeps_the_least_similar_keys(lm, prefill_state):
    comp, knobs = compressed(lm, prefill_state, "keydiff", "0.25")
    keys = prefill_state.keys.double()  # [L, Hkv, n, d]
    unit = keys / keys.norm(dim=-1, keepdim=True)
    anchor = unit.mean(-2, keepdim=True)  # [L, Hkv, 1, d]
    cos = (unit * anchor).sum(-1) / anchor.norm(dim=-1)  # [L, Hkv, n]
    cap = knobs["capacity"]
    for layer in (0, lm.info.n_layers // 2, lm.info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        ref = cos[layer].sort(-1).values  # most dissimilar first
        for head in range(lm.info.n_kv_heads):
            got = cos[layer, head, kept[head]]
            # the kept set is the cap least similar: the same scores (ties at the boundary aside)
            assert (got <= ref[head, cap - 1] + 1e-6).all(), (layer, head)
    assert comp.nbytes() <= 0.25 * exact_bytes(lm.info, prefill_state.n_tokens)


def test_holds_its_budget_in_bytes_on_the_model(engine, lm, long_text):
    assert_holds_budget_on_model(engine, lm, long_text[:800], "keydiff")
