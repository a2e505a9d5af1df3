"""Shared test inputs built from real prefill tensors, and compressors built on them."""

from kvlab.core.budgets import Budget
from kvlab.methods import budget_search, get


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


def assert_holds_budget_on_model(engine, lm, text: str, method: str, budget_text: str = "0.25") -> None:
    """``method`` through the engine on ``text``: every step's held bytes within the budget (generated tokens
    kept in full), and the prompt's share of the budget nearly used."""
    from kvlab.core.budgets import exact_bytes
    from kvlab.engine.specs import GenerationSettings, RunSpec

    ids = lm.encode(text)
    budget = Budget.parse(budget_text)
    r = engine.compare(ids, [RunSpec(method, budget)], GenerationSettings(max_new_tokens=4)).runs[0]
    assert len(r.kv_bytes_per_step) == len(r.token_ids) == 4
    for step, held in enumerate(r.kv_bytes_per_step):  # after `step` decode steps
        assert held <= budget.allowed_bytes(lm.info, len(ids), step, streaming=False)
    assert r.kv_bytes_per_step[0] >= 0.95 * budget.fraction * exact_bytes(lm.info, len(ids))
