"""RULER's synthetic tasks (kvlab.tasks.ruler), the file loader (kvlab.tasks.datafiles) and the leaderboard.

Prompts are built on the embedded model's tokenizer (no generation) except one small sweep
(two tasks, 200 tokens, exact and StreamingLLM at one ratio) and one comparison on a file row.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from kvlab import cli
from kvlab.report import leaderboard
from kvlab.tasks import RULER_TASKS, TaskError, make_task, prompt_ids, split_ids
from kvlab.tasks.base import string_match_all, string_match_part
from kvlab.tasks.datafiles import file_task, load_rows
from kvlab.tasks.ruler import SUITE

ROOT = Path(__file__).resolve().parents[1]

N = 400


@pytest.fixture(scope="module")
def built(lm):
    return {name: make_task(name, N, 3, lm.encode) for name in SUITE}


def test_suite_names_match():
    assert tuple(SUITE) == RULER_TASKS


def test_prompts_fit_the_length_and_end_with_the_question(lm, built):
    for name, t in built.items():
        n = len(prompt_ids(lm, t))
        assert N * 0.85 <= n <= N, (name, n)
        assert t.prompt.endswith(t.question) and t.context and t.answer_prefix, name
        assert t.metric == "all" and t.references and t.max_new_tokens, name
        # the query-agnostic cut: context ids + question ids are the whole prompt's ids
        ctx, rest = split_ids(lm, t.context, [t.question], [t.answer_prefix])
        assert ctx + rest[0] == prompt_ids(lm, t), name


def test_seeded_and_deterministic(lm, built):
    for name in ("niah_multikey_1", "vt", "cwe", "fwe"):
        again = make_task(name, N, 3, lm.encode)
        other = make_task(name, N, 4, lm.encode)
        assert again.prompt == built[name].prompt and again.references == built[name].references
        assert other.prompt != built[name].prompt


def test_answers_are_in_the_haystack(built):
    t = built["niah_single_1"]
    assert f"is: {t.references[0]}." in t.prompt and "The grass is green." in t.prompt
    t = built["niah_multivalue"]
    assert len(t.references) == 4 and all(f"is: {v}." in t.prompt for v in t.references)
    t = built["niah_multiquery"]
    assert len(t.references) == 4 and all(k in t.question for k in t.meta["keys"])
    t = built["niah_multikey_1"]
    assert len(t.references) == 1 and t.prompt.count("One of the special magic numbers for") == 4
    t = built["vt"]
    value = t.question.split("value ")[1].split(" ")[0]
    assert f"VAR {t.references[0]} = {value}." in t.prompt
    for a, b in zip(t.references, t.references[1:]):
        assert t.prompt.index(f"VAR {b} = VAR {a}.") > t.prompt.index(f"VAR {a} =")  # each hop after its source


def test_aggregation_answers_are_the_counted_words(built):
    t = built["cwe"]
    words = Counter(t.prompt.split("\n")[1].split()[1::2])  # "1. word 2. word ...": every second one
    top = [w for w, _ in words.most_common(10)]
    assert sorted(top) == sorted(t.references) and words[t.references[0]] == t.meta["freq_cw"]
    t = built["fwe"]
    counts = Counter(w for w in t.context.split("coded words. ")[1].split() if w != "....")
    assert [w for w, _ in counts.most_common(3)] == t.references


def test_string_match_scores():
    assert string_match_all("They are: 12, 34 and 99.", ["12", "34", "56", "78"]) == 0.5
    assert string_match_part("They are: 12, 34.", ["56", "34"]) == 1.0
    assert string_match_part("none", ["56", "34"]) == 0.0
    assert string_match_all("ABCDE fghij", ["abcde", "FGHIJ"]) == 1.0  # case-insensitive, as RULER


def test_task_score_uses_ruler_match(built):
    t = built["niah_multivalue"]
    assert t.score(" " + ", ".join(t.references[:3])) == 0.75
    assert t.score(" nothing") == 0.0


def _ruler_row(i: int) -> dict:
    ctx = "The grass is green. " * 20 + f"One of the special magic numbers for cedar is: {1000 + i}. " + "Sky. " * 10
    return {
        "index": i,
        "input": f"Some special magic numbers are hidden.\n{ctx}\nWhat are all the special magic numbers for cedar?",
        "outputs": [str(1000 + i)],
        "answer_prefix": " The special magic numbers for cedar mentioned in the provided text are",
        "length": 120,
    }


def test_loader_reads_ruler_kvpress_and_longbench_rows(tmp_path):
    (tmp_path / "niah_single_1").mkdir()
    (tmp_path / "niah_single_1" / "validation.jsonl").write_text("\n".join(json.dumps(_ruler_row(i)) for i in range(3)))
    kvpress = {"context": "A doc.", "question": "\nQ?", "answer_prefix": "Answer:", "answer": ["x"], "task": "qa_1"}
    (tmp_path / "kvpress.jsonl").write_text(json.dumps(kvpress) + "\n")
    longbench = {
        "context": "Paris is in France.",
        "input": "Where is Paris?",
        "answers": ["France"],
        "dataset": "hotpotqa",
    }
    (tmp_path / "lb.jsonl").write_text(json.dumps(longbench) + "\n")
    assert len(load_rows(f"file:{tmp_path}")) == 5
    t = file_task(f"file:{tmp_path}#niah_single_1", 2)
    assert t.name == "niah_single_1" and t.references == ["1002"] and t.metric == "all"
    assert t.question == "What are all the special magic numbers for cedar?" and t.prompt.endswith(t.question)
    assert t.answer_prefix.startswith("The special")
    q = file_task(f"file:{tmp_path}#qa_1", 0)
    assert q.metric == "part" and q.prompt == "A doc.\nQ?" and q.score("it is X.") == 1.0
    lb = file_task(f"file:{tmp_path / 'lb.jsonl'}", 0)
    assert lb.name == "hotpotqa" and lb.metric == "part" and lb.score("In France") == 1.0
    with pytest.raises(TaskError, match="has 3 rows"):
        file_task(f"file:{tmp_path}#niah_single_1", 3)
    with pytest.raises(TaskError, match="no rows of task"):
        file_task(f"file:{tmp_path}#vt", 0)
    with pytest.raises(TaskError, match="does not exist"):
        file_task(f"file:{tmp_path}/missing.jsonl", 0)
    with pytest.raises(TaskError, match="not in the local hub cache"):
        file_task("hub:kvlab-test/no-such-dataset", 0)


def test_compare_on_a_file_row_asks_after_compression(lm, tmp_path, capsys):
    path = tmp_path / "niah.jsonl"
    path.write_text(json.dumps(_ruler_row(7)) + "\n")
    argv = ["compare", "--task", f"file:{path}", "--methods", "exact", "--query-agnostic", "--max-new-tokens", "3"]
    assert cli.main([*argv, "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["protocol"] == "query-agnostic" and out["context_tokens"] < out["prompt_tokens"]


def test_ratios_become_budgets_and_bad_ones_are_refused(capsys):
    assert cli.ratio_budgets("0.25,0.5,0.875") == "0.75,0.5,0.125"
    for argv in (
        ["sweep", "--suite", "ruler", "--ratios", "1.5"],
        ["sweep", "--suite", "ruler", "--ratios", "0.5", "--budgets", "0.5"],
        ["sweep", "--task", "niah_single_1,nope"],
    ):
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "fraction of the cache removed" in err and "not both" in err and "unknown task 'nope'" in err


def test_sweep_writes_the_leaderboard(lm, tmp_path):
    out = tmp_path / "board"
    argv = ["sweep", "--task", "niah_single_1,vt", "--lengths", "160", "--methods", "streaming"]  # exact added
    assert (
        cli.main([*argv, "--ratios", "0.5", "--no-probes", "--max-new-tokens", "6", "--out", str(out), "--quiet"]) == 0
    )
    rows = list(csv.DictReader(open(out / "leaderboard.csv")))
    assert [r["method"] for r in rows] == ["exact", "streaming"]
    assert [r["ratio"] for r in rows] == ["0", "0.5"]
    # kvpress's columns first, then the protocol (kvpress's by default) and each mean's n and 95% interval
    assert list(rows[0])[:6] == ["method", "ratio", "niah_single_1", "vt", "average", "protocol"]
    assert {r["protocol"] for r in rows} == {"query-agnostic"}
    assert {"niah_single_1_n", "niah_single_1_low", "niah_single_1_high", "average_n"} <= set(rows[0])
    assert {r["niah_single_1_n"] for r in rows} == {"1"}  # one prompt: n = 1, and its exact binomial interval
    # fidelity to exact, teacher-forced even without the costly probes: exact agrees with itself
    assert {"agreement", "agreement_n", "answer_logprob", "answer_logprob_low"} <= set(rows[0])
    assert rows[0]["agreement"] == "100.00" and rows[0]["agreement_n"] == "2" and float(rows[0]["answer_logprob"]) < 0
    data = json.loads((out / "results.json").read_text())
    assert data["protocol"] == "query-agnostic" and {c["protocol"] for c in data["cells"]} == {"query-agnostic"}
    for r, board in zip(rows, leaderboard.rows_from_results(data)):
        assert float(r["average"]) == pytest.approx(board.average, abs=0.01)
        assert float(r["vt"]) == pytest.approx(board.scores["vt"], abs=0.01)
    needle = {(s["label"], s["task"]): s["task_score"] for s in data["summary"]}[("exact", "niah_single_1")]
    assert needle["n"] == 1 and needle["method"] == "clopper-pearson" and needle["low"] < needle["high"]
    assert [b["method"] for b in data["leaderboard"]] == ["exact", "streaming"]
    report = (out / "report.html").read_text()
    assert "Leaderboard" in report and "budget (kept)" in report and "plot-leaderboard" in report
    assert "query-agnostic: the context compressed alone" in report and "95% interval" in report
    assert "query-agnostic" in (out / "leaderboard.html").read_text()


def test_leaderboard_rows_average_per_task():
    def rec(task, seed, scores):
        runs = [{"label": lab, "budget": b, "metrics": {"task_score": v}} for lab, b, v in scores]
        return {"cell": {"task": task, "length": 4096, "seed": seed}, "runs": runs}

    recs = [
        rec("vt", 0, [("exact", None, 1.0), ("snapkv@0.75", "0.75", 1.0), ("snapkv@512t", "512t", 1.0)]),
        rec("vt", 1, [("exact", None, 0.6), ("snapkv@0.75", "0.75", 0.0)]),
        rec("cwe", 0, [("exact", None, 0.2), ("snapkv@0.75", "0.75", 0.1)]),
    ]
    rows = leaderboard.rows(recs)
    assert [(r.method, r.ratio, r.budget) for r in rows] == [("exact", 0.0, 1.0), ("snapkv", 0.25, 0.75)]
    assert rows[0].scores == pytest.approx({"vt": 80.0, "cwe": 20.0}) and rows[0].average == pytest.approx(50.0)
    assert rows[1].cells == {"vt": 2, "cwe": 1}  # the token budget has no ratio: left out
    assert leaderboard.csv_text(rows).splitlines()[2].startswith("snapkv,0.25,50.00,10.00,30.00,query-aware,")
    with pytest.raises(leaderboard.LeaderboardError):
        leaderboard.rows_from_results({"cells": [rec("document", 0, [("exact", None, None)])]})


def test_leaderboard_means_carry_n_and_their_interval():
    """Each task's mean has n and a 95% interval: the exact binomial one for 0/1 scores (7 of 10 right ->
    Clopper-Pearson [34.75, 93.33]), a bootstrap for shares; the average one over prompt indices."""
    hits = [1, 1, 0, 1, 1, 0, 1, 1, 0, 1]
    shares = [0.25, 0.5, 0.5, 0.75, 0.25, 0.0, 1.0, 0.5, 0.25, 0.5]

    def rec(seed):
        runs = [{"label": "qjl@0.25", "budget": "0.25", "metrics": {"task_score": hits[seed]}}]
        cwe = [{"label": "qjl@0.25", "budget": "0.25", "metrics": {"task_score": shares[seed]}}]
        return [
            {
                "cell": {"task": "niah_single_1", "length": 1024, "seed": seed},
                "protocol": "query-agnostic",
                "runs": runs,
            },
            {"cell": {"task": "cwe", "length": 1024, "seed": seed}, "protocol": "query-agnostic", "runs": cwe},
        ]

    recs = [r for seed in range(10) for r in rec(seed)]
    (row,) = leaderboard.rows(recs)
    needle, cwe, avg = row.estimate("niah_single_1"), row.estimate("cwe"), row.average_estimate()
    assert needle.method == "clopper-pearson" and (needle.n, needle.mean) == (10, 0.7)
    assert needle.low == pytest.approx(0.3475, abs=1e-4) and needle.high == pytest.approx(0.9333, abs=1e-4)
    assert cwe.method == "student-t" and cwe.low < cwe.mean < cwe.high  # ten prompts: the t interval
    assert avg.n == 10 and avg.mean == pytest.approx(row.average / 100) and avg.low < avg.mean < avg.high
    line = leaderboard.csv_text([row], leaderboard.protocol_of(recs)).splitlines()[1].split(",")
    head = leaderboard.csv_text([row]).splitlines()[0].split(",")
    cell = dict(zip(head, line))
    assert cell["protocol"] == "query-agnostic" and cell["niah_single_1_n"] == "10"
    assert (cell["niah_single_1_low"], cell["niah_single_1_high"]) == ("34.75", "93.33")
    fig = leaderboard.figure([row], protocol="query-agnostic")
    (trace,) = fig.data
    assert trace.error_y.array[0] == pytest.approx(100 * avg.high - row.average)
    assert "query-agnostic" in fig.layout.title.text
    assert "70.0 [34.8, 93.3] n=10" in leaderboard.table_html([row], "query-agnostic")


def test_leaderboard_average_is_never_a_zero_width_interval():
    """A 4-prompt pass-key sweep: exact answers all 4 and SnapKV none. The average over one task is that
    task's exact binomial interval, not [100, 100] or [0, 0]."""
    recs = [
        {
            "cell": {"task": "passkey", "length": 1024, "seed": s},
            "runs": [
                {"label": "exact", "budget": None, "metrics": {"task_score": 1.0}},
                {"label": "snapkv@0.25", "budget": "0.25", "metrics": {"task_score": 0.0}},
            ],
        }
        for s in range(4)
    ]
    exact, snap = leaderboard.rows(recs)
    for row in (exact, snap):
        avg = row.average_estimate()
        assert avg == row.estimate("passkey") and avg.high - avg.low > 0.3
    assert exact.average_estimate().low == pytest.approx(0.025**0.25) and snap.average_estimate().high > 0.5
    two = leaderboard.Row("m", 0.5, {"a": 100.0, "b": 100.0}, {"a": 3, "b": 3}, {"a": [1.0] * 3, "b": [1.0] * 3})
    avg = two.average_estimate()  # two tasks whose per-prompt averages do not vary: no interval, said so
    assert avg.low is None and avg.high is None and "do not vary" in avg.note


def test_presets_offer_ruler_tasks_only_where_exact_can(monkeypatch):
    from kvlab.tasks import exact_accuracy as calibrated
    from kvlab.ui.prompt_presets import ruler_presets

    monkeypatch.setitem(calibrated.CALIBRATED, "m", {"vt": {1024: 0.9, 4096: 0.5}, "cwe": {1024: 0.1}})
    assert ruler_presets("m", 1000) == {"RULER vt": "vt"}
    assert ruler_presets("m", 4000) == {}
    assert ruler_presets("never calibrated", 1000) == {}


def test_leaderboard_lines_are_told_apart_past_the_palette():
    """With more methods than colours (18 in the 4k leaderboard), no two lines share colour, dash and marker."""
    rows = leaderboard.rows_from_results(json.loads((ROOT / "bench/results/ruler-4k/results.json").read_text()))
    traces = [t for t in leaderboard.figure(rows).data if t.name != "exact (ratio 0)"]
    looks = {(t.line.color, t.line.dash, t.marker.symbol) for t in traces}
    assert len(traces) == 17 and len(looks) == len(traces)


def test_the_able_suite_is_what_exact_does_right_at_every_length():
    from kvlab.cli import CliError, able_suite

    assert able_suite("embedded", [1024]) == ["niah_single_1", "niah_single_2"]
    assert able_suite("smollm2-135m", [1024, 4096]) == ["niah_single_1"]  # niah_single_2 is 0.1 at 4k
    assert able_suite("gemma3-270m", [2048]) == ["niah_single_1", "niah_single_2"]  # calibrated per model
    with pytest.raises(CliError, match="at 8192 tokens"):
        able_suite("gemma3-270m", [8192])  # no RULER task reaches 0.8 at 8k on Gemma
    with pytest.raises(CliError, match="calibrate it"):
        able_suite("acme/never-calibrated", [1024])
