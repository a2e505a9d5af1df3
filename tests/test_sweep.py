"""Sweeps from the CLI: results, resuming, the 2-process accelerate split, and the report in Chromium."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
# Small, yet its table is not flat: exact finds the pass key (calibrated: docs/tasks.md) and the
# compressed runs do not all score alike (a recency window at a quarter of the cache loses it).
SMALL = [
    "--task",
    "passkey",
    "--lengths",
    "512",
    "--seeds",
    "4",
    "--methods",
    "exact,streaming,snapkv",
    "--budgets",
    "0.5,0.25",
    "--max-new-tokens",
    "7",
    "--protocol",
    "query-aware",  # the table docs/tasks.md shows; the default, query-agnostic, is tested in test_ruler.py
]
LABELS = {"exact", "streaming@0.5", "streaming@0.25", "snapkv@0.5", "snapkv@0.25"}


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory, lm):
    out = tmp_path_factory.mktemp("sweep")
    assert main(["sweep", *SMALL, "--out", str(out), "--quiet"]) == 0
    return out


def test_sweep_writes_results(small_sweep, lm):
    rows = _csv(small_sweep / "results.csv")
    assert len(rows) == 4 * 5  # seeds x (exact + 2 methods at 2 budgets)
    assert {r["label"] for r in rows} == LABELS
    for r in rows:
        assert r["task_score"] in ("0.0", "1.0")
        # exact stores 16-bit K/V; the reference attention is computed from the model's own (fp32) K/V
        assert float(r["attn_rel_error_mean"]) < (1e-5 if r["label"] == "exact" else 1.0)
        frac = float(r["bytes_fraction"])
        assert frac == 1.0 if r["label"] == "exact" else frac < float(r["budget"]) + 0.01
    data = json.loads((small_sweep / "results.json").read_text())
    per_layer = data["cells"][0]["runs"][0]["metrics"]["attn_rel_error_per_layer"]
    assert len(data["cells"]) == 4 and len(per_layer) == lm.info.n_layers


def test_report_table_shows_each_labels_interval(small_sweep):
    """The report's per-label table gives each mean over the 4 cells with its 95% interval and n: for the
    0/1 task scores, the exact binomial interval of the hits; for the text similarity, the t interval
    where the 4 values vary and the mean with no interval where they do not (exact: 1.0 in every cell)."""
    from kvlab.core.statistics import binomial_interval, mean_interval
    from kvlab.report.sweep_report import summary_rows

    recs = json.loads((small_sweep / "results.json").read_text())["cells"]
    rows = {row[0]: row for row in summary_rows(recs)}
    assert set(rows) == LABELS

    def values(label, key):
        return [r["metrics"][key] for rec in recs for r in rec["runs"] if r["label"] == label]

    hits = sum(values("exact", "task_score"))
    assert rows["exact"][6] == binomial_interval(int(hits), 4).text()
    assert all(row[6].endswith("(n = 4)") and "[" in row[6] for row in rows.values())
    for label, row in rows.items():
        sims = values(label, "text_similarity")
        assert row[7] == mean_interval(sims).text()
        varies = max(sims) - min(sims) > 1e-9
        assert row[7].endswith("(n = 4)" if varies else "(n = 4; no interval)") and ("[" in row[7]) == varies
    assert rows["exact"][7] == "1.00 (n = 4; no interval)"
    assert any("[" in row[7] for row in rows.values())  # the compressed runs' texts differ cell to cell
    assert "task score [95% interval]" in (small_sweep / "report.html").read_text()


def test_small_sweep_table_is_not_flat(small_sweep):
    """exact scores high and the methods differ: the table says something about them."""
    score: dict[str, list[float]] = {}
    for r in _csv(small_sweep / "results.csv"):
        score.setdefault(r["label"], []).append(float(r["task_score"]))
    mean = {label: sum(v) / len(v) for label, v in score.items()}
    assert mean["exact"] >= 0.8, mean
    compressed = {label: m for label, m in mean.items() if label != "exact"}
    assert len(set(compressed.values())) >= 2, mean  # at least two methods differ
    assert min(compressed.values()) < mean["exact"], mean  # compression costs something somewhere


def test_rerun_skips_done_cells(small_sweep, capsys):
    cells = sorted((small_sweep / "cells").iterdir())
    before = [p.stat().st_mtime_ns for p in cells]
    assert main(["sweep", *SMALL, "--out", str(small_sweep)]) == 0
    assert capsys.readouterr().err.count("skipped") == 4
    assert [p.stat().st_mtime_ns for p in cells] == before


def test_a_method_added_to_a_finished_sweep_runs_alone(small_sweep, tmp_path, capsys):
    """Naming one more method re-runs no cell: each cell runs the new method (beside exact, its reference,
    which must generate the same tokens again) and keeps the runs it had; the merge then has all of them."""
    out = tmp_path / "grown"
    shutil.copytree(small_sweep, out)
    before = {p.name: json.loads(p.read_text()) for p in (out / "cells").iterdir()}
    grown = [a if a != "exact,streaming,snapkv" else "exact,streaming,snapkv,knorm" for a in SMALL]
    assert main(["sweep", *grown, "--out", str(out)]) == 0
    assert capsys.readouterr().err.count("knorm added") == 4
    for p in (out / "cells").iterdir():
        old, new = before[p.name], json.loads(p.read_text())
        assert new["runs"][: len(old["runs"])] == old["runs"]  # untouched
        assert [r["label"] for r in new["runs"][len(old["runs"]) :]] == ["knorm@0.5", "knorm@0.25"]
        assert new["methods"] == ["exact", "streaming", "snapkv", "knorm"]
    labels = {r["label"] for r in _csv(out / "results.csv")}
    assert labels == LABELS | {"knorm@0.5", "knorm@0.25"}
    # the original sweep's merge lists its own methods only, though its folder's cells now could hold more
    assert {r["label"] for r in _csv(small_sweep / "results.csv")} == LABELS


@pytest.mark.slow
def test_accelerate_two_processes_match_single(small_sweep, tmp_path):
    out = tmp_path / "acc"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    acc = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    cmd = [
        acc,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "kvlab",
        "sweep",
        *SMALL,
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "[sweep 0]" in p.stderr and "[sweep 1]" in p.stderr  # both processes ran cells
    keep = (
        "task",
        "length",
        "seed",
        "label",
        "kv_bytes",
        "task_score",
        "text_similarity",
        "first_divergence",
        "top1_agreement",
    )
    one = [{k: r[k] for k in keep} for r in _csv(small_sweep / "results.csv")]
    two = [{k: r[k] for k in keep} for r in _csv(out / "results.csv")]
    assert one == two
    for a, b in zip(_csv(small_sweep / "results.csv"), _csv(out / "results.csv")):
        assert float(a["attn_rel_error_mean"]) == pytest.approx(float(b["attn_rel_error_mean"]), rel=1e-3, abs=1e-6)


def render(report: Path, shot: Path) -> int:
    """Open the report in Chromium, wait for every plotly figure, screenshot; returns the figures rendered."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.as_uri())
        n = page.locator("section.fig").count()
        page.wait_for_function(
            f"document.querySelectorAll('section.fig .main-svg .trace').length >= {n}", timeout=60000
        )
        rendered = page.evaluate(
            "[...document.querySelectorAll('section.fig')].filter(s => s.querySelector('.main-svg .trace')).length"
        )
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert not errors, errors
    return rendered if rendered == n else -1


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium (make browser)")
def test_report_renders_in_chromium(small_sweep, tmp_path):
    shot = tmp_path / "report.png"
    # quality vs memory, attention error, bytes per step, and the leaderboard (task scores at fraction budgets)
    assert render(small_sweep / "report.html", shot) == 4
    assert "id='fig-leaderboard'" in (small_sweep / "report.html").read_text()
    assert shot.stat().st_size > 20000


@pytest.mark.acceptance
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium (make browser)")
def test_full_passkey_sweep_all_methods(tmp_path):
    """The acceptance sweep: lengths 1k and 2k, 8 seeds, budgets 0.5 and 0.25, every method."""
    out = tmp_path / "full"
    args = [
        "sweep",
        "--task",
        "passkey",
        "--lengths",
        "1k,2k",
        "--seeds",
        "8",
        "--methods",
        "all",
        "--budgets",
        "0.5,0.25",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(args) == 0
    rows = _csv(out / "results.csv")
    assert {r["length"] for r in rows} == {"1024", "2048"} and len({r["seed"] for r in rows}) == 8
    assert render(out / "report.html", tmp_path / "full.png") == 3


def test_methods_all_is_every_registered_method():
    """`--methods all` (the leaderboard's) names every method of the registry: the recent ones and the
    quantizers included."""
    from kvlab.cli import method_names
    from kvlab.methods import methods

    everything = method_names("all")
    assert everything == list(methods())
    groups = {methods()[n].group for n in everything}
    assert {"paper", "baseline", "recent", "quantizer"} <= groups
    assert {"expected-attention", "kvzip", "fp8", "turboquant", "polarquant"} <= set(everything)
