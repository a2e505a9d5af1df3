"""Shared test inputs built from real prefill tensors, and compressors built on them."""

from kvlab.budgets import Budget
from kvlab.compressors import budget_search, get


def new_token(state, layer, step):
    """A plausible new key/value [Hkv, 1, d]: a prompt token's, scaled (real statistics, new content)."""
    j = state.n_tokens - 1 - 7 * step
    return state.keys[layer, :, j : j + 1] * 0.9, state.values[layer, :, j : j + 1] * 1.1


def planned(lm, name, budget, n_tokens, **params):
    """A compressor for method ``name`` at ``budget`` (text), planned for ``n_tokens``: (compressor, knobs)."""
    comp = get(name)(lm.info, Budget.parse(budget), params, seed=0)
    return comp, budget_search.planned(comp, n_tokens)


def compressed(lm, state, name, budget, **params):
    """``planned`` for the prefill ``state``, then compressed from it: (compressor, knobs)."""
    comp, knobs = planned(lm, name, budget, state.n_tokens, **params)
    comp.compress(state)
    return comp, knobs
