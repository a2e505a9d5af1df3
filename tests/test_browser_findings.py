"""The lab's findings on the page, in headless Chromium, with no upload: the committed leaderboard (with its
intervals and groups) and needle grid drawn when the page opens, the Claims tab with every claim of the
reproduction summary, uploads still possible, and a comparison on Gemma 3 270M. One page server for the
module. Each check reads the same files the page reads.

Screenshots: assets/screenshot-leaderboard.png, assets/screenshot-claims.png, assets/screenshot-grid.png,
assets/screenshot-gemma.png. The uploaded files are made up here (not measurements); so is
``tests/data/reproduce_summary.json``, which the Claims tab reads while the committed summary predates
claim ids.
"""

from __future__ import annotations

import json
import os

import pytest
from test_browser import ROOT, browser, open_page, page, serving  # noqa: F401  (fixtures)

from kvlab.engine import embedded
from kvlab.report import boards
from kvlab.report.board_table import rankings_of
from kvlab.report.claims_view import Summary, SummaryError, filter_of
from kvlab.report.leaderboard import _cell, rows_from_results
from kvlab.report.needle_grids import grids_from_results

pytestmark = [pytest.mark.browser, pytest.mark.slow]

COMMITTED_SUMMARY = ROOT / "bench" / "results" / "reproduce" / "summary.json"
FIXTURE_SUMMARY = ROOT / "tests" / "data" / "reproduce_summary.json"


def summary_file():
    """The committed reproduction summary when it lists claims by id, else the test's made-up one."""
    try:
        Summary.of(json.loads(COMMITTED_SUMMARY.read_text()))
        return COMMITTED_SUMMARY
    except (OSError, ValueError, SummaryError):
        return FIXTURE_SUMMARY


SUMMARY = summary_file()


@pytest.fixture(scope="module")
def app(free_port):
    env = {
        **os.environ,
        "KVLAB_THREADS": os.environ.get("KVLAB_THREADS", "2"),
        "PYTHONUNBUFFERED": "1",
        "KVLAB_REPRODUCE_SUMMARY": str(SUMMARY),
    }
    env.pop("KVLAB_BOARDS", None)
    env.pop("SPACE_ID", None)
    with serving(free_port(), env) as url:
        yield url


def tab(pg, name: str) -> None:
    pg.get_by_role("tab", name=name).click()


def shot(pg, path, top: str, bottom: str) -> None:
    """A screenshot from the top of ``top`` to the bottom of ``bottom`` (full width)."""
    pg.evaluate("window.scrollTo(0, 0)")  # element boxes are then page coordinates, as the clip's are
    a, b = pg.locator(top).first.bounding_box(), pg.locator(bottom).first.bounding_box()
    y0 = max(0.0, a["y"] - 8)
    path.parent.mkdir(exist_ok=True)
    pg.screenshot(
        path=str(path), full_page=True, clip={"x": 0, "y": y0, "width": 1400, "height": b["y"] + b["height"] + 12 - y0}
    )


def test_the_committed_leaderboard_opens_with_its_intervals_and_groups(page, app):  # noqa: F811
    board = boards.leaderboards()[0]
    data = json.loads(board.path.read_text())
    rows = rows_from_results(data)
    open_page(page, app)
    tab(page, "Leaderboard")
    page.wait_for_selector("#kv-board .main-svg", timeout=120_000)
    info = page.locator("#kv-board-info").inner_text()
    assert embedded.embedded(board.model).display in info and f"bench/results/{board.name}/results.json" in info
    assert board.protocol in info and f"{board.prompts} per task" in info
    # the figure: one line per method (exact dashed), each mean with its 95% interval as an error bar; a method
    # whose per-prompt averages do not vary at any ratio (e.g. 0 on every prompt) has no interval, so no bars
    traces = page.evaluate(
        """() => document.querySelector('#kv-board .js-plotly-plot').data.map(t => ({
            name: t.name, y: Array.from(t.y || []), bars: !!(t.error_y && t.error_y.visible)}))"""
    )
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != "exact"]
    lines = {t["name"]: t for t in traces if t["name"] in methods}
    with_interval = {
        r.method for r in rows if (e := r.average_estimate()) is not None and e.low is not None and r.method != "exact"
    }
    assert set(lines) == set(methods) and with_interval
    assert {name for name, t in lines.items() if t["bars"]} == with_interval
    for m in methods:
        ys = [round(r.average, 6) for r in sorted((r for r in rows if r.method == m), key=lambda r: r.ratio)]
        assert [round(y, 6) for y in lines[m]["y"]] == ys
    # the table: every row of the file, its cells as the file gives them, grouped by the paired tests' ranks
    table = page.locator("#kv-board-table").inner_text()
    for ratio, ranking in rankings_of(rows, "task_score", data.get("ranking")).items():
        for method, rank in ranking["ranks"].items():
            if method == "exact":
                continue
            r = next(r for r in rows if r.method == method and round(r.ratio, 6) == ratio)
            cell = _cell(r.average_estimate(), r.average)
            assert f"{rank}\t{method}\t{r.ratio:g}\t{r.budget:g}\t" in table and cell in table
    note = page.locator("#kv-rank-note").inner_text()
    assert "McNemar" in note and "Holm" in note
    page.wait_for_timeout(1000)
    shot(page, ROOT / "assets" / "screenshot-leaderboard.png", "#kv-board-pick", "#kv-rank-note")
    assert not page.dialogs


def test_the_picker_lists_every_committed_leaderboard_and_an_upload_still_works(page, app, tmp_path):  # noqa: F811
    labels = [b.name for b in boards.leaderboards()]
    open_page(page, app)
    tab(page, "Leaderboard")
    page.wait_for_selector("#kv-board .main-svg", timeout=120_000)
    options = page.evaluate(
        "() => window.gradio_config.components.find(c => c.props.elem_id === 'kv-board-pick').props.choices"
    )
    assert [next(n for n in labels if o[0].endswith(f"({n})")) for o in options] == labels
    path = tmp_path / "results.json"
    path.write_text(json.dumps(made_up_board()))
    page.locator("#kv-board-upload input[type=file]").set_input_files(str(path))
    page.wait_for_function(
        "() => (document.querySelector('#kv-board-info')?.innerText || '').includes('(niah_single_1, vt, fwe)')"
        " && document.querySelectorAll('#kv-board .scatterlayer .trace').length >= 3",
        timeout=60_000,
    )
    info = page.locator("#kv-board-info").inner_text()
    assert "3 tasks" in info and "0.25, 0.5, 0.75" in info and "query-aware" in info
    assert "leaderboard.csv" in page.locator("#kv-board-csv").inner_text()
    assert not page.dialogs


def made_up_board() -> dict:
    """A sweep's results.json in the format ``kvlab sweep`` writes (the fields the leaderboard reads)."""
    scores = {("exact", None): 1.0}
    scores.update({("streaming", b): v for b, v in (("0.75", 1.0), ("0.5", 0.5), ("0.25", 0.0))})
    scores.update({("snapkv", b): v for b, v in (("0.75", 1.0), ("0.5", 1.0), ("0.25", 0.5))})
    cells = []
    for task in ("niah_single_1", "vt", "fwe"):
        runs = [
            {"label": m if b is None else f"{m}@{b}", "method": m, "budget": b, "metrics": {"task_score": v}}
            for (m, b), v in scores.items()
        ]
        cells.append({"cell": {"task": task, "length": 4096, "seed": 0, "depth": 0.5}, "runs": runs})
    config = {"task": "niah_single_1,vt,fwe", "lengths": [4096], "seeds": 1, "model": "embedded"}
    return {"config": config, "protocol": "query-aware", "cells": cells}


def test_the_claims_tab_shows_every_claim_of_the_summary(page, app):  # noqa: F811
    s = Summary.of(json.loads(SUMMARY.read_text()))
    claims = s.entries("claims")
    open_page(page, app)
    tab(page, "Claims")
    page.wait_for_selector("#kv-claims .kv-claim", timeout=60_000)
    shown = page.eval_on_selector_all("#kv-claims .kv-claim", "els => els.map(e => e.dataset.id)")
    assert shown == [e["id"] for e in claims]
    text = page.locator("#kv-claims").inner_text()
    for e in claims:
        assert s.command_of(e) in text and e["point"]["model"] in text
        chip = page.locator(f"#kv-claims .kv-claim[data-id='{e['id']}'] .kv-claim-head .kv-chip").first
        assert chip.inner_text() == e["verdict"]
    apart = page.locator("#kv-claims-apart").inner_text()
    for e in s.entries("implementation_verified") + s.entries("controls"):
        assert e["id"] in apart and e["id"] not in shown
    tally = page.locator("#kv-claims-info").inner_text()
    assert f"The papers' claims: {len(claims)}" in tally
    page.wait_for_timeout(500)
    shot(page, ROOT / "assets" / "screenshot-claims.png", "#kv-claims-info", "#kv-claims .kv-claim >> nth=1")
    # the filters: one verdict, then one paper
    verdict = filter_of(claims[0]["verdict"])
    page.locator("#kv-claims-verdict label", has_text=verdict).first.locator("input").check()
    want = sum(filter_of(e["verdict"]) == verdict for e in claims)
    page.wait_for_function(
        f"() => (document.querySelector('#kv-claims-count')?.innerText || '').startsWith('{want} of {len(claims)}')",
        timeout=60_000,
    )
    assert not page.dialogs


def test_the_committed_needle_grid_opens(page, app):  # noqa: F811
    grid = boards.grids()[0]
    protocol, items = grids_from_results(json.loads(grid.path.read_text()))
    open_page(page, app)
    tab(page, "Needle grid")
    page.wait_for_selector("#kv-grid .main-svg", timeout=120_000)
    info = page.locator("#kv-grid-info").inner_text()
    assert embedded.embedded(grid.model).display in info and protocol in info
    assert f"bench/results/{grid.name}/results.json" in info
    svg = page.locator("#kv-grid").text_content()
    for g in items:
        assert g.label in svg
    page.wait_for_timeout(1000)
    shot(page, ROOT / "assets" / "screenshot-grid.png", "#kv-grid-pick", "#kv-grid")
    assert not page.dialogs


GEMMA_PROMPT = (
    "The lighthouse keeper wrote the code 4417 on the first page of the logbook. Then came weeks of storms, "
    "ships passing in the night, lamps trimmed and oil carried up the stairs. What code did the keeper write?"
)


@pytest.mark.skipif(not embedded.embedded("gemma3-270m").installed(), reason="Gemma 3 270M is not installed")
def test_a_comparison_on_gemma_3_270m(page, app):  # noqa: F811
    open_page(page, app)
    box = page.locator("#kv-model input")
    box.click()
    box.fill("gemma3-270m")
    box.press("Enter")
    page.click("#kv-load-model")
    page.wait_for_function(
        "() => (document.querySelector('#kv-model-line')?.innerText || '').includes('Gemma 3 270M')",
        timeout=600_000,
    )
    assert "18 layers, 4 query / 1 KV heads, head_dim 256" in page.locator("#kv-model-line").inner_text()
    for name in ("qjl", "subgen-kcenter", "balancekv"):  # keep it short: Scissorhands and StreamingLLM
        page.locator("#kv-papers label", has_text=f"({name})").first.locator("input").set_checked(False)
    page.locator("#kv-baselines label", has_text="(streaming)").first.locator("input").set_checked(True)
    page.locator("#kv-prompt textarea").fill(GEMMA_PROMPT)
    page.locator("#kv-budgets textarea, #kv-budgets input").first.fill("0.5")
    page.locator("#kv-max-new input[type=number]").fill("8")
    page.locator("#kv-max-new input[type=number]").press("Enter")
    page.locator("#kv-maps input").set_checked(False)  # the measurements off: Gemma's 262k vocabulary is slow
    page.wait_for_function(
        "() => (document.querySelector('#kv-plan')?.innerText || '').includes('within this page')", timeout=120_000
    )
    page.click("#kv-run")
    page.wait_for_function(
        "() => (document.querySelector('#kv-status')?.innerText || '').includes('done:')", timeout=1_200_000
    )
    assert "done: 3 runs" in page.locator("#kv-status").inner_text()
    source = page.locator("#kv-source").inner_text()
    assert embedded.embedded("gemma3-270m").display in source and "query-aware" in source
    tab(page, "What each head keeps")
    page.wait_for_function(
        "() => { const g = document.querySelector('#kv-ret .js-plotly-plot');"
        " return g && g.data && g.data.filter(t => t.type === 'heatmap').length === 3; }",
        timeout=120_000,
    )
    rows = page.evaluate(
        "() => document.querySelector('#kv-ret .js-plotly-plot').data.map(t => Array.from(t.y).length)"
    )
    assert rows == [18, 18, 18]  # 18 layers x 1 KV head
    page.wait_for_timeout(1000)
    shot(page, ROOT / "assets" / "screenshot-gemma.png", "#kv-model-row", "#kv-cards")
    assert not page.dialogs
