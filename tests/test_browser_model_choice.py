"""Choosing a model on the page, in headless Chromium: the real page, real loads, a real comparison.

A tiny random-weight Llama (4 layers, hidden 128) is saved to a temporary folder with the embedded
model's tokenizer. The page (a local run: free choice) starts on the embedded model; the test types
the folder into the model box, loads it, reads the self-check's verdict under the box, runs a small
comparison on it and reads the results. A refused model (a tiny encoder-decoder) says why in one line
and leaves the tiny model loaded. The page after the run is saved as assets/screenshot-model-choice.png.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from test_browser import CHROMIUM, ROOT, browser, page, serving  # noqa: F401 (fixtures)
from test_model_choice import save_encoder_decoder, save_tiny

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOT = ROOT / "assets" / "screenshot-model-choice.png"
PROMPT = (
    "A KV cache keeps the keys and values of every token a language model has read, so that each new token "
    "attends to them without recomputing them. Its size grows with the context: for long documents it can "
    "hold more bytes than the model's own weights. Compression methods keep a part of it: some evict the "
    "tokens that received little attention, some quantize keys and values to a few bits, some sketch the "
    "keys with random projections. Summarize the trade-off in one sentence."
)


@pytest.fixture(scope="module")
def folders():
    root = Path(tempfile.mkdtemp(prefix="kvlab-models-"))  # a short path: the screenshot shows it
    try:
        yield save_tiny(root / "tiny-random-llama"), save_encoder_decoder(root / "tiny-random-t5")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def local_app(free_port, tmp_path_factory):
    """The page as a local run starts it: free model choice (no SPACE_ID, no KVLAB_ALLOW_MODEL_CHOICE)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SPACE_ID", "KVLAB_ALLOW_MODEL_CHOICE")}
    env.update(
        KVLAB_THREADS=os.environ.get("KVLAB_THREADS", "2"),
        PYTHONUNBUFFERED="1",
        HF_HUB_CACHE=str(tmp_path_factory.mktemp("hub")),  # an empty hub cache: the list is this test's own
    )
    with serving(port, env) as url:
        yield url


def text_of(pg, selector: str) -> str:
    return pg.locator(selector).inner_text()


def wait_text(pg, selector: str, text: str, timeout: int = 120_000) -> str:
    pg.wait_for_function(
        f"() => (document.querySelector({selector!r})?.innerText || '').includes({text!r})", timeout=timeout
    )
    return text_of(pg, selector)


def type_model(pg, spec: str) -> None:
    box = pg.locator("#kv-model input")
    box.click()
    box.fill(spec)
    box.press("Enter")


def test_type_a_folder_load_it_and_compare_on_it(page, local_app, folders):  # noqa: F811
    tiny, t5 = folders
    page.goto(local_app, wait_until="load", timeout=60_000)
    page.wait_for_selector("#kv-run", timeout=60_000)
    assert "SmolLM2-135M-Instruct" in wait_text(page, "#kv-model-line", "self-check passed")
    # the box lists this machine's models; a folder typed in is named, not loaded, until Load model
    type_model(page, str(tiny))
    assert "is not loaded yet" in wait_text(page, "#kv-plan", "not loaded yet")
    page.click("#kv-load-model")
    line = wait_text(page, "#kv-model-line", str(tiny))
    assert "4 layers, 4 query / 2 KV heads, head_dim 32" in line
    assert "self-check passed: kvlab's exact path equals the model's own forward" in line
    assert "24-token prefill, then 5 decode steps" in line
    assert page.locator("#kv-model input").input_value() == str(tiny)
    assert page.locator("label", has_text="Attention-map layer").locator("input").input_value() == "2"
    # a small comparison on the tiny model: the default paper methods and StreamingLLM at 0.5
    page.locator("#kv-prompt textarea").fill(PROMPT)
    page.locator("#kv-baselines label", has_text="(streaming)").locator("input").set_checked(True)
    page.locator("#kv-budgets textarea, #kv-budgets input").first.fill("0.5")
    page.locator("#kv-max-new input[type=number]").fill("12")
    page.locator("#kv-max-new input[type=number]").press("Enter")
    wait_text(page, "#kv-plan", "within this page's limits")
    page.click("#kv-run")
    status = wait_text(page, "#kv-status", "done:", timeout=600_000)
    assert "done: 6 runs" in status, status
    cards = page.locator("#kv-cards .kv-card")
    assert cards.count() == 6 and "reference" in cards.first.inner_text()
    assert all("KiB" in cards.nth(i).inner_text() for i in range(6))
    page.wait_for_function(
        "() => document.querySelectorAll('#kv-gauges .indicatorlayer .trace').length === 6", timeout=180_000
    )
    page.wait_for_timeout(1500)
    SHOT.parent.mkdir(exist_ok=True)
    page.evaluate("window.scrollTo(0, 0)")
    bottom = page.locator("#kv-cards").bounding_box()
    clip = {"x": 0, "y": 0, "width": 1400, "height": bottom["y"] + bottom["height"] + 12}
    page.screenshot(path=str(SHOT), full_page=True, clip=clip)  # the model box to the cards
    # a refused model: why, in one line; the box back on the tiny model, which stays loaded
    type_model(page, str(t5))
    page.click("#kv-load-model")
    line = wait_text(page, "#kv-model-line", "not loaded")
    assert "it is an encoder-decoder model" in line and "nothing was lost" in line and str(tiny) in line
    page.wait_for_function(f"() => document.querySelector('#kv-model input')?.value === {str(tiny)!r}", timeout=120_000)
    assert "within this page's limits" in wait_text(page, "#kv-plan", "within this page's limits")
    assert "6 runs" in text_of(page, "#kv-plan")
    assert "done: 6 runs" in text_of(page, "#kv-status")  # the result is still there
    assert not page.dialogs
