"""What each head keeps, on the real embedded model: the kept-position snapshots and the maps drawn from them."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.core.results import CompareResult
from kvlab.engine.specs import GenerationSettings
from kvlab.measure.retention import RetentionSettings
from kvlab.report import retention_map as rm
from kvlab.run import Comparison, compare

METHODS = ["exact", "scissorhands", "streaming", "kivi", "subgen", "snapkv+kivi2"]


@pytest.fixture(scope="module")
def result(engine, long_text) -> CompareResult:
    comparison = Comparison(
        long_text[:1400],
        METHODS,
        ["0.25"],
        settings=GenerationSettings(max_new_tokens=12),
        retention=RetentionSettings(snapshots=4),
    )
    return CompareResult.from_json(compare(engine, comparison).to_json())  # through JSON, as the page stores it


def maps(result) -> dict[str, rm.RunMap]:
    return {m.label: m for m in rm.maps_of(result)}


def test_every_run_has_snapshots_bounded_in_number(result):
    got = maps(result)
    assert set(got) == {r.label for r in result.runs}
    for m in got.values():
        assert m.layers == 30 and m.kv_heads == 3 and m.prompt_tokens == result.prompt_tokens
        assert m.snapshots[0]["stage"] == "compressed" and m.snapshots[0]["seen"] == result.prompt_tokens
        # after compression, up to 4 decode steps for a run that changes while decoding, and the end
        assert len(m.snapshots) <= (6 if m.streaming else 2)
        assert m.snapshots[-1]["seen"] == result.prompt_tokens + len(result.run(m.label).token_ids) - 1


def test_exact_holds_everything_at_full_precision(result):
    m = maps(result)["exact"]
    held, full = m.masks(m.snapshots[-1])
    assert held.all() and full.all()


def test_scissorhands_evicts_prompt_tokens_while_decoding(result):
    m = maps(result)["scissorhands@0.25"]
    n = m.prompt_tokens
    first, last = (m.masks(s)[0][:, :n] for s in (m.snapshots[0], m.snapshots[-1]))
    assert m.streaming and len(m.steps) > 2
    assert (first & ~last).any()  # prompt tokens held after compression, evicted later
    assert not (last & ~first).any()  # an evicted prompt token never comes back


def test_streaming_keeps_its_sinks_and_a_window(result):
    m = maps(result)["streaming@0.25"]
    params = result.run("streaming@0.25").params
    held, full = m.masks(m.snapshots[-1])
    seen = held.shape[1]
    z = rm.codes(held, full, m.summarizes, None, seen)
    assert (z[:, : params["n_sink"]] == rm.SINK).all()
    assert (z[:, seen - params["window"] :] == rm.WINDOW).all()
    assert ((z[:, params["n_sink"] : seen - params["window"]]) == rm.EVICTED).all()


def test_quantized_tokens_carry_their_measured_bits(result):
    kivi = maps(result)["kivi@0.25"]
    held, full = kivi.masks(kivi.snapshots[-1])
    assert held.all() and full.any() and not full.all()  # the residual at full precision, the rest as codes
    assert full[:, -1].all()  # the residual is the newest tokens
    bits = result.run("kivi@0.25").params["bits"]
    assert bits < kivi.snapshots[-1]["bits"] < 16  # the codes' bits plus their scales and minimums
    comp = maps(result)["snapkv+kivi2@0.25"]
    held, full = comp.masks(comp.snapshots[0])
    assert not full.any() and held.any()  # every token it keeps is stored as 2-bit codes
    assert 2 < comp.snapshots[0]["bits"] <= 4.05  # 2-bit codes and their constants, within 0.25 of 16 bits


def test_subgen_holds_sinks_and_recent_exactly_and_summarizes_the_rest(result):
    m = maps(result)["subgen@0.25"]
    params = result.run("subgen@0.25").params
    held, full = m.masks(m.snapshots[0])
    assert m.summarizes and held.all()
    assert full[:, : params["sink"]].all() and full[:, -params["recent"] :].all()
    assert full.sum(axis=1).max() == params["sink"] + params["recent"]
    z = rm.codes(held, full, True, m.snapshots[0]["bits"], held.shape[1])
    assert (z == rm.SUMMARIZED).any() and not (z == rm.EVICTED).any()


def test_the_map_changes_with_the_step_for_scissorhands_only_where_it_should(result):
    label = "scissorhands@0.25"
    end = rm.last_step(result)
    first = rm.figure(result, step=0, labels=[label]).data[0].z
    last = rm.figure(result, step=end, labels=[label]).data[0].z
    assert not np.array_equal(first, last)
    same = "snapkv+kivi2@0.25"  # prefill-only: its prompt columns stay as compressed
    n = result.prompt_tokens
    a = rm.figure(result, step=0, labels=[same]).data[0].z[:, :n]
    b = rm.figure(result, step=end, labels=[same]).data[0].z[:, :n]
    assert np.array_equal(a, b)
    fig = rm.figure(result, step=end)
    assert len(fig.data) == len(METHODS) and "decode step" in fig.layout.title.text


def test_a_prefill_only_run_between_its_two_snapshots(result):
    """Snapshotted after compression and at its end only: at a step between, its prompt as compressed and the
    generated tokens so far (its end snapshot, cut there)."""
    m = maps(result)["snapkv+kivi2@0.25"]
    n, end = result.prompt_tokens, int(m.snapshots[-1]["step"])
    assert not m.streaming and len(m.snapshots) == 2 and end >= 2
    mid = end // 2
    view = m.at(mid)
    assert view["seen"] == n + mid
    held, _ = m.masks(view)
    first, _ = m.masks(m.snapshots[0])
    assert held.shape[1] == n + mid and np.array_equal(held[:, :n], first) and held[:, n:].all()


def test_a_question_asked_after_compression_gets_its_own_snapshot(engine, long_text):
    comparison = Comparison(
        long_text[:900],
        ["exact", "streaming"],
        ["0.5"],
        settings=GenerationSettings(max_new_tokens=4),
        questions=["What does the text define?"],
        retention=RetentionSettings(snapshots=2),
    )
    result = compare(engine, comparison)
    m = next(x for x in rm.maps_of(result) if x.label == "streaming@0.5")
    stages = [s["stage"] for s in m.snapshots]
    assert stages[:2] == ["compressed", "question"]
    context = result.context_tokens
    assert m.snapshots[0]["seen"] == context == m.prompt_tokens
    assert m.snapshots[1]["seen"] == result.prompt_tokens > context  # the question's tokens fed through the cache
    assert "after the question" in rm.run_title(m, m.snapshots[1], 0)
