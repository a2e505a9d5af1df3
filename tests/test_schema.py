"""Result files are untrusted input: crafted exports are refused with one message naming the problem."""

from __future__ import annotations

import json

import pytest

from kvlab.report.result_file import ImportLimits, ResultFileError, load_result_text

SCRIPT = '<img src=x onerror="alert(1)"><script>alert(2)</script>'


def _valid() -> dict:
    run = {
        "method": "snapkv",
        "budget": "0.25",
        "params": {"window": 32},
        "text": "Paris",
        "token_ids": [1, 2, 3],
        "kv_bytes": 1000,
        "kv_bytes_breakdown": {"keys": 500, "values": 500},
        "kv_bytes_per_step": [1000, 1010],
        "exact_kv_bytes_per_step": [4000, 4040],
        "finish_reason": "length",
        "timings": {"prefill_s": 0.1, "compress_s": 0.01, "decode_s": 0.2, "tokens_per_s": 10.0},
        "metrics": {"kl_mean": 0.1, "attn_rel_error": [[0.1, 0.2]]},
        "extras": {},
    }
    return {
        "model": {"id": "embedded"},
        "prompt": "What is the capital of France?",
        "prompt_tokens": 3,
        "prompt_token_ids": [5, 6, 7],
        "settings": {"max_new_tokens": 2},
        "timings": {"compare_s": 0.5},
        "runs": [dict(run, method="exact", budget=None), run],
    }


def test_a_valid_export_round_trips():
    result = load_result_text(json.dumps(_valid()))
    assert [r.label for r in result.runs] == ["exact", "snapkv@0.25"]


def test_script_in_strings_is_kept_as_text():
    data = _valid()
    data["prompt"] = SCRIPT
    data["runs"][1]["method"] = SCRIPT
    data["runs"][1]["text"] = SCRIPT
    result = load_result_text(json.dumps(data))
    assert result.runs[1].method == SCRIPT  # accepted as text; renderers escape it


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d["runs"][1]["metrics"].update(kl_mean=float("nan")), "metrics.kl_mean: NaN is not a finite number"),
        (
            lambda d: d["runs"][1]["timings"].update(decode_s=float("inf")),
            "timings.decode_s: Infinity is not a finite number",
        ),
        (lambda d: d.update(runs=[d["runs"][0]] * 100), "100 runs (1..64 allowed)"),
        (lambda d: d.update(runs=[]), "0 runs"),
        (lambda d: d["runs"][1].update(token_ids=list(range(20000))), "token_ids: 20000 entries (at most 16384)"),
        (lambda d: d["runs"][1].update(token_ids=["a"]), "token_ids: must be a list of non-negative integers"),
        (lambda d: d["runs"][1].update(method=["x"]), "method: must be str, got list"),
        (lambda d: d["runs"][1].update(method="m" * 500), "method: 500 characters"),
        (lambda d: d.update(prompt_tokens=-1), "prompt_tokens: -1 is outside"),
        (lambda d: d.update(prompt_tokens="3"), "prompt_tokens: must be int, got str"),
        (lambda d: d["runs"][1].update(budget="<b>1.5</b>"), "runs[1].budget: budget"),
        (lambda d: d.pop("runs"), "$.runs: missing"),
        (lambda d: d["runs"][1].update(kv_bytes=-5), "kv_bytes: must be >= 0"),
        (lambda d: d["runs"][1]["extras"].update(deep=json.loads("[" * 20 + "]" * 20)), "nested deeper"),
        (lambda d: d.update(prompt="x" * 300_000), "string of 300000 characters"),
    ],
)
def test_crafted_files_are_refused(mutate, expected):
    data = _valid()
    mutate(data)
    with pytest.raises(ResultFileError) as err:
        load_result_text(json.dumps(data))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_not_json_and_too_big():
    with pytest.raises(ResultFileError, match="not valid JSON"):
        load_result_text("{not json")
    with pytest.raises(ResultFileError, match="must be a JSON object"):
        load_result_text("[1, 2]")
    with pytest.raises(ResultFileError, match="at most 100 are accepted"):
        load_result_text(json.dumps(_valid()), ImportLimits(max_bytes=100))


def test_a_real_export_validates(engine, lm):
    from kvlab.core.budgets import Budget
    from kvlab.engine.specs import GenerationSettings, RunSpec

    ids = lm.encode("Name three colours.")
    result = engine.compare(ids, [RunSpec("exact"), RunSpec("h2o", Budget(fraction=0.5))], GenerationSettings(3))
    again = load_result_text(result.dumps())
    assert again.to_json() == result.to_json()
