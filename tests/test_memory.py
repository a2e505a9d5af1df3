"""The two memory figures (peak and mean bytes over a run), budget use and shared per-model state: in the JSON,
on the cards, the gauges, the CLI table and the sweep's rows. The bytes are those of real runs' shapes: a
Scissorhands-like run that drops to about half its budget at its first eviction, a streaming one that fills it."""

from __future__ import annotations

import json

from kvlab.cli import format_table
from kvlab.core.results import CompareResult, RunResult
from kvlab.measure.health import budget_use, bytes_flags
from kvlab.report import comparison_figures as plots
from kvlab.report.result_file import load_result_text
from kvlab.sweep import rows
from kvlab.ui.cards import cards_html

N, STEPS, PER_TOKEN = 100, 8, 1000  # prompt tokens, decode steps, exact bytes per token
EXACT = [PER_TOKEN * (N + k) for k in range(STEPS + 1)]


def _run(method: str, held: list[int], shared: dict | None = None) -> RunResult:
    return RunResult(
        method=method,
        budget=None if method == "exact" else "0.5",
        params={},
        kv_bytes=held[0],
        kv_bytes_per_step=held,
        exact_kv_bytes_per_step=EXACT,
        finish_reason="length",
        shared_bytes=shared or {},
    )


def _result() -> CompareResult:
    half = [50 * PER_TOKEN] + [(25 + k) * PER_TOKEN for k in range(1, STEPS + 1)]  # evicts to B/2 at step 1
    full = [PER_TOKEN * (N + k) // 2 for k in range(STEPS + 1)]  # streaming: half of every token seen
    runs = [_run("exact", EXACT), _run("scissorhands", half), _run("qjl", full, {"sketch": 3 * 1024 * 1024})]
    for r in runs[1:]:
        r.budget_use = budget_use(r, N, streaming=r.method == "qjl")
    return CompareResult({"id": "t"}, "p", N, list(range(N)), {}, {}, runs)


def test_peak_mean_and_budget_use():
    ex, sc, qj = _result().runs
    assert sc.peak_kv_bytes == 50 * PER_TOKEN and sc.mean_kv_bytes == (50 + sum(range(26, 34))) * PER_TOKEN / 9
    assert qj.peak_kv_bytes == EXACT[-1] // 2 and ex.memory["peak_fraction"] == ex.memory["mean_fraction"] == 1.0
    # prefill-only: allowed = half the prompt + the generated tokens in full; it holds far less after step 1
    assert sc.budget_use < 0.65 and qj.budget_use == 1.0
    assert not bytes_flags(sc, N, streaming=False) and not bytes_flags(qj, N, streaming=True)
    over = _run("streaming", [x + PER_TOKEN * 10 for x in qj.kv_bytes_per_step])
    assert bytes_flags(over, N, streaming=True)[0]["flag"] == "over_budget"  # the budget caps the peak


def test_json_round_trip_and_schema():
    result = _result()
    text = result.dumps()
    runs = json.loads(text)["runs"]
    assert runs[1]["memory"]["peak_bytes"] == 50 * PER_TOKEN and runs[1]["memory"]["budget_use"] < 0.65
    assert runs[2]["memory"]["shared_bytes"] == 3 * 1024 * 1024 and runs[2]["shared_bytes"] == {"sketch": 3 << 20}
    back = load_result_text(text)
    assert back.runs[1].memory == result.runs[1].memory and back.runs[2].shared_bytes == {"sketch": 3 << 20}


def test_cards_gauges_and_table_show_both_figures():
    result = _result()
    cards = cards_html(result, None)
    assert cards.count("peak ") >= 3 and "mean " in cards
    assert cards.count("of its budget on average") == 1  # the run that holds about half its budget, only
    assert "shared across sequences: 3,072 KiB" in cards
    gauges = plots.gauges(result).to_dict()["data"]
    sc = gauges[1]
    assert round(sc["value"], 1) == round(100 * 50 / 108, 1)  # the peak as % of exact's peak
    assert sc["gauge"]["steps"][1]["range"][1] < sc["value"] / 1.5  # the mean band well below the peak
    assert "shared across sequences" in gauges[2]["title"]["text"]
    table = format_table(result)
    assert "peak KiB" in table and "mean KiB" in table and "3072" in table


def test_sweep_rows_carry_peak_and_mean():
    result = _result()
    from kvlab.sweep import _compact

    rec = {
        "cell": {"task": "t", "length": N, "seed": 0},
        "prompt_tokens": N,
        "runs": [_compact(r) for r in result.runs],
    }
    row = list(rows([rec]))[1]
    assert (
        row["peak_bytes"] == 50 * PER_TOKEN and row["mean_fraction"] < row["peak_fraction"] and row["budget_use"] < 0.65
    )


def test_metrics_csv_has_peak_and_mean():
    import csv
    import io

    from kvlab.ui.export import metrics_csv

    rows = list(csv.DictReader(io.StringIO(metrics_csv(_result()))))
    sc = rows[1]
    assert int(sc["peak_bytes"]) == 50 * PER_TOKEN and float(sc["mean_fraction"]) < float(sc["peak_fraction"])
    assert int(rows[2]["shared_bytes"]) == 3 << 20
