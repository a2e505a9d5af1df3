"""End to end in headless Chromium (Debian ``chromium`` + Playwright): the real page, the real model.

Starts ``app.py`` on a free port of 127.0.0.1, runs the default comparison, checks that cards,
gauges, curves and heatmaps rendered, saves the README screenshot (assets/screenshot.png), and
checks that a prompt holding HTML is shown as text and opens no dialog. The app is always killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
SHOT = ROOT / "assets" / "screenshot.png"
XSS = "<img src=x onerror=alert(1)>"

sync_api = pytest.importorskip("playwright.sync_api")
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian chromium is not installed (make browser)", allow_module_level=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"app exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "gradio_api/info", timeout=5).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError("the app did not answer /gradio_api/info")


@contextlib.contextmanager
def serving(port: int, env: dict[str, str]) -> Iterator[str]:
    """``app.py`` on 127.0.0.1:``port`` with ``env``, ready (its URL), always killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def app_url(free_port):
    env = {**os.environ, "KVLAB_THREADS": os.environ.get("KVLAB_THREADS", "2"), "PYTHONUNBUFFERED": "1"}
    with serving(free_port(), env) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
    pg = ctx.new_page()
    pg.dialogs = []
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    yield pg
    ctx.close()


def open_page(page, url: str) -> None:
    page.goto(url, wait_until="load", timeout=60_000)
    page.wait_for_selector("#kv-run", timeout=60_000)
    page.wait_for_timeout(500)


def run_and_wait(page, timeout_ms: int = 1_200_000) -> None:
    page.click("#kv-run")
    page.wait_for_function(
        "() => (document.querySelector('#kv-status')?.innerText || '').includes('done:')", timeout=timeout_ms
    )
    page.wait_for_timeout(1500)  # plots draw after the values arrive


def test_default_comparison_renders_every_panel(page, app_url):
    open_page(page, app_url)
    assert page.locator("#kv-prompt textarea").input_value().strip()
    run_and_wait(page)
    cards = page.locator("#kv-cards .kv-card")
    n = cards.count()
    assert n >= 2
    # gauges (one indicator per run) and the bytes chart are drawn by plotly once the values arrive
    page.wait_for_function(
        f"() => document.querySelectorAll('#kv-gauges .indicatorlayer .trace').length === {n}"
        f" && document.querySelectorAll('#kv-bytes .scatterlayer .trace').length === {2 * n + 1}",
        timeout=60_000,
    )
    SHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOT), full_page=True)
    assert "reference" in cards.first.inner_text()
    assert all("KiB" in cards.nth(i).inner_text() for i in range(n))
    # curves and heatmaps: in their tabs
    page.get_by_role("tab", name="Errors").click()
    page.wait_for_selector("#kv-err-step .main-svg", timeout=30_000)
    page.wait_for_selector("#kv-err-layer .main-svg", timeout=30_000)
    page.get_by_role("tab", name="Attention").click()
    page.wait_for_selector("#kv-heat .main-svg", timeout=30_000)
    page.wait_for_timeout(1500)
    page.screenshot(path=str(SHOT.with_name("screenshot-attention.png")), full_page=True)
    check_retention_maps(page, n)
    assert not page.dialogs


RET_TRACES = r"""() => { const g = document.querySelector('#kv-ret .js-plotly-plot');
  if (!g || !g.data) return null;
  const codes = z => {  // the heatmap's codes, flat: plotly keeps a numpy array as base64 bytes (dtype u1)
    if (z && z.bdata) { const s = atob(z.bdata); return Array.from(s, c => c.charCodeAt(0)); }
    return Array.from(z || []).flatMap(row => Array.from(row));
  };
  return g.data.filter(t => t.type === 'heatmap').map(t => {
    const z = codes(t.z);
    const run = (t.hovertemplate.match(/<extra>(.*)<\/extra>/) || [])[1];
    return {run, evicted: z.filter(v => v === 1).length, cells: z.length, rows: Array.from(t.y).length};
  }); }"""


def ret_titles(page) -> list[str]:
    return page.evaluate("() => document.querySelector('#kv-ret .js-plotly-plot').layout.annotations.map(a => a.text)")


def check_retention_maps(page, n: int) -> None:
    """What each head keeps: one map per run; Scissorhands' kept positions change with the step slider.
    Saves the tab at two steps (assets/screenshot-retention-0.png, assets/screenshot-retention-step.png)."""
    page.get_by_role("tab", name="What each head keeps").click()
    page.wait_for_function(f"() => {{ const t = ({RET_TRACES})(); return t && t.length === {n}; }}", timeout=120_000)
    before = {t["run"]: t for t in page.evaluate(RET_TRACES)}
    assert set(before) >= {"exact", "scissorhands@0.25"}, before.keys()
    assert all(t["rows"] == 90 for t in before.values())  # 30 layers x 3 KV heads
    assert before["exact"]["evicted"] == 0
    titles = ret_titles(page)
    assert all("after compression" in t for t in titles), titles
    page.wait_for_timeout(1000)
    clip_tab(page, SHOT.with_name("screenshot-retention-0.png"))
    last = int(page.locator("#kv-ret-step input[type=number]").get_attribute("max") or 0)
    assert last >= 4
    step = min(last, 16)
    box = page.locator("#kv-ret-step input[type=number]")
    box.fill(str(step))
    box.press("Enter")
    page.wait_for_function(
        "() => Array.from(document.querySelector('#kv-ret .js-plotly-plot').layout.annotations)"
        f".some(a => a.text.includes('scissorhands@0.25') && a.text.includes('step {step}'))",
        timeout=120_000,
    )
    after = {t["run"]: t for t in page.evaluate(RET_TRACES)}
    sh_before, sh_after = before["scissorhands@0.25"], after["scissorhands@0.25"]
    assert sh_after["evicted"] > sh_before["evicted"]  # Scissorhands evicts prompt tokens while decoding
    assert after["exact"]["evicted"] == 0
    page.wait_for_timeout(1000)
    clip_tab(page, SHOT.with_name("screenshot-retention-step.png"))


def clip_tab(page, path: Path) -> None:
    """A screenshot of the retention tab: from the prompt's text to the end of the maps."""
    page.evaluate("window.scrollTo(0, 0)")  # element boxes are then page coordinates, as the clip's are
    a = page.locator("#kv-ret-prompt").bounding_box()
    b = page.locator("#kv-ret").bounding_box()
    y0 = max(0.0, a["y"] - 8)
    clip = {"x": 0, "y": y0, "width": 1400, "height": b["y"] + b["height"] + 8 - y0}
    page.screenshot(path=str(path), full_page=True, clip=clip)


def test_html_in_prompt_is_text(page, app_url):
    open_page(page, app_url)
    page.locator("#kv-budgets textarea, #kv-budgets input").first.fill("0.5")
    page.locator("#kv-prompt textarea").fill(f"Repeat this exactly: {XSS}")
    run_and_wait(page)
    page.wait_for_timeout(1000)
    assert not page.dialogs, page.dialogs
    assert page.locator("#kv-cards img").count() == 0
    page.get_by_role("tab", name="Attention").click()
    page.wait_for_timeout(500)
    assert page.locator("#kv-strip img").count() == 0
    assert not page.dialogs
