"""The Leaderboard tab in headless Chromium: upload a sweep's results.json, see one line per method.

Uses the app, browser and page fixtures of ``test_browser``; the screenshot is saved as
assets/screenshot-leaderboard.png. The results file is made up here (it is not a measurement).
"""

from __future__ import annotations

import json

import pytest
from test_browser import ROOT, app_url, browser, open_page, page  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOT = ROOT / "assets" / "screenshot-leaderboard.png"
TASKS = ("niah_single_1", "vt", "fwe")
# score per (method, budget kept) on every task's one prompt
SCORES = {
    ("exact", None): 1.0,
    ("streaming", "0.75"): 1.0,
    ("streaming", "0.5"): 0.5,
    ("streaming", "0.25"): 0.0,
    ("snapkv", "0.75"): 1.0,
    ("snapkv", "0.5"): 1.0,
    ("snapkv", "0.25"): 0.5,
}


def results_json() -> dict:
    """A sweep's results.json in the format ``kvlab sweep`` writes (only the fields the leaderboard reads)."""
    cells = []
    for task in TASKS:
        runs = [
            {"label": m if b is None else f"{m}@{b}", "method": m, "budget": b, "metrics": {"task_score": v}}
            for (m, b), v in SCORES.items()
        ]
        cells.append({"cell": {"task": task, "length": 4096, "seed": 0, "depth": 0.5}, "runs": runs})
    config = {"task": ",".join(TASKS), "lengths": [4096], "seeds": 1}
    return {"config": config, "protocol": "query-aware", "cells": cells}


def test_leaderboard_tab_draws_uploaded_sweep(page, app_url, tmp_path):  # noqa: F811
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results_json()))
    open_page(page, app_url)
    page.get_by_role("tab", name="Leaderboard").click()
    page.locator("#kv-board-upload input[type=file]").set_input_files(str(path))
    page.wait_for_selector("#kv-board .main-svg", timeout=60_000)
    page.wait_for_function("() => document.querySelectorAll('#kv-board .scatterlayer .trace').length === 3",
                           timeout=30_000)  # fmt: skip
    page.wait_for_timeout(1000)
    SHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOT), full_page=True)
    info = page.locator("#kv-board-info").inner_text()
    assert "3 methods" in info and "3 tasks" in info and "0.25, 0.5, 0.75" in info
    legend = page.locator("#kv-board .legend").first.text_content()
    assert "streaming" in legend and "snapkv" in legend and "exact (ratio 0)" in legend
    table = page.locator("#kv-board-table").inner_text()
    # one prompt per task: n = 1, and a share of 0.5 has no interval from one prompt
    assert "budget (kept)" in table and "snapkv\t0.75\t0.25\t50.0 n=1\t50.0 n=1\t50.0 n=1\t50.0 n=1" in table
    assert "query-aware: the question inside the compressed prompt" in page.locator("#kv-board-info").inner_text()
    assert "leaderboard.csv" in page.locator("#kv-board-csv").inner_text()  # the file offered for download
    assert not page.dialogs
