"""The one comparison flow (kvlab.run) that the CLI, the dashboard and the sweeps share."""

import pytest

from kvlab.engine.specs import GenerationSettings, InputError
from kvlab.measure.metrics import ProbeSettings
from kvlab.run import Comparison, compare, stream
from kvlab.tasks import make_task, prompt_ids, prompt_text


def test_prompt_gets_text_metrics_and_no_task_score(engine):
    c = Comparison("Name a colour.", ["exact", "streaming"], ["0.5"], settings=GenerationSettings(max_new_tokens=3))
    result = compare(engine, c)
    assert [r.label for r in result.runs] == ["exact", "streaming@0.5"]
    assert result.prompt == "Name a colour." and result.prompt_token_ids == engine.lm.encode("Name a colour.")
    for r in result.runs:
        assert "text_similarity" in r.metrics and "first_divergence" in r.metrics and "task_score" not in r.metrics
        assert "attn_rel_error" not in r.metrics  # measurements off by default


def test_task_travels_with_its_prompt_and_is_scored(engine, lm):
    task = make_task("passkey", 120, 0, lm.encode)
    c = Comparison(task, ["exact", "streaming"], ["16t"], settings=GenerationSettings(max_new_tokens=3))
    assert c.prompt == prompt_text(task) and c.task is task and c.encode(lm) == prompt_ids(lm, task)
    events = list(stream(lm, c))  # a LoadedModel works as well as an Engine
    assert events[-1].kind == "done" and events[0].kind == "prefill"
    result = events[-1].result
    assert result.prompt == prompt_text(task) and result.prompt_token_ids == prompt_ids(lm, task)
    assert all(r.metrics["task_score"] in (0.0, 1.0) for r in result.runs)


def test_measurements_on_request(engine, lm):
    c = Comparison("Name a colour.", ["exact"], measure=ProbeSettings(maps=False), settings=GenerationSettings(3))
    (r,) = compare(engine, c).runs
    assert len(r.metrics["attn_rel_error"][0]) == lm.info.n_layers and r.metrics["top1_agreement"] == 1.0


def test_checks_before_any_model_work():
    with pytest.raises(InputError, match="allowed"):
        Comparison("hi", ["nope"]).check()
    with pytest.raises(InputError, match="allowed"):
        Comparison("hi", ["exact"], settings=GenerationSettings(max_new_tokens=0)).check()
