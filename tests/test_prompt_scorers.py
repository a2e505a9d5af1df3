"""The prompt-time scorers of the field (CapKV, LeverageScore, Compactor, CurDKV, LagKV, DropKV, DapQ), alone and as
the inner scorer of ``ada-``, in one comparison on the embedded model: at budgets 0.25 and 0.5 each uses and holds
its budget in bytes (peak held / allowed within [0.85, 1.05] over prefill and every decode step), generates, and
raises no health flag."""

from kvlab.core.budgets import Budget
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure import health
from kvlab.methods import get

SCORERS = ("capkv", "leverage", "compactor", "curdkv", "lagkv", "dropkv", "dapq")
NEW = 3


def test_each_holds_and_uses_its_budget_in_a_comparison(engine, lm, long_text):
    ids = lm.encode(long_text[:1500])
    names = [*SCORERS, *(f"ada-{m}" for m in SCORERS)]
    specs = [RunSpec(m, Budget.parse(b)) for m in names for b in ("0.25", "0.5")]
    result = engine.compare(ids, specs, GenerationSettings(max_new_tokens=NEW), probes=[health.HealthProbe()])
    assert len(result.runs) == len(specs)
    for r in result.runs:
        assert not r.error and not r.health and len(r.token_ids) == NEW, f"{r.label}: {r.error or r.health}"
        limits = health.budget_limits(r, len(ids), get(r.method).streaming)
        peak = max(held / allowed for held, allowed in zip(r.kv_bytes_per_step, limits))
        assert 0.85 <= peak <= 1.05, f"{r.label}: peak {peak:.3f} of its budget"
