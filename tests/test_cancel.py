"""Cancel and the time limit stop the model work where it is, on the real embedded model.

A test hook on the decoder layers (added after kvlab's own check, so it sees the layers that
actually ran) cancels the comparison, or moves its deadline into the past, at a chosen layer of a
chosen forward; the work must stop before the next layer. Then the page's callbacks: Cancel reaches
the thread doing the model work, a preset's task applies only to its exact text, and the GPU
lease is sized from the right inputs. No timed assertions: what is counted is layers and steps.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import fields

import pytest
import torch

from kvlab.core import cancel
from kvlab.engine.comparison import Engine
from kvlab.engine.specs import GenerationSettings, Question, RunSpec
from kvlab.measure.metrics import ProbeSettings
from kvlab.run import Comparison, compare

PROMPT = "The cat sat on the mat because the mat was warm. Tell me about the cat in one sentence. " * 4


class LayerSpy:
    """Counts the decoder layers each forward ran; at ``(forward, layer)`` calls ``act(token)``."""

    def __init__(self, lm, at: tuple[int, int], act, when=lambda hidden: True):
        self.at, self.act, self.when = at, act, when
        self.forwards: list[int] = []  # layers run, per forward that ``when`` accepts
        self.layers = cancel.decoder_layers(lm.model, lm.info.n_layers)
        self.handles = [layer.register_forward_pre_hook(self._hook) for layer in self.layers]

    def _hook(self, module, args) -> None:
        hidden = args[0] if args else None
        if hidden is not None and not self.when(hidden):
            return
        if module is self.layers[0]:
            self.forwards.append(0)
        self.forwards[-1] += 1
        if (len(self.forwards) - 1, self.forwards[-1] - 1) == self.at:
            self.act(cancel.current())

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture()
def spy(lm):
    made: list[LayerSpy] = []

    def make(at, act, when=lambda hidden: True) -> LayerSpy:
        s = LayerSpy(lm, at, act, when)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _past(token) -> None:
    token.deadline = 0.0  # perf_counter() is past it: the time limit has passed


def _cancel(token) -> None:
    token.cancel()


def _runs():
    from kvlab.core.budgets import Budget

    return [RunSpec("exact"), RunSpec("streaming", Budget.parse("0.5")), RunSpec("h2o", Budget.parse("0.5"))]


def test_a_cancel_stops_the_prefill_before_the_next_layer(lm, spy):
    engine = Engine(lm, time_limit_s=None)
    s = spy((0, 4), _cancel)
    token = cancel.Token()
    with pytest.raises(cancel.Cancelled) as info:
        list(cancel.scoped(engine.stream(lm.encode(PROMPT), _runs()), token))
    assert not isinstance(info.value, cancel.TimeLimit)
    assert s.forwards == [5], "layers 0..4 ran; layer 5's check stopped the prefill"


def test_the_time_limit_stops_the_prefill_before_the_next_layer(lm, spy):
    engine = Engine(lm, time_limit_s=600)
    s = spy((0, 2), _past)
    with pytest.raises(cancel.TimeLimit, match="time limit of 600 s .* before the first token"):
        list(engine.stream(lm.encode(PROMPT), _runs()))
    assert s.forwards == [3]


def test_a_cancel_stops_the_question_fed_after_compression(lm, spy):
    engine = Engine(lm, time_limit_s=None)
    q = lm.encode(PROMPT + " Which animal?")[len(lm.encode(PROMPT)) - 6 :]
    chunk = lambda hidden: hidden.shape[0] > 1 and hidden.shape[1] > 1  # noqa: E731 - every run, several tokens
    s = spy((0, 1), _cancel, when=chunk)
    token = cancel.Token()
    ctx = lm.encode(PROMPT)
    with pytest.raises(cancel.Cancelled):
        list(cancel.scoped(engine.stream(ctx, _runs(), questions=[Question(q, "Which animal?")]), token))
    assert s.forwards == [2]


def test_a_cancel_stops_a_decode_step_and_the_probes(lm, spy):
    """Measurements on: the probes' work inside the layers stops with the step."""
    engine = Engine(lm, time_limit_s=None)
    decode = lambda hidden: hidden.shape[1] == 1  # noqa: E731 - one token per row
    s = spy((2, 7), _cancel, when=decode)
    token = cancel.Token()
    c = Comparison(PROMPT, ["exact", "streaming"], ["0.5"], settings=GenerationSettings(8), measure=ProbeSettings())
    with pytest.raises(cancel.Cancelled):
        with cancel.scope(token):
            compare(engine, c)
    assert s.forwards == [30, 30, 8]


def test_the_time_limit_inside_a_decode_step_keeps_the_tokens_so_far(lm, spy):
    """The step cut short is dropped: every run keeps the tokens of the steps before, and the
    measurements hold whole steps only."""
    engine = Engine(lm, time_limit_s=600)
    decode = lambda hidden: hidden.shape[1] == 1  # noqa: E731
    spy((2, 7), _past, when=decode)
    c = Comparison(PROMPT, ["exact", "streaming"], ["0.5"], settings=GenerationSettings(8), measure=ProbeSettings())
    result = compare(engine, c)
    for r in result.runs:
        assert r.finish_reason == "time_limit" and "before decode step 3" in r.error
        assert len(r.token_ids) == 3  # the prefill's token and two decode steps
    errors = result.run("streaming@0.5").metrics["attn_rel_error"]
    assert [len(step) for step in errors] == [lm.info.n_layers] * 2


# ----- the page ----------------------------------------------------------------------------
gr = pytest.importorskip("gradio")


class Session:
    """What Gradio hands a callback about the browser session."""

    def __init__(self, session_hash: str):
        self.session_hash = session_hash


@pytest.fixture(scope="module")
def dash(lm):
    from kvlab.ui import Dashboard, presets

    board = Dashboard(lm)
    board.tasks = presets(lm)[1]
    return board


def _page(prompt, question="", maps=False, baselines=("streaming",), new=2) -> list:
    return ["embedded", prompt, [], list(baselines), "0.5", new, 0, None, maps, None, 0, question]


def test_cancel_reaches_the_thread_doing_the_model_work(dash, lm, spy):
    """The page's Cancel (same session) stops the prefill running in Gradio's worker thread; another
    session's Cancel does not."""
    entered, outs, errors = threading.Event(), [], []

    def hold(token):  # at the prefill's layer 3: wait (bounded) until the page's Cancel lands
        entered.set()
        for _ in range(600):
            if token.cancelled:
                return
            threading.Event().wait(0.05)

    s = spy((0, 3), hold)

    def work():
        try:
            outs.extend(dash.compare(*_page(PROMPT * 3), progress=lambda *a, **k: None, request=Session("a")))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    assert entered.wait(120)
    assert "nothing was running" in dash.cancel(Session("b"))
    status = dash.cancel(Session("a"))
    worker.join(120)
    assert not worker.is_alive() and not errors
    assert "cancelled: the comparison was stopped (its model work ended" in status
    assert s.forwards == [4], "the prefill stopped before layer 4"
    assert not any("done:" in str(o[0]) for o in outs)
    assert dash.running == {}
    *_, last = dash.compare(*_page("Name a colour."), progress=lambda *a, **k: None, request=Session("a"))
    assert "done: 2 runs" in last[0]


def test_a_preset_task_applies_to_its_exact_text_only(dash, lm):
    from kvlab.ui import PageInputs
    from kvlab.ui.prompt_presets import DEFAULT_PRESET

    text = dash.tasks[DEFAULT_PRESET].prompt
    _, comparison, _ = dash.request(PageInputs(prompt=text, baselines=["streaming"], budgets="0.5"))
    assert comparison.task is dash.tasks[DEFAULT_PRESET]
    for other in (text + " ", text[:-1], "Explain what a KV cache is in two sentences."):
        _, comparison, n = dash.request(PageInputs(prompt=other, baselines=["streaming"], budgets="0.5"))
        assert comparison.task is None and comparison.source == other and n == len(lm.encode(other))
    _, comparison, _ = dash.request(PageInputs(prompt=text, baselines=["streaming"], budgets="0.5", question="Why?"))
    assert comparison.task is None and comparison.questions == ["Why?"]


def test_the_result_and_the_cards_say_which_prompt_ran(dash, lm):
    pasted = "Explain what a KV cache is in two sentences."
    *_, last = dash.compare(*_page(pasted), progress=lambda *a, **k: None)
    status, cards, data = last[0], last[1], last[2]
    n = len(lm.encode(pasted))
    assert f"done: 2 runs on {n} prompt tokens" in status
    assert data["prompt"] == pasted and data["prompt_tokens"] == n
    assert f"Ran on <b class='kv-prompt-tokens'>{n} prompt tokens</b>" in cards and pasted in cards
    assert "task" not in "".join(str(r["metrics"]) for r in data["runs"])


def test_the_page_inputs_are_named_in_the_callbacks_order():
    from kvlab.ui import Dashboard, PageInputs

    names = [f.name for f in fields(PageInputs)]
    assert list(inspect.signature(Dashboard.compare).parameters)[1 : 1 + len(names)] == names


def test_the_gpu_lease_is_sized_from_record_maps(dash, lm):
    """``work`` reads "record maps", not the map layer next to it; Gradio's extra arguments are ignored."""
    off = dash.work(*_page(PROMPT, maps=False)[:9], 15, 0, "", [], gr.Progress(), None)
    on = dash.work(*_page(PROMPT, maps=True)[:9], None, 0, "", [], gr.Progress(), None)
    assert (off.probes, on.probes) == (False, True)
    assert off.prompt_tokens == len(lm.encode(PROMPT)) and off.runs == 2 and off.new_tokens == 2
    asked = dash.work(*_page(PROMPT, question="Which animal sat on the mat?"))
    assert asked.prompt_tokens > off.prompt_tokens
    assert torch.is_grad_enabled()  # nothing here changed the autograd mode
