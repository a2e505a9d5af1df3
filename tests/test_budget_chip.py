"""The budget shown honestly, without a browser: a card's chip when the peak passes the budget, and the
plan line's warning on a short prompt against the new tokens."""

from __future__ import annotations

import pytest

from kvlab.core.budgets import Budget, prefill_only_peak
from kvlab.core.results import CompareResult, RunResult
from kvlab.measure.health import budget_overrun


def _run(method: str, held: list[int], exact: list[int], budget: str = "0.25", **params) -> RunResult:
    return RunResult(method, budget, params, kv_bytes_per_step=held, exact_kv_bytes_per_step=exact)


def test_prefill_only_peak():
    # 63 prompt tokens at 0.25 and 32 new: (15.75 + 32) / (0.25 * 95)
    assert prefill_only_peak(Budget.parse("0.25"), 63, 32) == pytest.approx(47.75 / 23.75)
    assert prefill_only_peak(Budget.parse("0.25"), 2000, 32) < 1.05
    assert prefill_only_peak(Budget.parse("1.0"), 63, 32) == 1.0


def test_overrun_factor_and_reason():
    exact = [6300 + 100 * k for k in range(33)]  # 63 prompt tokens, 32 steps, 100 bytes a token
    kept_whole = [1575 + 100 * k for k in range(33)]  # 0.25 of the prompt, then every new token
    factor, reason = budget_overrun(_run("balancekv", kept_whole, exact), 63, streaming=False)
    assert factor == pytest.approx(max(kept_whole) / (0.25 * max(exact))) and factor > 1.9
    assert reason == "generated tokens kept whole"
    assert budget_overrun(_run("balancekv", kept_whole, exact), 63, False, question_tokens=5)[1].startswith(
        "question and generated"
    )
    holds = [int(0.25 * e) for e in exact]  # a streaming method's share of every token seen
    assert budget_overrun(_run("h2o", holds, exact), 63, streaming=True) is None
    over = [int(0.4 * e) for e in exact]
    assert budget_overrun(_run("h2o", over, exact), 63, streaming=True)[1] == "held more than its budget allows"
    quant = budget_overrun(_run("kivi", over, exact, "0.125", fits_budget=False), 63, streaming=True)
    assert quant[1] == "its smallest configuration is above the budget"
    assert budget_overrun(_run("exact", exact, exact, None), 63, streaming=False) is None


def test_card_chip_and_plan_warning():
    pytest.importorskip("gradio")
    from kvlab.ui.cards import cards_html
    from kvlab.ui.dashboard import short_prompt_warning

    exact = [6300 + 100 * k for k in range(33)]
    runs = [_run("exact", exact, exact, None), _run("balancekv", [1575 + 100 * k for k in range(33)], exact)]
    runs.append(_run("decoding-snapkv", [int(0.25 * e) for e in exact], exact))
    result = CompareResult({}, "p", 63, [], {}, {}, runs)
    html = cards_html(result, None)
    assert html.count("kv-overrun") == 1 and "peak 2.0x budget: generated tokens kept whole" in html
    assert "Recent methods" in html.split("decoding-snapkv@0.25")[1]  # a name made on demand keeps its group
    warning = short_prompt_warning(["exact", "balancekv", "scissorhands", "decoding-snapkv"], ["0.5", "0.25"], 63, 32)
    assert "balancekv" in warning and "scissorhands" not in warning and "2.0x budget 0.25" in warning
    assert short_prompt_warning(["exact", "balancekv"], ["0.25"], 2000, 32) == ""
    assert short_prompt_warning(["exact", "scissorhands"], ["0.25"], 63, 32) == ""
