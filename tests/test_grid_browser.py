"""The Needle grid tab in headless Chromium: upload a sweep's results.json, see one heatmap per run.

Uses the app, browser and page fixtures of ``test_browser`` (the app on a free port, Debian's
chromium through Playwright); the screenshot is saved as assets/screenshot-grid.png.
"""

from __future__ import annotations

import json

import pytest
from test_browser import ROOT, app_url, browser, open_page, page  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOT = ROOT / "assets" / "screenshot-grid.png"
LENGTHS, DEPTHS = (1024, 2048), (0.0, 0.5, 1.0)
# hits out of 3 seeds per (depth, length) for each run label
HITS = {
    "exact": [[3, 3], [3, 3], [3, 3]],
    "streaming@0.5": [[0, 0], [1, 0], [3, 3]],
    "snapkv@0.5": [[3, 2], [2, 1], [3, 3]],
}


def results_json() -> dict:
    """A sweep's results.json in the format ``kvlab sweep`` writes (only the fields a grid reads)."""
    cells = []
    for j, n in enumerate(LENGTHS):
        for i, d in enumerate(DEPTHS):
            for s in range(3):
                runs = [
                    {
                        "label": label,
                        "method": label.split("@")[0],
                        "budget": label.split("@")[1] if "@" in label else None,
                        "metrics": {"task_score": float(s < hits[i][j])},
                    }
                    for label, hits in HITS.items()
                ]
                cells.append({"cell": {"task": "needle", "length": n, "seed": s, "depth": d}, "runs": runs})
    config = {"task": "needle", "lengths": list(LENGTHS), "depths": list(DEPTHS), "seeds": 3, "depth": 0.5}
    return {"config": config, "protocol": "query-aware", "cells": cells}


def test_needle_grid_tab_draws_uploaded_sweep(page, app_url, tmp_path):  # noqa: F811
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results_json()))
    open_page(page, app_url)
    page.get_by_role("tab", name="Needle grid").click()
    page.locator("#kv-grid-upload input[type=file]").set_input_files(str(path))
    page.wait_for_selector("#kv-grid .main-svg", timeout=60_000)
    page.wait_for_function(
        f"() => document.querySelectorAll('#kv-grid .heatmaplayer .hm').length === {len(HITS)}", timeout=30_000
    )
    page.wait_for_timeout(1000)
    SHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOT), full_page=True)
    info = page.locator("#kv-grid-info").inner_text()
    assert "needle" in info and "query-aware" in info and "3 runs" in info
    svg = page.locator("#kv-grid").inner_text() + page.locator("#kv-grid .main-svg").first.inner_html()
    for label in HITS:
        assert label in svg
    assert "1/3" in svg and "0/3" in svg and "3/3" in svg  # cells annotated with hits/seeds
    assert not page.dialogs
