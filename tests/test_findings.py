"""The page's findings without a model: committed boards found on disk, the grouped leaderboard table, the
claims view of a reproduction summary, and the retention map's codes.

``tests/data/reproduce_summary.json`` is made up (not a measurement): a summary in the format
``kvlab.reproduce.runner.build_summary`` writes, over five reproductions' declared claims, checks and
controls, with rows of invented numbers, one of each verdict.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvlab.core.bitmask import pack, unpack
from kvlab.report import boards
from kvlab.report.board_table import grouped_table_html, rank_metrics
from kvlab.report.claims_view import Summary, SummaryError, apart_html, claims_html, filter_of
from kvlab.report.leaderboard import rows_from_results
from kvlab.report.ranking import rank_board
from kvlab.report.retention_map import EVICTED, KEPT, NOT_SEEN, QUANTIZED, SINK, SUMMARIZED, WINDOW, codes

ROOT = Path(__file__).resolve().parent.parent
RULER_1K = ROOT / "bench" / "results" / "ruler-1k" / "results.json"
FIXTURE = Path(__file__).resolve().parent / "data" / "reproduce_summary.json"


def test_committed_boards_are_found_and_described_from_their_files():
    found = {b.name: b for b in boards.committed()}
    b = found["ruler-1k"]
    data = json.loads(RULER_1K.read_text())
    assert b.model == data["config"]["model"] == "embedded"
    assert b.lengths == (1024,) and b.protocol == data["protocol"] == "query-agnostic"
    assert b.tasks == ("niah_single_1", "niah_single_2") and b.prompts == 10
    assert b.leaderboard and not b.grid
    assert "ruler-1k" in {x.name for x in boards.leaderboards()}
    assert boards.shown_path(b.path) == "bench/results/ruler-1k/results.json"


def test_a_new_board_shows_up_without_code_changes(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    shutil.copy(RULER_1K, tmp_path / "mine" / "results.json")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "results.json").write_text('{"not": "a sweep"}')
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{")
    monkeypatch.setenv("KVLAB_BOARDS", str(tmp_path))
    assert [b.name for b in boards.committed()] == ["mine"]
    assert [b.name for b in boards.leaderboards()] == ["mine"]


def test_the_page_opens_on_the_board_where_exact_answers_best(tmp_path, monkeypatch):
    """Two boards alike in prompts and length: the one whose exact run scores higher comes first."""
    data = json.loads(RULER_1K.read_text())
    for name, exact_score in (("a-weak", 0.0), ("b-strong", 1.0)):
        for c in data["cells"]:
            for r in c["runs"]:
                if r["method"] == "exact":
                    r["metrics"]["task_score"] = exact_score
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    monkeypatch.setenv("KVLAB_BOARDS", str(tmp_path))
    found = boards.leaderboards()
    assert [b.name for b in found] == ["b-strong", "a-weak"] and [b.exact_score for b in found] == [1.0, 0.0]


def test_a_boards_label_counts_its_methods_with_the_reference_apart():
    assert boards.methods_text(["exact", "snapkv", "kivi", "snapkv"]) == "exact + 2 methods"
    assert boards.methods_text(["kivi"]) == "1 method"
    b = next(b for b in boards.committed() if b.name == "ruler-1k")
    assert f"exact + {len(b.methods) - 1} methods (ruler-1k)" in b.label()


def test_grouped_table_ranks_as_the_paired_tests_do():
    rows = rows_from_results(json.loads(RULER_1K.read_text()))
    html = grouped_table_html(rows, "query-agnostic")
    assert "McNemar" in html and "Holm" in html and "Wilcoxon" in html
    for ranking in rank_board(rows):
        for method, rank in ranking.ranks.items():
            if method == "exact":
                continue
            row = next(r for r in rows if r.method == method and r.ratio == ranking.ratio)
            needle = f"data-rank='{rank}'"
            cell = f"<td>{rank}</td><td>{method}</td><td>{row.ratio:g}</td>"
            assert cell in html and needle in html
    measured = [m for m in ("agreement", "answer_logprob") if any(r.fidelity_estimate(m) for r in rows)]
    assert rank_metrics(rows) == ["task_score", *measured]  # the fidelity scores this board measured


def test_grouped_table_shows_fidelity_columns_and_groups_by_them():
    def run(label, budget, score, logp):
        metrics = {"task_score": score, "agreement": score, "answer_logprob": logp}
        return {"label": label, "budget": budget, "metrics": metrics}

    recs = []
    for seed in range(8):
        runs = [
            run("exact", None, 1.0, 0.0),
            run("a@0.5", "0.5", 1.0, -0.1),
            run("b@0.5", "0.5", 0.0, -3.0),
            run("a@0.25", "0.25", 1.0, -0.5),
            run("b@0.25", "0.25", 0.0, -4.0),
        ]
        recs.append({"cell": {"task": "t", "length": 1024, "seed": seed, "depth": 0.5}, "runs": runs})
    rows = rows_from_results({"cells": recs})
    assert rank_metrics(rows) == ["task_score", "agreement", "answer_logprob"]
    html = grouped_table_html(rows, "query-agnostic", "answer_logprob")
    assert "agreement with exact" in html and "log p(exact&#x27;s answer)" in html
    assert "on log p(exact's answer)" in html.replace("&#x27;", "'")
    # 8 of 8 prompts one way: Wilcoxon p = 0.0078, separated after Holm over 3 pairs: exact, then a, then b
    assert "<td>2</td><td>a</td>" in html and "<td>3</td><td>b</td>" in html
    by_score = grouped_table_html(rows, "query-agnostic", "task_score")  # a ties exact on the task score
    assert "<td>1</td><td>a</td>" in by_score and "<td>3</td><td>b</td>" in by_score


def test_a_ranking_the_file_carries_is_read_not_recomputed():
    rows = rows_from_results(json.loads(RULER_1K.read_text()))
    computed = rank_board(rows)[0]
    # a file whose ranking puts every method of the first ratio at rank 7 (made up: the table must follow it)
    stored = [{"ratio": computed.ratio, "metric": "task_score", "ranks": {m: 7 for m in computed.ranks},
               "means": computed.means, "separated": [], "pairs_tested": 1}]  # fmt: skip
    html = grouped_table_html(rows, "query-agnostic", "task_score", stored)
    some = next(m for m in computed.ranks if m != "exact")
    assert f"<td>7</td><td>{some}</td>" in html and "0 of 1 pairs separated" in html


def test_claims_view_shows_every_claim_and_keeps_checks_and_controls_apart():
    s = Summary.of(json.loads(FIXTURE.read_text()))
    html = claims_html(s)
    ids = [e["id"] for e in s.entries("claims")]
    assert len(ids) == 4 and all(f"data-id='{i}'" in html for i in ids)
    assert f"{len(ids)} of {len(ids)} claims shown" in html
    for e in s.entries("claims"):
        assert json.dumps(e["quote"]["quote"].split()[0])[1:-1] in html
        assert s.command_of(e) in html
    apart = apart_html(s)
    assert all(e["id"] in apart for e in s.entries("implementation_verified") + s.entries("controls"))
    assert not any(e["id"] in html for e in s.entries("controls"))  # controls are not among the claims
    # filters: by paper, by verdict (the four chips; "not testable at this scale" is a "not testable")
    only = claims_html(s, papers=["scissorhands"])
    assert all(("scissorhands" in i) == (f"data-id='{i}'" in only) for i in ids)
    scale = [e for e in s.entries("claims") if e["verdict"] == "not testable at this scale"]
    assert scale and filter_of(scale[0]["verdict"]) == "not testable"
    shown = claims_html(s, verdicts=["not testable"])
    assert all(f"data-id='{e['id']}'" in shown for e in scale)
    assert "0 of 4 claims shown" in claims_html(s, verdicts=["does not hold"])


def test_an_older_summary_is_refused_with_its_reason():
    old = {"claims": {"holds": 1}, "reproductions": {"x": {"verdict": "holds"}}}
    with pytest.raises(SummaryError, match="predates claim ids"):
        Summary.of(old)


def test_masks_round_trip():
    rng = np.random.default_rng(0)
    m = rng.random((3, 2, 77)) > 0.5
    assert np.array_equal(unpack(pack(m), m.shape), m)
    with pytest.raises(ValueError):
        unpack(pack(m[:1]), m.shape)


def test_codes_tell_kept_sink_window_quantized_and_evicted_apart():
    # one row holding positions 0-1 and 5-7 of 8 at full precision, 3 as codes; the next holding all 8
    held = np.array([[1, 1, 0, 1, 0, 1, 1, 1], [1] * 8], dtype=bool)
    full = np.array([[1, 1, 0, 0, 0, 1, 1, 1], [1] * 8], dtype=bool)
    z = codes(held, full, summarizes=False, bits=4.2, width=10)
    assert z[0].tolist() == [SINK, SINK, EVICTED, QUANTIZED + 3, EVICTED, WINDOW, WINDOW, WINDOW, NOT_SEEN, NOT_SEEN]
    assert z[1, :8].tolist() == [KEPT] * 8  # a row that keeps everything has no sink or window
    z = codes(held, full, summarizes=True, bits=None, width=8)
    assert z[0, 2] == SUMMARIZED and z[0, 3] == SUMMARIZED
    # a row of one kept token in the middle: kept, not a sink or a window
    z = codes(np.array([[0, 1, 0]], bool), np.array([[0, 1, 0]], bool), False, None, 3)
    assert z[0].tolist() == [EVICTED, KEPT, EVICTED]


def test_snapshot_steps_are_bounded_and_end_on_the_last_step():
    from kvlab.measure.retention import snapshot_steps

    assert snapshot_steps(32, 8) == {4, 8, 12, 16, 20, 24, 28, 31}
    assert snapshot_steps(3, 8) == {1, 2}
    assert snapshot_steps(1, 8) == set() and len(snapshot_steps(256, 8)) == 8
    assert max(snapshot_steps(256, 8)) == 255


def test_long_prompts_are_pooled_to_at_most_1100_columns_keeping_a_lone_kept_token():
    from kvlab.core.results import CompareResult, RunResult
    from kvlab.report import retention_map as rm

    n, layers = 3000, 2
    held = np.zeros((layers, 1, n), dtype=bool)
    held[:, :, 1500] = True  # one kept token in the middle, alone in its column
    shot = {"step": 0, "stage": "compressed", "seen": n, "held": pack(held), "full": pack(held), "bits": None}
    extras = {"retention": {"layers": layers, "kv_heads": 1, "prompt_tokens": n, "streaming": False,
                            "summarizes": False, "snapshots": [shot]}}  # fmt: skip
    run = RunResult(method="snapkv", budget="0.25", params={}, extras=extras)
    result = CompareResult({"id": "m"}, "p", n, [], {}, {}, [run])
    heat = rm.figure(result).data[0]
    z = np.asarray(heat.z)
    assert z.shape == (layers, 1000)  # 3 positions a column
    assert (z[:, 500] == KEPT).all() and (np.delete(z, 500, axis=1) == EVICTED).all()
    assert "3 positions (pooled)" in rm.figure(result).layout.title.text
