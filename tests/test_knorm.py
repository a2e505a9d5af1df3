"""KNorm against its own maths: the kept tokens are the keys of smallest L2 norm, per layer and KV head."""

import torch
from kv_samples import assert_holds_budget_on_model, compressed

from kvlab.core.budgets import exact_bytes
from kvlab.methods import PrefillState


def _state(keys: torch.Tensor, info) -> PrefillState:
    """A prefill state around hand-made keys [L, Hkv, n, d] (values: the keys; no queries needed)."""
    queries = torch.zeros(keys.shape[0], info.n_heads, 0, keys.shape[-1])
    return PrefillState(keys, keys.clone(), queries, info.head_dim**-0.5)


def test_keeps_the_smallest_norms_on_a_hand_made_cache(lm):
    info = lm.info
    L, h, d = info.n_layers, info.n_kv_heads, info.head_dim
    norms = torch.tensor([5.0, 1.0, 4.0, 2.0, 8.0, 3.0, 7.0, 6.0])  # smallest three: positions 1, 3, 5
    keys = torch.zeros(L, h, 8, d)
    for head in range(h):  # each head: the same norms rolled by its index, on a random direction
        direction = torch.nn.functional.normalize(torch.randn(d, generator=torch.Generator().manual_seed(head)), dim=0)
        keys[:, head] = norms.roll(head)[:, None] * direction
    comp, knobs = compressed(lm, _state(keys, info), "knorm", "3t", skip_layers=0)
    assert knobs["capacity"] == 3 and knobs["skip_layers"] == 0
    for layer in (0, L - 1):
        kept = comp.kept_positions(layer).tolist()
        assert kept == [sorted((i + head) % 8 for i in (1, 3, 5)) for head in range(h)]  # in position order

    comp, knobs = compressed(lm, _state(keys, info), "knorm", "3t", skip_layers=2, window=1)
    sizes = [comp.kept_positions(layer).shape[-1] for layer in range(L)]
    assert sizes[:2] == [8, 8] and sizes == knobs["layer_capacity"] and sum(sizes) <= L * 3
    # a compressed layer: its last prompt token (the window), then the smallest norms before it
    kept = comp.kept_positions(L - 1)[0].tolist()
    assert kept[-1] == 7 and kept[:-1] == sorted([1, 3, 5, 2][: len(kept) - 1])


def test_real_prefill_keeps_each_heads_smallest_key_norms(lm, prefill_state):
    """By default (kvpress's KnormPress) every layer is compressed alike; ``skip_layers=2`` (the reference
    code's example) keeps layers 0 and 1 whole and the others share what is left of the same bytes."""
    norms = prefill_state.keys.float().norm(dim=-1)  # [L, Hkv, n]
    n = prefill_state.n_tokens
    comp, knobs = compressed(lm, prefill_state, "knorm", "0.25")
    assert knobs["skip_layers"] == 0 and comp.cfg["skip_layers"] == 0
    for layer in (0, 1, 2, lm.info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        assert kept.shape == (lm.info.n_kv_heads, knobs["capacity"]) and knobs["capacity"] < n // 3
        assert torch.equal(kept, torch.topk(-norms[layer], knobs["capacity"], dim=-1).indices.sort(-1).values)
    assert comp.nbytes() <= 0.25 * exact_bytes(lm.info, n)

    comp, knobs = compressed(lm, prefill_state, "knorm", "0.25", skip_layers=2)
    assert knobs["skip_layers"] == 2
    for layer in (0, 1, 2, lm.info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        cap = knobs["layer_capacity"][layer]
        assert kept.shape == (lm.info.n_kv_heads, cap)
        expected = torch.topk(-norms[layer], cap, dim=-1).indices.sort(-1).values
        assert torch.equal(kept, expected) and (cap == n) == (layer < 2)
    assert comp.nbytes() <= 0.25 * exact_bytes(lm.info, n)


def test_holds_its_budget_in_bytes_on_the_model(engine, lm, long_text):
    assert_holds_budget_on_model(engine, lm, long_text[:800], "knorm")
