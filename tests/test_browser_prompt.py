"""What runs is what the page shows, in headless Chromium: a prompt pasted, filled or typed over a preset.

Over every preset the prompt box is replaced three ways (a paste, ``keyboard.insert_text``; a
programmatic ``fill``; typing key by key); over three presets, one per way, Run is pressed at
once: the plan line, the status line and the line above the cards give the new prompt's token
count and text, and no preset's task is scored. Only the preset's exact text is scored as its
task. One run asks a question after compression. Runs are small (StreamingLLM at 0.5, 2 new tokens, measurements off).
"""

from __future__ import annotations

import pytest
from test_browser import app_url, browser, open_page, page  # noqa: F401 (fixtures)

from kvlab.run import Comparison
from kvlab.ui.prompt_presets import TASK_PRESETS

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PRESETS = [*TASK_PRESETS, "Free chat"]
WAYS = ("paste", "fill", "type")
MESSAGE = "document.querySelector('#kv-status .kv-progress-msg')"  # the status line (not Gradio's overlay)


def small_setup(pg) -> None:
    """StreamingLLM at 0.5 only, 2 new tokens, measurements off: each run takes seconds."""
    for box in pg.locator("#kv-papers input[type=checkbox]").all():
        box.set_checked(False)
    pg.locator("#kv-baselines label", has_text="(streaming)").locator("input").set_checked(True)
    pg.locator("#kv-budgets textarea, #kv-budgets input").first.fill("0.5")
    pg.locator("#kv-max-new input[type=number]").fill("2")
    pg.locator("#kv-max-new input[type=number]").press("Enter")
    pg.locator("#kv-maps input").set_checked(False)


def pick(pg, preset: str) -> None:
    pg.locator("#kv-preset input").click()
    pg.get_by_role("option", name=preset, exact=True).click()
    pg.wait_for_function(
        "() => (document.querySelector('#kv-prompt textarea')?.value || '').length > 0", timeout=30_000
    )


def replace_prompt(pg, text: str, way: str) -> None:
    box = pg.locator("#kv-prompt textarea")
    if way == "fill":
        box.fill(text)
        return
    box.click()
    pg.keyboard.press("Control+A")
    pg.keyboard.press("Delete")
    if way == "paste":
        pg.keyboard.insert_text(text)
    else:
        pg.keyboard.type(text)


def plan_says(pg, text: str, timeout: int = 60_000) -> str:
    pg.wait_for_function(
        f"() => (document.querySelector('#kv-plan')?.innerText || '').includes({text!r})", timeout=timeout
    )
    return pg.locator("#kv-plan").inner_text()


def test_paste_fill_and_type_over_every_preset_run_the_new_prompt(page, app_url, lm, tmp_path):  # noqa: F811
    """The page after the first run (a paste) is saved as ``pasted.png`` in the test's temp folder."""
    open_page(page, app_url)
    small_setup(page)
    plan_says(page, "2 runs on")
    for i, preset in enumerate(PRESETS):
        pick(page, preset)
        if preset != "Free chat":  # the preset's own text: scored as its task
            assert "scored as the preset's task" in plan_says(page, "scored as the preset's task")
        for way in WAYS:
            text = f"Explain what a KV cache is in two sentences ({way} over {preset.lower()})."
            n = len(lm.encode(text))
            replace_prompt(page, text, way)
            plan = plan_says(page, f"2 runs on {n} prompt tokens")
            assert "task" not in plan, plan
            if way == WAYS[i % 3] and i in (0, 1, len(PRESETS) - 1):  # a real run per way, Run pressed at once
                question = "Answer in French." if preset == "Free chat" else ""
                if question:
                    page.locator("#kv-question textarea").fill(question)
                    n = len(Comparison(text, ["exact"], questions=[question]).encode(lm))
                page.evaluate(f"() => {{ {MESSAGE}.textContent = 'run pressed'; }}")  # not the last run's "done:"
                page.click("#kv-run")
                page.wait_for_function(f"() => {MESSAGE}.textContent.includes('done:')", timeout=600_000)
                status = page.locator("#kv-status .kv-progress-msg").inner_text()
                assert f"done: 2 runs on {n} prompt tokens" in status, (preset, way, status)
                head = page.locator("#kv-cards .kv-prompt-head").inner_text()
                assert f"Ran on {n} prompt tokens" in head and text in head, head
                assert "task" not in page.locator("#kv-cards").inner_text()
                if i == 0:
                    page.screenshot(path=str(tmp_path / "pasted.png"), full_page=True)
                if question:
                    assert "query-agnostic" in status and question in head
                    page.locator("#kv-question textarea").fill("")
    assert not page.dialogs
