"""KIVI and QJL on local (sliding-window) layers: the quantized groups that leave the window whole are
dropped, their plans count a local layer's cache as its window, and both hold budgets 0.25 and 0.5.

A tiny random-weight Mistral (every layer local, a 64-token window, float32 cache) on a 520-token
prompt, 12 decode steps: each run is planned without refusal, raises no health flag and its peak
bytes are 0.85-1.05 of what the budget allows (``health.budget_limits``); the bytes it holds at each
step are the ones its plan predicted.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from bench import tiny_models
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import from_model
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure import health
from kvlab.methods.kivi import kivi_local_held

WINDOW, PROMPT, NEW = 64, 520, 12
METHODS, BUDGETS = ("kivi", "qjl"), ("0.25", "0.5")


@pytest.fixture(scope="module")
def runs(lm, long_text):
    config = tf.MistralConfig(**tiny_models._common(sliding_window=WINDOW))
    loaded = from_model(tiny_models.instantiate(tf.MistralForCausalLM, config), lm.tokenizer, "mistral", check=False)
    ids = [int(i) for i in lm.tokenizer(long_text)["input_ids"][:PROMPT]]
    assert len(ids) == PROMPT
    specs = [RunSpec(m, Budget.parse(b)) for m in METHODS for b in BUDGETS]
    res = Engine(loaded).compare(ids, specs, GenerationSettings(max_new_tokens=NEW))
    return loaded.info, res.runs


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_local_layers_hold_the_budget(runs, method, budget):
    info, results = runs
    r = next(r for r in results if r.method == method and r.budget == budget)
    assert not r.error, r.error
    assert r.health == []
    assert len(r.token_ids) == NEW and len(r.kv_bytes_per_step) == NEW
    assert r.exact_kv_bytes_per_step[0] == exact_bytes(info, PROMPT)  # the window, on every layer
    limits = health.budget_limits(r, PROMPT, True)
    peak = max(h / a for h, a in zip(r.kv_bytes_per_step, limits))
    assert 0.85 <= peak <= 1.05, f"{method} @ {budget}: peak {peak:.3f} of the budget"
    if method == "kivi":  # the plan counts what a local layer holds: its prediction is the bytes held
        p = r.params
        held = kivi_local_held(info, PROMPT, p["bits"], p["group"], p["residual"], NEW, p.get("value_group"))
        assert held.tolist()[:NEW] == r.kv_bytes_per_step
        assert p["planned_fraction"] <= float(budget) and p["fits_budget"]
    else:
        assert r.params["fits_budget"]
    assert torch.tensor(r.kv_bytes_per_step).max() < exact_bytes(info, PROMPT)
