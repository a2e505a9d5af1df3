"""The red-team table of docs/dashboard.md, kept true: each hostile input goes through the page's functions.

Every row of ``CASES`` is one hostile input: the field, what is sent, and a call to the function
the page runs for it (``Dashboard.request``, behind both the plan line and Run; ``load_json`` for
imports; the engine's settings check for the knobs only the CLI and the API have). The test
renders each row as it appears in the docs and checks that the docs hold it verbatim. After a
change, print the table again and paste it:

    PYTHONPATH=.:tests python tests/test_redteam.py
"""

from __future__ import annotations

import html
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "dashboard.md"
XSS = "<img src=x onerror=alert(1)>"
NEST = json.loads("[" * 20 + "]" * 20)
MAX_ANSWER = 260


@dataclass(frozen=True)
class Case:
    field: str
    sent: str  # what is sent, as the table shows it
    call: Callable  # (dashboard) -> the page's answer
    cut: str = ""  # the answer is shown up to and with this text (what follows it lists the registry)


def page(**kw) -> Callable:
    """The page's answer to a setup: refused with its message, or accepted with the plan line."""

    def call(dash):
        from kvlab.engine.specs import InputError
        from kvlab.ui import PageInputs

        inputs = {"prompt": "hello there", "papers": [], "baselines": ["streaming"], "budgets": "0.5", "max_new": 2}
        inputs.update(record_maps=False)
        inputs.update({k: v(dash) if callable(v) else v for k, v in kw.items()})
        try:
            engine, comparison, n = dash.request(PageInputs(**inputs))
        except InputError as exc:
            return f"refused: {exc}"
        task = f"; scored as the task {comparison.task.name!r}" if comparison.task is not None else ""
        return f"accepted: {dash.estimate(engine, comparison, n).summary()}{task}"

    return call


def on_space(call: Callable) -> Callable:
    """The same call on a page started as a Hugging Face Space starts it (``SPACE_ID`` set): the fixed list."""

    def on(dash):
        from kvlab.ui import Dashboard, Limits
        from kvlab.ui.config import fixed_models, model_choice_allowed

        limits = Limits(allow_model_choice=model_choice_allowed({"SPACE_ID": "someone/kvlab"}), models=fixed_models({}))
        space = Dashboard(dash.lm, limits)
        space.tasks = dash.tasks
        return call(space)

    return on


def settings(**kw) -> Callable:
    """The engine's answer to generation settings the page does not expose (CLI ``--sample`` flags, the API)."""

    def call(dash):
        from kvlab.engine.specs import GenerationSettings, InputError

        try:
            GenerationSettings(do_sample=True, **kw).validate()
        except InputError as exc:
            return f"refused: {exc}"
        return "accepted"

    return call


def imported(content: Callable[[], bytes]) -> Callable:
    """The page's answer to a file given to the import control."""

    def call(dash):
        import gradio as gr

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "import.json"
            path.write_bytes(content())
            try:
                status = dash.load_json(str(path), "mean", None)[0]
            except gr.Error as exc:
                return f"refused: {html.unescape(exc.message)}"  # the toast shows it as text
        return "loaded: " + status.split("kv-progress-msg'>")[1].split("</div>")[0]

    return call


def _valid() -> dict:
    from crafted import hostile_strings

    return hostile_strings()


def _json(mutate: Callable[[dict], object] = lambda d: None) -> Callable[[], bytes]:
    def content() -> bytes:
        data = _valid()
        mutate(data)
        return json.dumps(data).encode()

    return content


def preset(dash) -> str:
    """The default preset's prompt: a task's text (scored while the prompt is that text exactly)."""
    from kvlab.ui.prompt_presets import DEFAULT_PRESET

    return dash.tasks[DEFAULT_PRESET].prompt


FIVE = ["streaming", "h2o", "snapkv", "pyramidkv", "uniform"]


CASES = [
    Case("prompt", "empty", page(prompt="")),
    Case("prompt", "spaces, tabs and newlines only", page(prompt=" \t\n ")),
    Case("prompt", "not text (a list)", page(prompt=["a"])),
    Case("prompt", "200,000 characters", page(prompt="lorem ipsum " * 16_667)),
    Case("prompt", "a lone surrogate `\\ud800`", page(prompt="\ud800 hello")),
    Case("prompt", f"`{XSS}` and `<script>`", page(prompt=f"{XSS}<script>alert(1)</script>")),
    Case("prompt", "NUL and control characters", page(prompt="a\x00b\x01c\x1bd")),
    Case("prompt", "a preset's text exactly (its task is scored)", page(prompt=preset)),
    Case("prompt", "a preset's text with one character added", page(prompt=lambda d: preset(d) + ".")),
    Case("question", "spaces, tabs and newlines only", page(question=" \t\n ")),
    Case("question", "not text (a list, API)", page(question=["a"])),
    Case("question", "200,000 characters", page(question="lorem ipsum " * 16_667)),
    Case("question", "a lone surrogate `\\ud800`", page(question="\ud800 hello")),
    Case("question", f"`{XSS}` and `<script>`", page(question=f"{XSS}<script>alert(1)</script>")),
    Case("question", "NUL and control characters", page(question="a\x00b\x01c\x1bd")),
    Case("question", "after a preset's prompt (its task is not scored)", page(prompt=preset, question="Why?")),
    Case("methods", "none ticked", page(baselines=[])),
    Case("methods", f"an unknown name `{XSS}` (API)", page(baselines=[XSS]), cut="; allowed:"),
    Case("methods", "`streaming` 1,000 times (API)", page(baselines=["streaming"] * 1000)),
    Case("methods", "five baselines at 6 budgets", page(baselines=FIVE, budgets="0.9,0.8,0.5,0.25,0.1,64t")),
    Case("budgets", "empty", page(budgets="")),
    Case("budgets", "`0`", page(budgets="0")),
    Case("budgets", "`-0.5`", page(budgets="-0.5")),
    Case("budgets", "`1.5`", page(budgets="1.5")),
    Case("budgets", "`nan`", page(budgets="nan")),
    Case("budgets", "`1e309` (overflows to infinity)", page(budgets="1e309")),
    Case("budgets", "`0t`", page(budgets="0t")),
    Case("budgets", "`99999999999999999999t`", page(budgets="99999999999999999999t")),
    Case("budgets", f"`{XSS}`", page(budgets=XSS)),
    Case("budgets", "`0.5` 10,000 times", page(budgets=",".join(["0.5"] * 10_000))),
    Case("max new tokens", "`0`", page(max_new=0)),
    Case("max new tokens", "`1000000000`", page(max_new=10**9)),
    Case("max new tokens", "`2.5`", page(max_new=2.5)),
    Case("max new tokens", "`'abc'` (API)", page(max_new="abc")),
    Case("max new tokens", "NaN (API)", page(max_new=float("nan"))),
    Case("seed", "`-1`", page(seed=-1)),
    Case("seed", "`2**64`", page(seed=2**64)),
    Case("seed", "`1.5` (API)", page(seed=1.5)),
    Case("seed", "infinity (API)", page(seed=float("inf"))),
    Case("parameters", "streaming `window` = `abc`", page(param_table=[["streaming", "window", "abc", "auto", ""]])),
    Case("parameters", "streaming `n_sink` = `-3`", page(param_table=[["streaming", "n_sink", "-3", "4", ""]])),
    Case("parameters", "an unknown parameter row", page(param_table=[["streaming", XSS, "1", "0", ""]])),
    Case("parameters", "a table of garbage rows (API)", page(param_table=[None, ["x"], 5, "row"])),
    Case("attention map", "layer `99`", page(record_maps=True, map_layer=99)),
    Case("attention map", "head `-1`", page(record_maps=True, map_head=-1)),
    Case("attention map", "layer `'abc'` (API)", page(record_maps=True, map_layer="abc")),
    Case("model", "`../../etc/passwd`", page(model="../../etc/passwd")),
    Case("model", "`<img src=x onerror=alert(1)>`", page(model=XSS)),
    Case("model", "`../../etc/passwd` on a Space (a fixed list)", on_space(page(model="../../etc/passwd"))),
    Case("temperature", "`0` with sampling (CLI / API)", settings(temperature=0.0)),
    Case("temperature", "NaN with sampling (CLI / API)", settings(temperature=float("nan"))),
    Case("top-p", "`0` (CLI / API)", settings(top_p=0.0)),
    Case("top-p", "NaN (CLI / API)", settings(top_p=float("nan"))),
    Case("import", "not JSON", imported(lambda: b"\x89PNG\r\n\x1a\n garbage")),
    Case("import", "an empty file", imported(lambda: b"")),
    Case("import", "a JSON array", imported(lambda: b"[1, 2, 3]")),
    Case("import", "33 MiB of spaces", imported(lambda: b" " * (33 * 1024**2))),
    Case("import", "10,000 nested lists", imported(lambda: b"[" * 10_000 + b"]" * 10_000)),
    Case("import", "NaN in a run's bytes", imported(_json(lambda d: d["runs"][1].update(kv_bytes=float("nan"))))),
    Case(
        "import", "70,000 prompt token ids", imported(_json(lambda d: d.update(prompt_token_ids=list(range(70_000)))))
    ),
    Case("import", "201 runs", imported(_json(lambda d: d.update(runs=d["runs"] * 67)))),
    Case("import", "a run's budget `<b>2</b>`", imported(_json(lambda d: d["runs"][1].update(budget="<b>2</b>")))),
    Case(
        "import",
        "a key holding HTML, nested 20 deep",
        imported(_json(lambda d: d["runs"][0]["extras"].update({XSS: NEST}))),
    ),
    Case("import", "HTML and script in every string field but the budgets", imported(_json())),
]


def _cell(text: str) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= MAX_ANSWER else text[: MAX_ANSWER - 1] + "…"


def row(i: int, case: Case, answer: str) -> str:
    """One table row; an answer holding markup is shown as code, so that the docs render it as text."""
    answer = _cell(answer).replace("`", "'")
    return f"| {i} | {case.field} | {_cell(case.sent)} | {f'`{answer}`' if '<' in answer else answer} |"


def table(dash) -> str:
    head = "| # | field | hostile input | the page answers |\n|---|---|---|---|\n"
    return head + "\n".join(row(i, c, _answer(c, dash)) for i, c in enumerate(CASES, 1))


def _answer(case: Case, dash) -> str:
    answer = case.call(dash)
    if case.cut and case.cut in answer:
        answer = answer[: answer.index(case.cut) + len(case.cut)] + " …"
    return answer


@pytest.fixture(scope="module")
def dash(lm):
    pytest.importorskip("gradio")
    from kvlab.ui import Dashboard, Limits, presets
    from kvlab.ui.config import model_choice_allowed

    dash = Dashboard(lm, Limits(allow_model_choice=model_choice_allowed({})))  # a local run, whatever the env
    dash.tasks = presets(lm)[1]  # as the page sets them
    return dash


@pytest.mark.parametrize("i", range(1, len(CASES) + 1))
def test_the_docs_table_says_what_the_page_answers(dash, i):
    case = CASES[i - 1]
    answer = _answer(case, dash)
    assert answer.startswith(("refused: ", "accepted", "loaded: ")), answer
    assert row(i, case, answer) in DOC.read_text(), f"docs/dashboard.md row {i} is out of date:\n{row(i, case, answer)}"


if __name__ == "__main__":
    from kvlab.engine.loader import load_model
    from kvlab.ui import Dashboard, Limits, presets
    from kvlab.ui.config import model_choice_allowed

    board = Dashboard(lm := load_model("embedded"), Limits(allow_model_choice=model_choice_allowed({})))
    board.tasks = presets(lm)[1]
    sys.stdout.write(table(board) + "\n")
