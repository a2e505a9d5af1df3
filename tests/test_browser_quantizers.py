"""The QJL line side by side on the page: exact, QJL, TurboQuant, PolarQuant, KIVI and FP8 at one byte
budget, with the measurements on. Each card shows the bytes it holds (every quantizer within 5% of
the same budget) and the text, the Errors tab each run's attention error; the screenshots are the
ones docs/dashboard.md shows (assets/screenshot-quantizers.png, screenshot-quantizers-errors.png)."""

from __future__ import annotations

import re

import pytest
from test_browser import ROOT, app_url, browser, open_page, page, run_and_wait  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOT = ROOT / "assets" / "screenshot-quantizers.png"
BUDGET = "0.5"


def test_quantizers_side_by_side_at_one_budget(page, app_url):  # noqa: F811 (fixtures)
    open_page(page, app_url)
    for box in page.locator("#kv-papers input[type=checkbox], #kv-baselines input[type=checkbox]").all():
        box.set_checked(False)
    page.locator("#kv-papers label", has_text="(qjl)").locator("input").set_checked(True)
    page.locator("#kv-baselines label", has_text="(kivi)").locator("input").set_checked(True)
    for name in ("turboquant", "polarquant", "fp8"):
        page.locator("#kv-quantizers label", has_text=f"({name})").locator("input").set_checked(True)
    # the page's default prompt (about a thousand tokens): long enough that every quantizer's window is a
    # small part of its bytes, so each can fill the budget
    page.locator("#kv-budgets textarea, #kv-budgets input").first.fill(BUDGET)
    page.locator("#kv-maps input").set_checked(True)
    page.locator("#kv-max-new input[type=number]").fill("16")
    run_and_wait(page)
    cards = page.locator("#kv-cards .kv-card")
    assert cards.count() == 6
    texts = [c.inner_text() for c in cards.all()]
    for name in ("qjl", "turboquant", "polarquant", "kivi", "fp8"):
        card = next(t for t in texts if name in t.lower())
        saved = re.search(r"(\d+)% saved", card)  # at the peak, against the exact cache's peak
        assert saved, (name, card)
        held = 1 - int(saved.group(1)) / 100
        assert abs(held - float(BUDGET)) <= 0.05 * float(BUDGET) + 0.005, (name, card)
    page.wait_for_function(
        "() => document.querySelectorAll('#kv-gauges .indicatorlayer .trace').length === 6", timeout=180_000
    )
    SHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOT), full_page=True)
    page.get_by_role("tab", name="Errors").click()  # the attention error of each run, per layer and step
    page.wait_for_selector("#kv-err-layer .main-svg", timeout=180_000)
    page.wait_for_timeout(2000)
    page.screenshot(path=str(SHOT.with_name("screenshot-quantizers-errors.png")), full_page=True)
