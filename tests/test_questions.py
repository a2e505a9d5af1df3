"""The query-agnostic protocol: the context compressed once, each question fed afterwards through every cache."""

import dataclasses
import json

import pytest
import torch

from kvlab import cli
from kvlab.core.budgets import Budget
from kvlab.engine.comparison import Engine
from kvlab.engine.lockstep import Decoder
from kvlab.engine.probe import Probe
from kvlab.engine.rows import DecodePaths
from kvlab.engine.specs import GenerationSettings, Question, RunSpec
from kvlab.measure.metrics import ProbeSettings
from kvlab.methods import get
from kvlab.report.result_file import load_result_text
from kvlab.run import Comparison, compare_all
from kvlab.tasks import make_task, prompt_ids, split_ids

QUESTIONS = [
    "What does the assert statement do?",
    "When is AssertionError raised?",
    "Answer in one word: is assert a statement or a function?",
]
# a short budget in tokens and small windows, so every method evicts or quantizes inside the question
METHODS = {
    "exact": {},
    "streaming": {},
    "h2o": {},
    "snapkv": {},
    # float32 score products, like the float32 caches below: bfloat16 would round the same S q, made by a
    # product over c rows or over one, apart by one bfloat16 step (the 16-bit cache's case in products)
    "qjl": {"residual": 8, "outlier_group": 8, "products": "float32"},
    "kivi": {"residual": 8, "group": 8},
    "subgen-kcenter": {},
    "scissorhands": {},
}


@pytest.fixture(scope="module")
def context(long_text):
    return long_text[:600]  # about 130 tokens of the reference manual


def _specs(budget="48t"):
    return [RunSpec(m, None if m == "exact" else Budget.parse(budget), p) for m, p in METHODS.items()]


def test_one_compression_per_method_and_the_chunk_equals_feeding_token_by_token(lm, context, monkeypatch):
    """Three questions: every method compresses once; each question's answer equals the one obtained by
    feeding the same question tokens one decode step at a time through the same compressed caches.

    float32 caches: the chunk's linears run on B x c rows, the decode path's on B, so K/V may differ in
    the last bit; a 16-bit cache can round such a pair apart by one 16-bit step, which a quantizer
    (QJL's signs, KIVI's codes) can turn into a different code and, rarely, a different token."""
    lm = lm.with_cache_dtype("float32")
    ctx, rests = split_ids(lm, context, QUESTIONS)
    questions = [Question(ids, q) for ids, q in zip(rests, QUESTIONS)]
    calls: list[str] = []
    for name in METHODS:
        cls = get(name)
        original = cls.compress

        def counted(self, state, _original=original):
            calls.append(self.name)
            return _original(self, state)

        monkeypatch.setattr(cls, "compress", counted)
    gen = GenerationSettings(max_new_tokens=6)
    chunked = Engine(lm).compare_all(ctx, _specs(), gen, questions=questions)
    assert sorted(calls) == sorted(METHODS)  # one compression per method for all three questions
    stepwise = Engine(lm, paths=DecodePaths(chunked_questions=False)).compare_all(
        ctx, _specs(), gen, questions=questions
    )
    assert len(chunked) == len(stepwise) == 3
    for q, a, b in zip(QUESTIONS, chunked, stepwise):
        assert a.protocol == "query-agnostic" and a.question == q and a.context_tokens == len(ctx)
        for ra, rb in zip(a.runs, b.runs):
            assert ra.token_ids == rb.token_ids, (q, ra.label, ra.text, rb.text)
            assert ra.kv_bytes_per_step[:2] == rb.kv_bytes_per_step[:2], ra.label
    # the methods did compress: the cache after the question holds less than the exact one
    for r in chunked[0].runs[1:]:
        assert r.kv_bytes_per_step[1] < 0.8 * r.exact_kv_bytes_per_step[1], r.label


def test_exact_query_agnostic_equals_generate(engine32, lm, context):
    """exact never compresses: asking after the context equals transformers' generate on the whole prompt.

    The two questions differ in length and decode in one batch, each row at its own true position."""
    ctx, rests = split_ids(lm, context, [QUESTIONS[0], QUESTIONS[2]])
    assert len(rests[0]) != len(rests[1])
    gen = GenerationSettings(max_new_tokens=12)
    results = engine32.compare_all(ctx, [RunSpec("exact")], gen, questions=[Question(r) for r in rests])
    for rest, res in zip(rests, results):
        ids = ctx + rest
        assert res.prompt_token_ids == ids
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert res.runs[0].token_ids == out[0, len(ids) :].tolist()
        aware = engine32.compare(ids, [RunSpec("exact")], gen)
        assert aware.runs[0].token_ids == res.runs[0].token_ids


class _Keep(Probe):
    """Keeps the compressors a probe sees (each question's fork) to read their positions afterwards."""

    def on_prefill(self, state, logits, comps):
        self.comps = comps

    def on_step(self, step, rows, logits):
        pass

    def finish(self, runs):
        pass


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_positions_after_the_question_are_true(engine, lm, context, method):
    """Tokens appended after the chunk sit at their true indices: the question at n..n+c-1, then the
    generated tokens (snapkv keeps them all; h2o keeps at least its recent window)."""
    ctx, rests = split_ids(lm, context, QUESTIONS[:1])
    n, c, new = len(ctx), len(rests[0]), 5
    keep = _Keep()
    res = engine.compare(
        ctx,
        [RunSpec(method, Budget.parse("0.5"))],
        GenerationSettings(max_new_tokens=new),
        probes=[keep],
        questions=[Question(rests[0])],
    )
    fed = c + len(res.runs[0].token_ids) - 1  # the last picked token is never fed
    true = torch.arange(n, n + fed, dtype=torch.int32)
    for layer in range(lm.info.n_layers):
        pos = keep.comps[0].kept_positions(layer)  # [Hkv, m]
        after = pos[pos >= n].view(pos.shape[0], -1)
        if method == "snapkv":
            assert torch.equal(after, true.expand_as(after)), layer
        else:
            recent = keep.comps[0].recent
            assert torch.equal(after[:, -recent:], true[-recent:].expand(pos.shape[0], -1)), layer


def test_task_split_gives_the_same_ids_and_task_runs_either_way(engine, lm):
    task = make_task("passkey", 200, 0, lm.encode)
    ctx, rests = split_ids(lm, task.context, [task.question], [task.answer_prefix])
    assert ctx + rests[0] == prompt_ids(lm, task)
    lm_rest = lm.decode(rests[0])
    assert "pass key" in lm_rest and "The pass key is" in lm_rest  # question, assistant marker, answer prefix
    gen = GenerationSettings(max_new_tokens=6)
    methods = ["exact", "streaming"]
    aware = compare_all(engine, Comparison(task, methods, ["0.5"], settings=gen))
    agnostic = compare_all(engine, Comparison(task, methods, ["0.5"], settings=gen, protocol="query-agnostic"))
    assert aware[0].protocol == "query-aware" and agnostic[0].protocol == "query-agnostic"
    assert aware[0].prompt_token_ids == agnostic[0].prompt_token_ids
    assert aware[0].question == agnostic[0].question == task.question
    assert aware[0].runs[0].metrics["task_score"] == 1.0  # exact finds the key either way
    assert agnostic[0].runs[0].token_ids == aware[0].runs[0].token_ids
    assert "task_score" in agnostic[0].runs[1].metrics


def test_probes_and_health_under_query_agnostic(engine, lm, context):
    """The costly measurements see the question chunk; bytes after it are checked against the budget."""
    cmp = Comparison(
        context,
        ["exact", "subgen-kcenter", "streaming"],
        ["0.5"],
        settings=GenerationSettings(max_new_tokens=4),
        measure=ProbeSettings(),
        questions=QUESTIONS[:2],
    )
    results = compare_all(engine, cmp)
    assert [r.question for r in results] == QUESTIONS[:2]
    for res in results:
        c = res.prompt_tokens - res.context_tokens
        for r in res.runs:
            assert not [f for f in r.health if f["flag"] == "over_budget"], (r.label, r.health)
            assert len(r.kv_bytes_per_step) == len(r.token_ids) + 1  # after compression, after the question, steps
            q_err = r.metrics["question_attn_rel_error"]
            assert len(q_err) == lm.info.n_layers
            assert len(r.metrics["attn_rel_error"]) == len(r.token_ids) - 1
            assert r.metrics["perplexity"] is not None and "question_kl" in r.metrics
        exact, kc, stream = res.runs
        assert exact.metrics["question_attn_rel_error_mean"] < 2e-3  # fp16 rounding only
        assert kc.metrics["question_attn_rel_error_mean"] > 10 * exact.metrics["question_attn_rel_error_mean"]
        assert stream.kv_bytes_per_step[1] == stream.kv_bytes_per_step[0]  # holds its budget through the question
        assert exact.exact_kv_bytes_per_step[1] == exact.exact_kv_bytes_per_step[0] * (res.context_tokens + c) // (
            res.context_tokens
        )
    # a prefill-only method keeps the question in full: checked against that, not flagged
    bad = results[0].runs[1]
    bad.kv_bytes_per_step[1] = 2 * bad.exact_kv_bytes_per_step[1]
    from kvlab.measure.health import bytes_flags

    flags = bytes_flags(bad, results[0].context_tokens, False, results[0].prompt_tokens - results[0].context_tokens)
    assert flags and "after the question" in flags[0]["detail"]


def test_cli_question_round_trip(tmp_path, capsys, context):
    ctx_file = tmp_path / "context.txt"
    ctx_file.write_text(context)
    common = ["compare", "--context-file", str(ctx_file), "--methods", "exact,streaming", "--budget", "0.5"]
    common += ["--max-new-tokens", "3", "--quiet", "--question", QUESTIONS[0], "--question", QUESTIONS[1]]
    assert cli.main([*common, "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("[query-agnostic]") == 2 and "out-q2.json" in out
    first = load_result_text((tmp_path / "out.json").read_text())
    second = json.loads((tmp_path / "out-q2.json").read_text())
    assert first.protocol == second["protocol"] == "query-agnostic"
    assert (first.question, second["question"]) == tuple(QUESTIONS[:2])
    n = first.context_tokens
    assert 0 < n == second["context_tokens"] < first.prompt_tokens
    assert first.prompt_token_ids[:n] == second["prompt_token_ids"][:n]
    assert cli.main([*common, "--query-aware", "--json", str(tmp_path / "aware.json")]) == 0
    aware = json.loads((tmp_path / "aware.json").read_text())
    assert aware["protocol"] == "query-aware" and aware["question"] == QUESTIONS[0]
    assert aware["prompt_token_ids"] == first.prompt_token_ids  # the identical token sequence
    capsys.readouterr()
    for bad in (["--context-file", str(ctx_file)], ["--task", "passkey", "--question", "x"]):
        assert cli.main(["compare", *bad]) == 2
        assert "question" in capsys.readouterr().err


def test_schema_refuses_an_unknown_protocol(lm):
    from kvlab.core.results import CompareResult
    from kvlab.report.result_file import ResultFileError

    ok = CompareResult(lm.info.to_json(), "p", 3, [1, 2, 3], {}, {}, [], protocol="query-agnostic", context_tokens=2)
    data = ok.to_json()
    data["runs"] = [{"method": "exact", "budget": None, "params": {}}]
    assert load_result_text(json.dumps(data)).protocol == "query-agnostic"
    data["protocol"] = "query-psychic"
    with pytest.raises(ResultFileError, match="protocol"):
        load_result_text(json.dumps(data))
    data["protocol"], data["context_tokens"] = "query-aware", 9
    with pytest.raises(ResultFileError, match="context_tokens"):
        load_result_text(json.dumps(data))


def test_dashboard_question_box_makes_the_comparison_query_agnostic(lm, context):
    from kvlab.ui.dashboard import Dashboard, PageInputs

    dash = Dashboard(lm)
    inputs = PageInputs("embedded", context, [], ["streaming"], "0.5", 2, 0, None, False, None, 0)
    _, plain, n_plain = dash.request(inputs)
    _, asked, n_asked = dash.request(dataclasses.replace(inputs, question=QUESTIONS[0]))
    assert plain.chosen_protocol == "query-aware" and asked.chosen_protocol == "query-agnostic"
    ctx, rests = asked.split(lm)
    assert n_asked == len(ctx) + len(rests[0].ids) > n_plain
    assert lm.decode(rests[0].ids).strip().startswith(QUESTIONS[0])


class _Sequential(Probe):
    """A probe that is not ``forkable``: it makes every question decode on its own."""

    def on_prefill(self, state, logits, comps):
        pass

    def on_step(self, step, rows, logits):
        pass

    def finish(self, runs):
        pass


def test_questions_decode_as_one_batch_with_the_health_flags(engine, context, monkeypatch):
    """Through ``kvlab.run`` (the health probe always on, and forkable), two questions decode in one
    lockstep batch; each answer, its bytes and its health flags equal those of decoding each question
    on its own (forced by a probe that is not forkable)."""
    loops = []
    original = Decoder.decode_all

    def counted(self, rows, *a, **k):
        loops.append(len(rows.runs))
        return (yield from original(self, rows, *a, **k))

    monkeypatch.setattr(Decoder, "decode_all", counted)
    comparison = Comparison(
        context,
        ["exact", "streaming", "scissorhands"],
        ["0.5"],
        settings=GenerationSettings(max_new_tokens=6),
        questions=[QUESTIONS[0], QUESTIONS[2]],
    )
    joint = compare_all(engine, comparison)
    assert loops == [6]  # 3 runs x 2 questions in one decode loop
    loops.clear()
    alone = compare_all(engine, comparison, probes=[_Sequential()])
    assert loops == [3, 3]
    for a, b in zip(joint, alone):
        assert a.question == b.question
        for ra, rb in zip(a.runs, b.runs):
            assert ra.token_ids == rb.token_ids, (a.question, ra.label)
            assert ra.kv_bytes_per_step == rb.kv_bytes_per_step, ra.label
            assert ra.health == rb.health, ra.label
