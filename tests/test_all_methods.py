"""The shared matrix: every registered method (and sample compositions) on one real prefill.

For budgets 0.5 / 0.25 / 0.125: plan + compress + a few append/attend steps give the right shapes
and finite outputs; bytes right after compression are within 5% of the budget or under it (or the
plan refuses the budget). At budget 1.0 every method is the exact cache: its attention
output equals exact attention over the cache's 16-bit keys and values.
"""

import pytest
import torch
from kv_samples import new_token, planned

from kvlab.core import semantics as sm
from kvlab.core.budgets import BudgetRefused, exact_bytes
from kvlab.engine.prefill import prefill, query_stats
from kvlab.methods import get, names
from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillNeeds
from kvlab.methods.scored import ScoredEvictionCompressor

COMPOSED = [
    "streaming+kivi4",
    "h2o+kivi2",
    "streaming+qjl",
    "scissorhands+qjl",
    "streaming+polarquant",
]  # built on demand by the registry's resolvers
METHODS = [m for m in names() if m != "exact"] + COMPOSED
BUDGETS = ["0.5", "0.25", "0.125"]
STEPS = 3


@pytest.fixture(scope="module")
def matrix_state(lm, long_text):
    """The same ~600-token real prefill as ``prefill_state``, with everything a method may ask of the
    prefill handed over: every prompt query (methods with long query windows, Scissorhands: w = B/2),
    accumulated attention, pre-RoPE query statistics over the whole prompt, the model itself and its output
    projections."""
    ids = lm.encode(long_text[:3000])
    needs = PrefillNeeds(query_window=len(ids), acc_attn=True, query_stats=len(ids), model_access=True, out_proj=True)
    state, _ = prefill(lm, ids, needs)
    return state


def _build(lm, state, name, budget):
    """(compressor, knobs) compressed from ``state``; (None, refusal) when the plan refuses the budget."""
    try:
        comp, knobs = planned(lm, name, budget, state.n_tokens)  # the engine's order: plan, then prefill_needs
    except BudgetRefused as exc:
        return None, exc
    needs, n = comp.prefill_needs(state.n_tokens), state.n_tokens
    window = needs.query_window
    if window > state.queries.shape[-2]:
        pytest.skip(f"{name} needs {window} prompt queries; the fixture captured {state.queries.shape[-2]}")
    w = needs.query_stats  # its own statistics window, as the engine's prefill computes each one asked
    if w and w not in state.query_stats_by_window and lm.info.rope is not None:
        state.query_stats_by_window[w] = query_stats(state.queries[..., n - w :, :], lm.info.rope, n - w)
    comp.compress(state)
    return comp, knobs


def test_matrix_covers_every_registered_method():
    assert {"streaming", "uniform", "snapkv", "pyramidkv", "kivi"} <= set(METHODS)
    assert "scissorhands+kivi4" in names() or "scissorhands" not in names()


@pytest.mark.parametrize("name", METHODS)
def test_budgets_shapes_and_bytes(lm, matrix_state, name):
    state, info = matrix_state, lm.info
    n = state.n_tokens
    for budget in BUDGETS:
        comp, knobs = _build(lm, state, name, budget)
        if comp is None:  # refused (tests/test_budget_matrix.py checks refusals): names a larger budget
            assert knobs.smallest.fraction > float(budget), knobs
            continue
        target = float(budget) * exact_bytes(info, n)
        got = comp.nbytes()
        if knobs.get("fits_budget") is False:
            # a quantizer below its smallest configuration (0.125 of a 16-bit cache is 2 bits per number;
            # KIVI-2 and QJL need ~3 with their fp16 scales, norms and window): the plan says so
            assert float(budget) <= 0.125, f"{name}@{budget}: no configuration fits, knobs {knobs}"
        else:
            msg = f"{name}@{budget}: {got / exact_bytes(info, n):.3f} of exact, knobs {knobs}"
            assert 0 < got <= 1.05 * target, msg
        for step in range(STEPS):
            for layer in (0, info.n_layers - 1):
                k, v = new_token(state, layer, step)
                comp.append(layer, k, v, n + step)
                q = state.queries[layer, :, -1 - step :][:, :1]
                out = comp.attend(layer, q)
                assert out.shape == (info.n_heads, 1, info.head_dim) and torch.isfinite(out).all(), (name, budget)


@pytest.mark.parametrize("name", METHODS)
def test_full_budget_is_exact(lm, matrix_state, name):
    state, info = matrix_state, lm.info
    comp, _ = _build(lm, state, name, "1.0")
    n = state.n_tokens
    for layer in (0, (info.n_layers - 1) // 2, info.n_layers - 1):
        k, v = new_token(state, layer, 0)
        comp.append(layer, k, v, n)
        q = state.queries[layer, :, -1:]
        cd = info.torch_cache_dtype  # every cache, exact included, holds 16-bit K/V by default
        ref = sm.attend(
            q,
            torch.cat([state.keys[layer], k], -2).to(cd),
            torch.cat([state.values[layer], v], -2).to(cd),
            state.scaling,
        )
        torch.testing.assert_close(comp.attend(layer, q), ref, atol=1e-5, rtol=1e-4, msg=f"{name} layer {layer}")
    assert comp.nbytes() >= exact_bytes(info, n) * 0.999  # nothing dropped


@pytest.mark.parametrize("method", METHODS + ["exact"])
def test_declared_capabilities_match_the_class(method):
    """The fast feeds are chosen by what a class declares (``plain_feed``, ``feeds_in_blocks``), never by
    comparing its methods; here, for every method, the declaration is checked against the class itself."""
    made = get(method)  # a wrapper's instances are of its inner class (a composition) or its cache's (``ada-``)
    cls = made if isinstance(made, type) else made.instance_class
    if issubclass(cls, DenseCompressor):
        own = cls.append is DenseCompressor.append and cls.attend is DenseCompressor.attend
        assert cls.plain_feed == own, f"{method}: plain_feed should be {own}"
    if issubclass(cls, ScoredEvictionCompressor):
        own = (
            cls.append is ScoredEvictionCompressor.append
            and cls.attend is DenseCompressor.attend
            and cls.after_attend is ScoredEvictionCompressor.after_attend
        )
        assert cls.feeds_in_blocks == own, f"{method}: feeds_in_blocks should be {own}"
