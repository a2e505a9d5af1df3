"""Fault isolation on the real embedded model: a method that raises ends its own run, not the comparison.

Test-only methods are registered for this module only (removed again at its end): they behave as
StreamingLLM until they raise in ``compress``, ``append`` or ``attend`` at a chosen decode step,
or run out of memory.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from kvlab.engine import faults
from kvlab.engine.comparison import Engine
from kvlab.engine.specs import GenerationSettings
from kvlab.measure.metrics import ProbeSettings
from kvlab.methods import registry
from kvlab.methods.streaming import StreamingLLM
from kvlab.run import Comparison, compare

PROMPT = "The cat sat on the mat because the mat was warm. Tell me about the cat in one sentence."
FAIL_STEP = 3  # the decode step at which the attend / append failures raise
ALIVE: list[weakref.ref] = []  # the out-of-memory method's instances, to check they are freed


class _Raising(StreamingLLM):
    """StreamingLLM that raises ``exc`` in ``where`` ("compress", "append" or "attend") at decode step FAIL_STEP."""

    where = ""
    exc: type[BaseException] = RuntimeError

    def __init__(self, *args, **kw):
        self._maybe_raise("init")
        super().__init__(*args, **kw)
        self.steps = 0
        ALIVE.append(weakref.ref(self))

    def _maybe_raise(self, where: str) -> None:
        if where == self.where:
            raise self.exc(f"test fault in {where} of <b>{self.name}</b>")

    def plan(self, n_prompt):
        self._maybe_raise("plan")
        return super().plan(n_prompt)

    def compress(self, state):
        self._maybe_raise("compress")
        return super().compress(state)

    def append(self, layer, k, v, pos):
        if layer == 0:
            self.steps += 1
        if self.steps == FAIL_STEP:
            self._maybe_raise("append")
        return super().append(layer, k, v, pos)

    def attend(self, layer, q):
        if self.steps == FAIL_STEP and layer == 5:
            self._maybe_raise("attend")
        return super().attend(layer, q)


def _method(name: str, where: str, exc: type[BaseException] = RuntimeError) -> type:
    return type(name.replace("-", "_"), (_Raising,), {"name": name, "where": where, "exc": exc})


TEST_METHODS = [
    _method("fail-init", "init"),
    _method("fail-plan", "plan"),
    _method("fail-compress", "compress"),
    _method("fail-append", "append"),
    _method("fail-attend", "attend"),
    _method("fail-oom", "attend", MemoryError),
]


@pytest.fixture(scope="module", autouse=True)
def test_methods():
    for cls in TEST_METHODS:
        registry.register(cls)
    yield
    for cls in TEST_METHODS:
        registry.unregister(cls.name)


def _compare(engine, methods, measure=True, tokens=8):
    c = Comparison(
        PROMPT,
        methods,
        ["0.5"],
        settings=GenerationSettings(max_new_tokens=tokens),
        measure=ProbeSettings() if measure else None,
    )
    return compare(engine, c)


@pytest.fixture(scope="module")
def reference(engine):
    return _compare(engine, ["exact", "streaming"])


def test_failing_methods_end_only_their_runs(engine, reference):
    """With the measurements on: the teacher-forced copies and the probes' rows also skip the failed runs."""
    result = _compare(engine, ["exact", "fail-compress", "streaming", "fail-attend", "fail-append"])
    by = {r.method: r for r in result.runs}
    for label in ("exact", "streaming@0.5"):
        good, ref = result.run(label), reference.run(label)
        assert good.token_ids == ref.token_ids and good.finish_reason == ref.finish_reason and not good.error
    # the survivors' measurements are whole
    assert len(by["streaming"].metrics["attn_rel_error"]) == len(reference.run("streaming@0.5").token_ids) - 1
    assert by["streaming"].metrics["kl"] == pytest.approx(reference.run("streaming@0.5").metrics["kl"], abs=1e-3)

    comp = by["fail-compress"]
    assert comp.finish_reason == "error" and comp.token_ids == [] and comp.kv_bytes == 0
    assert "top1_agreement" not in comp.metrics and "attn_map" not in comp.extras  # nothing was measured
    assert comp.error == "RuntimeError: test fault in compress of <b>fail-compress</b>"
    for where in ("attend", "append"):
        r = by[f"fail-{where}"]
        assert r.finish_reason == "error" and f"test fault in {where}" in r.error
        # the first token comes from the prefill, then one per decode step before the failing one
        assert len(r.token_ids) == FAIL_STEP
        assert r.token_ids == result.run("streaming@0.5").token_ids[:FAIL_STEP]
    js = result.to_json()
    assert [r["error"] == "" for r in js["runs"]] == [True, False, True, False, False]


@pytest.mark.parametrize("where", ["init", "plan"])
def test_a_constructor_or_plan_that_raises_ends_only_its_run(engine, reference, where):
    result = _compare(engine, ["exact", f"fail-{where}", "streaming"], measure=False)
    failed = result.run(f"fail-{where}@0.5")
    assert failed.finish_reason == "error" and failed.token_ids == [] and f"test fault in {where}" in failed.error
    for label in ("exact", "streaming@0.5"):
        assert result.run(label).token_ids == reference.run(label).token_ids and not result.run(label).error


def test_error_shows_on_the_card_as_text(engine):
    from kvlab.ui.cards import cards_html

    result = _compare(engine, ["exact", "fail-compress"], measure=False, tokens=3)
    html = cards_html(result, engine.lm)
    assert "test fault in compress of &lt;b&gt;fail-compress&lt;/b&gt;" in html
    assert "<b>fail-compress</b>" not in html.replace("<b>fail-compress@0.5</b>", "")


def test_out_of_memory_ends_the_request_frees_it_and_the_next_runs(engine, reference):
    ALIVE.clear()
    with pytest.raises(faults.OutOfMemory, match="out of memory \\(RAM\\).*shorter prompt"):
        _compare(engine, ["exact", "streaming", "fail-oom"])
    gc.collect()
    assert ALIVE and all(ref() is None for ref in ALIVE), "the failed comparison's caches are still referenced"
    again = _compare(engine, ["exact", "streaming"])
    assert again.run("streaming@0.5").token_ids == reference.run("streaming@0.5").token_ids


def test_out_of_memory_on_the_page_is_one_message(lm):
    gr = pytest.importorskip("gradio")
    from kvlab.ui import Dashboard

    dash = Dashboard(lm)
    inputs = ["embedded", PROMPT, [], ["fail-oom"], "0.5", 6, 0, None, False, None, 0, None]
    with pytest.raises(gr.Error, match="out of memory"):
        list(dash.compare(*inputs))
    *_, last = dash.compare(*inputs[:3], ["streaming"], *inputs[4:])
    assert "done: 2 runs" in last[0]


def test_time_limit_stops_the_comparison_keeping_the_tokens_so_far(lm, monkeypatch):
    from kvlab.core import cancel

    engine = Engine(lm, time_limit_s=1e-6)
    with pytest.raises(cancel.TimeLimit, match="time limit of 1e-06 s .* before the first token"):
        _compare(engine, ["exact", "streaming"], measure=False, tokens=50)
    # the limit passes once the prefill is done: the runs keep their first token
    monkeypatch.setattr(cancel.Token, "within", classmethod(lambda cls, seconds, why: cls(None, why, None)))
    result = _compare(engine, ["exact", "streaming"], measure=False, tokens=50)
    for r in result.runs:
        assert r.finish_reason == "time_limit" and "time limit of 1e-06 s" in r.error
        assert len(r.token_ids) == 1  # the first token (from the prefill); no decode step started
    events = list(
        __import__("kvlab.run", fromlist=["stream"]).stream(
            engine, Comparison(PROMPT, ["exact"], settings=GenerationSettings(max_new_tokens=50))
        )
    )
    assert "time limit" in events[-1].message and events[-1].kind == "done"


def test_time_limit_from_the_environment():
    assert faults.time_limit_s({}) is None
    assert faults.time_limit_s({"SPACE_ID": "someone/kvlab"}) == faults.SPACE_TIME_LIMIT_S
    assert faults.time_limit_s({"SPACE_ID": "x", "KVLAB_TIME_LIMIT_S": "0"}) is None
    assert faults.time_limit_s({"KVLAB_TIME_LIMIT_S": "12.5"}) == 12.5


def test_guard_outside_a_forward_raises():
    with pytest.raises(ZeroDivisionError):
        faults.guard(0, lambda: 1 / 0)
    with faults.collect() as rec:
        assert faults.guard(2, lambda: 1 / 0) is None and faults.failed(2) and not faults.failed(1)
        with pytest.raises(MemoryError):
            faults.guard(1, _raise_memory)
    assert rec.errors == {2: "ZeroDivisionError: division by zero"}


def _raise_memory():
    raise MemoryError
