"""``decoding-NAME``: a prompt scorer re-applied every N decode steps on the running cache.

* On a real prefill, written plainly beside the method: after N appended tokens, decoding-knorm keeps in
  every layer and head exactly the target's smallest key norms among everything the layer holds (kept
  prompt tokens and new ones alike), and decoding-snapkv's window votes come from the queries it holds.
* Through the engine: the bytes draw a saw-tooth, the peak holds the budget at every step and uses it,
  where the same scorer at prefill only holds twice its budget on a short prompt; on 256 new tokens
  (tiny random-weight models, one with sliding windows) the peak still holds it.
* The plan: an interval left unset shrinks until every tooth keeps a token; one given is refused when
  it cannot hold; names resolve for scorers only.
"""

from __future__ import annotations

import pytest
import torch
from kv_samples import new_token, planned

from bench import tiny_models
from kvlab.core.budgets import TOLERANCE, Budget, BudgetRefused
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import from_model
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure import health
from kvlab.methods import UnknownMethodError, budget_search, get
from kvlab.methods.decoding import DecodingCompressor


def _steps(comp, state, n_steps: int) -> None:
    """``n_steps`` decode steps on every layer: a plausible new token, then its query attends."""
    n = state.n_tokens
    for step in range(n_steps):
        for layer in range(comp.info.n_layers):
            k, v = new_token(state, layer, step)
            comp.append(layer, k, v, n + step)
            comp.attend(layer, state.queries[layer, :, -1 - step :][:, :1])


def test_knorm_re_ranks_everything_the_layer_holds(lm, prefill_state):
    state, interval, target = prefill_state, 4, 40
    comp, knobs = planned(
        lm, "decoding-knorm", f"{target + interval}t", state.n_tokens, compression_interval=interval,
        target_size=target,
    )  # fmt: skip
    assert knobs["compression_interval"] == interval and knobs["queries_held"] == 0
    comp.compress(state)
    norms = state.keys.float().norm(dim=-1)  # [L, Hkv, n]
    for layer in (0, lm.info.n_layers - 1):  # the prompt: the target's smallest norms
        expect = torch.topk(-norms[layer], target, dim=-1).indices.sort(-1).values
        assert torch.equal(comp.kept_positions(layer).long(), expect)
    _steps(comp, state, interval)
    before = [(c.positions().long().clone(), c.views()[0].float().norm(dim=-1)) for c in comp.layers]
    assert all(c.n == target + interval for c in comp.layers)  # the tooth's top: nothing evicted yet
    _steps_from = state.n_tokens + interval
    for layer in range(lm.info.n_layers):  # the next append re-ranks what the layer holds, then appends
        k, v = new_token(state, layer, interval)
        comp.append(layer, k, v, _steps_from)
    for layer in (0, 7, lm.info.n_layers - 1):
        pos, held_norms = before[layer]
        best = torch.topk(-held_norms, target, dim=-1).indices  # among prompt and new tokens alike
        expect = torch.cat([pos.gather(-1, best).sort(-1).values, torch.full((pos.shape[0], 1), _steps_from)], -1)
        assert torch.equal(comp.kept_positions(layer).long(), expect), layer
    assert any(bool((p >= state.n_tokens).any()) for p, _ in before)  # new tokens were in the running


def test_snapkv_votes_come_from_the_queries_it_holds(lm, prefill_state):
    state = prefill_state
    comp, knobs = planned(lm, "decoding-snapkv", "0.25", state.n_tokens, compression_interval=8)
    assert knobs["queries_held"] == 8  # SnapKV's window (32) asks for more; at most the interval is held
    comp.compress(state)
    _steps(comp, state, 8)
    layer = 3
    held = comp.queries[layer]
    assert held.shape == (lm.info.n_heads, 8, lm.info.head_dim)
    for step in range(8):  # the last 8 queries, oldest first, as the cache stores them
        q = state.queries[layer, :, -1 - step :][:, :1].to(held.dtype)
        assert torch.equal(held[:, step : step + 1], q)
    running = comp.running_state(layer, state.n_tokens + 8)
    assert running.next_position == state.n_tokens + 8 and running.queries.shape[-2] == 8
    assert running.n_tokens == comp.layers[layer].n
    assert sum(t.numel() * t.element_size() for kind, t in comp.tensors() if kind == "queries") == (
        lm.info.n_layers * comp.query_bytes(8)
    )


def _within(run, n: int) -> list[float]:
    """Held / allowed at every entry of the run's bytes (the budget's share of every token seen)."""
    return [h / a for h, a in zip(run.kv_bytes_per_step, health.budget_limits(run, n, streaming=True))]


def test_saw_tooth_holds_the_budget_where_prefill_only_does_not(engine, lm, long_text):
    ids = lm.encode(long_text)[:63]
    budget = Budget.parse("0.25")
    runs = [RunSpec(m, budget) for m in ("knorm", "decoding-knorm", "decoding-snapkv")]
    res = engine.compare(ids, runs, GenerationSettings(max_new_tokens=24), probes=[health.HealthProbe()])
    prefill_only, *decoding = res.runs
    assert prefill_only.memory["peak_fraction"] > 1.7 * budget.fraction  # generated tokens kept whole
    for r in decoding:
        ratios, steps = _within(r, len(ids)), r.kv_bytes_per_step
        drops = sum(b < a for a, b in zip(steps, steps[1:]))
        assert drops >= 4, f"{r.label}: {steps}"  # a compression every few steps: the saw-tooth
        assert max(ratios) <= 1 + TOLERANCE and max(ratios) >= 0.9, f"{r.label}: {ratios}"
        assert r.memory["peak_fraction"] <= budget.fraction * (1 + TOLERANCE)
        assert not r.health and r.finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_peak_holds_its_budget_over_256_new_tokens(family, lm, long_text):
    loaded = from_model(tiny_models.build(family), lm.tokenizer, family, check=False)
    ids = [int(i) for i in lm.tokenizer(long_text)["input_ids"][:64]]
    runs = [RunSpec("decoding-knorm", Budget.parse("0.25")), RunSpec("decoding-snapkv", Budget.parse("0.5"))]
    res = Engine(loaded).compare(ids, runs, GenerationSettings(max_new_tokens=256))
    for r in res.runs:
        assert len(r.token_ids) == 256 and not r.error, r.label
        ratios = _within(r, len(ids))
        assert max(ratios) <= 1 + TOLERANCE, f"{r.label}: {max(ratios):.3f} at step {ratios.index(max(ratios))}"
        assert min(ratios[1:]) > 0.5, r.label  # a saw-tooth, not a collapse


def test_interval_unset_is_a_fifth_of_the_paid_tokens_and_shrinks_to_fit(lm):
    info = lm.info
    comp = get("decoding-knorm")(info, Budget.parse("0.25"), {})
    comp.decode_steps = 32
    paid = comp.allowed(63, 0) / (info.n_kv_heads * comp.per_token_bytes() * info.n_layers)
    assert comp.plan(63)["compression_interval"] == max(1, round(paid / 5))
    # 13 kept + 3 new (about 16 / 5) pass a 16-token budget (each token carries its position), 13 + 2 hold it
    comp = get("decoding-knorm")(info, Budget.parse("16t"), {"target_size": 13})
    comp.decode_steps = 32
    assert budget_search.planned(comp, 63)["compression_interval"] == 2


def test_an_interval_given_is_refused_when_its_teeth_pass_the_budget(lm):
    comp = get("decoding-knorm")(lm.info, Budget.parse("0.25"), {"compression_interval": 200})
    comp.decode_steps = 300
    with pytest.raises(BudgetRefused, match="smallest budget it can honour") as refused:
        budget_search.planned(comp, 63)
    again = comp.remade(refused.value.smallest)
    budget_search.planned(again, 63)  # the budget named is honoured


def test_names_resolve_for_prompt_scorers_only(lm):
    made = get("decoding-keydiff")
    assert made.streaming and made.group == "recent" and made.inner.name == "keydiff"
    comp = made(lm.info, Budget.parse("0.5"), {"window": 4, "compression_interval": 3})
    assert isinstance(comp, DecodingCompressor) and comp.name == "decoding-keydiff"
    assert comp.cfg["window"] == 4 and comp.cfg["compression_interval"] == 3
    for name in ("decoding-h2o", "decoding-tova", "decoding-ada-snapkv", "decoding-nothing"):
        with pytest.raises(UnknownMethodError):
            get(name)
