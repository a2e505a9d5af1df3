"""Every registered method holds its budget at every prompt length, or refuses it.

For budgets 0.5 / 0.25 / 0.125 on real prompts of 16, 63, 300 and 2,000 tokens, every method listed
by ``kvlab methods`` (compositions included) either holds at most 1.05 x the bytes its budget allows
after prefill and at every decode step (``Budget.allowed_bytes``: streaming methods the budget's
share of every token seen, prefill-only methods that of the prompt plus their generated tokens), or
is refused with a message naming a smallest budget above the one asked; asked again at that
budget, it is not refused and holds it. One ``Engine.stream`` per prompt length runs every method
at every budget on one shared prefill (and one more for the retries); 3 tokens are generated (2 on
the 2,000-token prompt, marked slow).
"""

import re

import pytest

from kvlab.core.budgets import TOLERANCE, Budget
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure.health import HealthProbe
from kvlab.methods import budget_search, get, names

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


def _check_matrix(engine, ids, gen=GEN):
    n = len(ids)
    runs = [RunSpec(m, b) for b in BUDGETS for m in METHODS]
    result = engine.compare(ids, runs, gen, probes=[HealthProbe()])
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
        again = engine.compare(ids, retries, gen, probes=[HealthProbe()])
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


@pytest.mark.acceptance  # about 200 s: make test-all
def test_every_method_holds_its_budget_or_refuses_on_2000_tokens(engine, prompt_ids):
    _check_matrix(engine, prompt_ids[:2000], GenerationSettings(max_new_tokens=2))  # one decode step


def test_refusal_message_names_method_prompt_and_smallest_budget(lm):
    from kvlab.core.budgets import BudgetRefused

    with pytest.raises(BudgetRefused) as refused:
        budget_search.planned(get("qjl")(lm.info, Budget.parse("0.01"), {}), 16)
    exc = refused.value
    assert REFUSAL.match(str(exc)).groups()[:3] == ("qjl", "0.01", "16")
    assert exc.smallest.fraction > 0.01 and exc.n_prompt == 16 and exc.method == "qjl"
    comp = get("qjl")(lm.info, exc.smallest, {})
    assert budget_search.planned(comp, 16)["fits_budget"]  # the smallest budget named is honoured
    # a token budget is answered with a token count
    with pytest.raises(BudgetRefused, match=r"the smallest budget it can honour here is \d+t$"):
        budget_search.planned(get("kivi")(lm.info, Budget.parse("1t"), {}), 300)


def test_a_refused_run_is_recorded_shown_and_exported_while_the_others_run(engine, prompt_ids):
    import json

    from kvlab.report import comparison_figures as plots
    from kvlab.report.result_file import load_result_text
    from kvlab.run import finish
    from kvlab.ui.cards import cards_html

    ids = prompt_ids[:16]
    runs = [RunSpec("exact"), RunSpec("qjl", Budget.parse("0.01")), RunSpec("streaming", Budget.parse("0.5"))]
    result = finish(engine.compare(ids, runs, GEN, probes=[HealthProbe()]))
    exact, refused, ran = result.runs
    assert refused.finish_reason == "refused" and refused.error.startswith("qjl cannot fit budget 0.01 on a 16-token")
    assert refused.token_ids == [] and refused.kv_bytes == 0 and refused.label == "qjl@0.01"
    assert ran.finish_reason == "length" and len(ran.token_ids) == GEN.max_new_tokens and not ran.error
    assert exact.token_ids and not exact.error
    from kvlab.cli import format_table

    assert re.search(r"qjl@0\.01\s+—\s+—\s+refused\s.*qjl cannot fit", format_table(result))  # the CLI's table too
    html = cards_html(result, None)
    assert "refused" in html and "qjl cannot fit budget 0.01" in html and html.count("kv-card ") == 3
    data = json.loads(json.dumps(result.to_json()))
    assert data["runs"][1]["finish_reason"] == "refused" and data["runs"][1]["error"] == refused.error
    back = load_result_text(json.dumps(data))
    assert back.runs[1].error == refused.error
    for draw in (plots.gauges, plots.bytes_per_step, plots.quality_vs_memory):
        draw(back)  # a refused run has no bytes and no tokens: the figures skip it rather than fail
    pytest.importorskip("gradio")
    from kvlab.ui.dashboard import Dashboard
    from kvlab.ui.export import metrics_csv

    shown = Dashboard(engine.lm).render(data, "mean", None)  # every panel, as the page draws a loaded result
    assert "qjl cannot fit budget 0.01" in shown[0]
    assert "qjl@0.01" in metrics_csv(back)


def test_every_run_refused_needs_no_prefill(engine, prompt_ids):
    runs = [RunSpec("kivi", Budget.parse("0.125")), RunSpec("qjl", Budget.parse("0.01"))]
    result = engine.compare(prompt_ids[:16], runs, GEN)
    assert [r.finish_reason for r in result.runs] == ["refused", "refused"]
    assert "prefill_s" not in result.timings
