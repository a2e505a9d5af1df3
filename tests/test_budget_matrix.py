"""Every registered method holds its budget at every prompt length, or refuses it.

For budgets 0.5 / 0.25 / 0.125 on real prompts of 16, 63, 300 and 2,000 tokens, every method listed
by ``kvlab methods`` (compositions included) either holds at most 1.05 x the bytes its budget allows
after prefill and at every decode step (``Budget.allowed_bytes``: streaming methods the budget's
share of every token seen, prefill-only methods that of the prompt plus their generated tokens), or
is refused with a message naming a smallest budget above the one asked; asked again at that
budget, it is not refused and holds it. One ``Engine.stream`` per prompt length runs every method
at every budget on one shared prefill (and one more for the retries); 3 tokens are generated.
"""

import re

import pytest

from kvlab.budgets import TOLERANCE, Budget
from kvlab.compressors import get, names
from kvlab.engine import GenerationSettings, RunSpec
from kvlab.health import HealthProbe

BUDGETS = [Budget.parse(b) for b in ("0.5", "0.25", "0.125")]
METHODS = [m for m in names() if m != "exact"]
GEN = GenerationSettings(max_new_tokens=3)
REFUSAL = re.compile(
    r"^(\S+) cannot fit budget (\S+) on a (\d+)-token prompt; the smallest budget it can honour here is (\S+)$"
)


@pytest.fixture(scope="module")
def prompt_ids(lm, long_text):
    from pydoc_data.topics import topics

    ids = lm.encode(long_text + "\n\n" + topics["binary"] + "\n\n" + topics["bitwise"])
    assert len(ids) >= 2000
    return ids


def _worst(run, n: int) -> tuple[float, int]:
    """The largest held / allowed bytes ratio over prefill and every decode step, and its step."""
    budget, streaming = Budget.parse(run.budget), get(run.method).streaming
    assert run.kv_bytes_per_step and len(run.kv_bytes_per_step) == len(run.token_ids)  # prefill + every step
    info_exact = run.exact_kv_bytes_per_step
    prompt_exact = info_exact[0]
    ratios = []
    for k, (held, exact) in enumerate(zip(run.kv_bytes_per_step, info_exact)):
        share = budget.fraction_of(n + k)
        allowed = share * exact if streaming else budget.fraction_of(n) * prompt_exact + exact - prompt_exact
        ratios.append(held / allowed)
    worst = max(ratios)
    return worst, ratios.index(worst)


def _check_matrix(engine, ids):
    n = len(ids)
    runs = [RunSpec(m, b) for b in BUDGETS for m in METHODS]
    result = engine.compare(ids, runs, GEN, probes=[HealthProbe()])
    assert [(r.method, r.budget) for r in result.runs] == [(s.method, s.budget.label) for s in runs]
    retries = []
    for spec, run in zip(runs, result.runs):
        label = f"{spec.label} on {n} tokens"
        if run.finish_reason == "refused":
            m = REFUSAL.match(run.error)
            assert m, f"{label}: refusal message {run.error!r}"
            assert m.groups()[:3] == (spec.method, spec.budget.label, str(n)), run.error
            smallest = Budget.parse(m.group(4))
            assert smallest.fraction > spec.budget.fraction, f"{label}: {run.error}"
            assert run.token_ids == [] and run.kv_bytes_per_step == [] and not run.health
            retries.append(RunSpec(spec.method, smallest))
            continue
        assert run.finish_reason in ("eos", "length") and not run.error, (label, run.finish_reason, run.error)
        worst, step = _worst(run, n)
        assert worst <= 1 + TOLERANCE, f"{label}: {worst:.3f}x the budget at step {step}, knobs {run.params}"
        assert not [f for f in run.health if f["flag"] == "over_budget"], (label, run.health)
    if retries:  # asked again at the smallest budget each named: not refused, and held
        again = engine.compare(ids, retries, GEN, probes=[HealthProbe()])
        for spec, run in zip(retries, again.runs):
            assert run.finish_reason != "refused", f"{spec.label} on {n} tokens: {run.error}"
            worst, step = _worst(run, n)
            assert worst <= 1 + TOLERANCE, f"{spec.label} on {n} tokens: {worst:.3f}x at step {step}"
    return result, retries


@pytest.mark.parametrize("n", [16, 63, 300])
def test_every_method_holds_its_budget_or_refuses(engine, prompt_ids, n):
    result, retries = _check_matrix(engine, prompt_ids[:n])
    if n == 16:  # short prompts do refuse some methods (KIVI's 32-token groups, QJL's window at 0.125)
        assert retries


@pytest.mark.slow
def test_every_method_holds_its_budget_or_refuses_on_2000_tokens(engine, prompt_ids):
    _check_matrix(engine, prompt_ids[:2000])


def test_refusal_message_names_method_prompt_and_smallest_budget(lm):
    from kvlab.budgets import BudgetRefused

    with pytest.raises(BudgetRefused) as refused:
        get("qjl")(lm.info, Budget.parse("0.01"), {}).plan(16)
    exc = refused.value
    assert REFUSAL.match(str(exc)).groups()[:3] == ("qjl", "0.01", "16")
    assert exc.smallest.fraction > 0.01 and exc.n_prompt == 16 and exc.method == "qjl"
    comp = get("qjl")(lm.info, exc.smallest, {})
    assert comp.plan(16)["fits_budget"]  # the smallest budget named is honoured
    # a token budget is answered with a token count
    with pytest.raises(BudgetRefused, match=r"the smallest budget it can honour here is \d+t$"):
        get("kivi")(lm.info, Budget.parse("1t"), {}).plan(300)
