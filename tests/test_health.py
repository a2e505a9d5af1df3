"""Health flags fire on broken methods and stay quiet on sound ones."""

from __future__ import annotations

import pytest
import torch

from kvlab.core.budgets import Budget
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure.health import HealthProbe
from kvlab.methods import registry
from kvlab.methods.exact import Exact


class _KeepsEverything(Exact):
    """Claims a budget but evicts nothing: overshoots it and equals exact."""

    name = "test-keeps-everything"
    group = "baseline"


class _NanAttention(Exact):
    name = "test-nan-attention"
    group = "baseline"

    def attend(self, layer, q):
        return torch.full_like(q, float("nan"))


@pytest.fixture
def broken_methods():
    for cls in (_KeepsEverything, _NanAttention):
        registry.register(cls)
    yield
    for cls in (_KeepsEverything, _NanAttention):
        registry.unregister(cls.name)


def _flags(result) -> dict[str, set[str]]:
    return {r.label: {f["flag"] for f in r.health} for r in result.runs}


def test_broken_methods_are_flagged(engine, lm, long_text, broken_methods):
    ids = lm.encode(long_text[:1500])
    q = Budget(fraction=0.25)
    runs = [RunSpec("exact"), RunSpec("test-keeps-everything", q), RunSpec("test-nan-attention", q)]
    result = engine.compare(ids, runs, GenerationSettings(max_new_tokens=4), probes=[HealthProbe()])
    flags = _flags(result)
    assert flags["exact"] == set()
    assert flags["test-keeps-everything@0.25"] == {"over_budget", "not_compressed", "evicted_nothing"}
    assert "non_finite_logits" in flags["test-nan-attention@0.25"]
    detail = next(f["detail"] for r in result.runs for f in r.health if f["flag"] == "over_budget")
    assert "4.00x" in detail and "after prefill" in detail


def test_sound_methods_raise_no_flags(engine, lm, long_text):
    ids = lm.encode(long_text[:1500])
    q = Budget(fraction=0.5)
    runs = [RunSpec("exact"), RunSpec("snapkv", q), RunSpec("streaming", q), RunSpec("h2o", q), RunSpec("kivi", q)]
    result = engine.compare(ids, runs, GenerationSettings(max_new_tokens=4), probes=[HealthProbe()])
    assert all(not r.health for r in result.runs), {r.label: r.health for r in result.runs}
