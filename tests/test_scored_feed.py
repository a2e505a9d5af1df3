"""A chunk fed through a score-based eviction cache (Scissorhands, H2O) in blocks between evictions equals
feeding its tokens one decode step at a time: same outputs, same kept tokens, same scores."""

import copy

import pytest
import torch

from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.methods import PrefillState, budget_search, get
from kvlab.methods.base import Compressor

INFO = ModelInfo(
    id="synthetic", n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32, dtype="float32", device="cpu", max_positions=4096
)


def _state(n: int, w: int, g: torch.Generator) -> PrefillState:
    """A random prefill of n tokens with the last w queries and accumulated attention."""
    L, hq, hkv, d = INFO.n_layers, INFO.n_heads, INFO.n_kv_heads, INFO.head_dim
    keys = torch.randn(L, hkv, n, d, generator=g)
    values = torch.randn(L, hkv, n, d, generator=g)
    queries = 2.0 * torch.randn(L, hq, w, d, generator=g)
    acc = torch.rand(L, hq, n, generator=g) * torch.arange(n, 0, -1)  # earlier tokens were seen by more queries
    return PrefillState(keys, values, queries, d**-0.5, acc)


def _compressed(name: str, n: int, budget: Budget | None, params: dict, room: int, g: torch.Generator):
    comp = get(name)(INFO, budget, params)
    budget_search.planned(comp, n)
    comp.compress(_state(n, max(1, comp.prefill_needs(n).query_window), g))
    comp.capacity += room  # H2O's prefill always fills its capacity: room for a first block comes from here
    return comp


def _assert_close_outputs(out, ref):
    """Attention outputs [Hq, c, d] equal up to float32 rounding: 1e-6 per unit of the outputs' scale (the
    chunk's products run over more rows and keys, so their sums round apart by a few ulps)."""
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * max(1.0, ref.abs().max().item()))


CASES = {
    # Scissorhands drops m = B/2 at B + 1: a block of B/2 - 1 tokens after each eviction
    "scissorhands": ("scissorhands", 64, None, {"B": 24}, 0),
    "scissorhands-prompt-below-B": ("scissorhands", 16, None, {"B": 24}, 0),
    "scissorhands-small-m-cache-threshold": (
        "scissorhands",
        64,
        None,
        {"B": 24, "m_ratio": 0.1, "threshold": "cache"},
        0,
    ),
    # H2O evicts one token per new token once full: one block while there is room, then token by token
    "h2o": ("h2o", 64, Budget(tokens=24), {}, 9),
}


@pytest.mark.parametrize("case", CASES)
def test_chunk_in_blocks_equals_token_by_token(case):
    name, n, budget, params, room = CASES[case]
    g = torch.Generator().manual_seed(0)
    blocks = _compressed(name, n, budget, params, room, g)
    steps = copy.deepcopy(blocks)
    attends, evictions = [], []  # calls on the blocks' side: a lone token's attention, an eviction
    attend, evict = blocks.attend, blocks._evict
    blocks.attend = lambda layer, q: attends.append(layer) or attend(layer, q)
    blocks._evict = lambda layer, n_drop: evictions.append(layer) or evict(layer, n_drop)
    hq, hkv, d, c = INFO.n_heads, INFO.n_kv_heads, INFO.head_dim, 40
    for chunk in range(3):
        pos = n + chunk * c
        for layer in range(INFO.n_layers):
            q = 2.0 * torch.randn(hq, c, d, generator=g)
            k, v = torch.randn(hkv, c, d, generator=g), torch.randn(hkv, c, d, generator=g)
            out = blocks.feed(layer, q, k, v, pos)
            ref = Compressor.feed(steps, layer, q, k, v, pos)
            _assert_close_outputs(out, ref)
            assert torch.equal(blocks.kept_positions(layer), steps.kept_positions(layer)), (chunk, layer)
            assert blocks.layers[layer].n <= blocks.capacity
            if blocks.scores[layer].dtype.is_floating_point:
                # H2O sums attention: a block's attention may round its last bit apart from a lone
                # query's (a different matrix product), the additions onto the scores are the same ones
                torch.testing.assert_close(blocks.scores[layer], steps.scores[layer], rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(blocks.scores[layer], steps.scores[layer]), (chunk, layer)
    assert blocks.position == steps.position == n + 3 * c - 1
    assert 0 < len(attends) == len(evictions) < 3 * c * INFO.n_layers  # only the tokens that evicted went alone


def test_full_cache_feeds_one_block():
    """Budget 1.0 evicts nothing and keeps no scores: the whole chunk is one causal attention."""
    g = torch.Generator().manual_seed(1)
    comp = _compressed("scissorhands", 32, Budget.parse("1.0"), {}, 0, g)
    steps = copy.deepcopy(comp)
    comp.attend = None  # never called
    q, k, v = (
        torch.randn(6, 17, 32, generator=g),
        torch.randn(2, 17, 32, generator=g),
        torch.randn(2, 17, 32, generator=g),
    )
    _assert_close_outputs(comp.feed(0, q, k, v, 32), Compressor.feed(steps, 0, q, k, v, 32))
    assert torch.equal(comp.kept_positions(0), torch.arange(49).expand(2, 49).to(torch.int32))
    assert comp.scores == []
