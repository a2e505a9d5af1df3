"""Fidelity to exact (agreement with exact's answer, the log-probability of exact's answer tokens through a
compressed cache) and the leaderboard's ranking by paired tests."""

from __future__ import annotations

import pytest
import torch

from kvlab.measure.fidelity import FIRST_TOKENS, agreement, answer_tokens
from kvlab.report import leaderboard, ranking
from kvlab.run import Comparison, compare
from kvlab.sweep import FIDELITY_ONLY, backfilled
from kvlab.tasks import Task, make_task


def test_answer_extractors_read_what_each_task_asks_for():
    niah = Task("niah_single_1", "p", "9837175", references=["9837175"], metric="all")
    assert niah.extract(":\n\n1. 9837175\n2. 9837175\n") == ("9837175",)  # list numbers are too short to count
    multi = Task("niah_multivalue", "p", "x", references=["1234567", "7654321"], metric="all")
    assert multi.extract("1234567, 1234567 and 7654321, 1111111") == ("1234567", "7654321")
    vt = Task("vt", "p", "x", references=["ABCDE", "FGHIJ"], metric="all")
    assert vt.extract("they are: ABCDE, FGHIJ, KLMNO") == ("ABCDE", "FGHIJ")
    assert Task("passkey", "p", "12345").extract("The key is 12345, or 5") == ("12345",)
    assert Task("cwe", "p", "x", references=["apple", "pear"], metric="all").extract("apple pear") is None
    assert Task("document", "p", None).extract("anything") is None
    assert niah.answer_end("The numbers: 9837175.") == len("The numbers: 9837175")


def test_agreement_compares_answers_or_else_the_first_tokens():
    niah = Task("niah_single_1", "p", "9837175", references=["9837175"], metric="all")
    assert agreement(niah, "it is 9837175", [1, 2], "1. 9837175 2.", [3, 4]) == 1.0  # same answer, other words
    assert agreement(niah, "it is 9837176", [1, 2], "1. 9837175 2.", [1, 2]) == 0.0
    same, other = list(range(FIRST_TOKENS)) + [99], list(range(FIRST_TOKENS)) + [98]
    assert agreement(None, "a", same, "b", other) == 1.0  # no extractor: the first 8 tokens
    assert agreement(None, "a", [0, 5], "a", [0, 6]) == 0.0


def test_answer_tokens_end_where_exact_gave_its_answer(lm):
    task = Task("niah_single_1", "p", "9837175", references=["9837175"], metric="all")
    ids = lm.tokenizer(" 1. 9837175\n2. 9837175\n3.", add_special_tokens=False)["input_ids"]
    k = answer_tokens(task, lambda n: lm.decode(ids[:n]), ids)
    assert lm.decode(ids[:k]).endswith("9837175") and not lm.decode(ids[: k - 1]).endswith("9837175")
    no_answer = lm.tokenizer(" I do not know the number at all, sorry.", add_special_tokens=False)["input_ids"]
    assert answer_tokens(task, lambda n: lm.decode(no_answer[:n]), no_answer) == FIRST_TOKENS


def test_answer_logprob_is_the_model_s_own_along_exact_s_answer(lm, engine):
    """Exact's answer log-probability equals the model's own forward over the prompt and exact's tokens
    (float16 cache: within 1e-2 nats); a budget too small to hold the needle finds it less likely."""
    task = make_task("niah_single_1", 220, 0, lm.encode, 0.5)
    cmp = Comparison(task, ["exact", "streaming"], ["12t"], measure=FIDELITY_ONLY, protocol="query-agnostic")
    cmp.settings.max_new_tokens = 14
    res = compare(engine, cmp)
    exact, stream = res.runs
    assert exact.metrics["agreement"] == 1.0 and exact.metrics["task_score"] == 1.0
    k = exact.metrics["answer_tokens"]
    ids = res.prompt_token_ids + exact.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(res.prompt_token_ids)
    own = [float(logp[n - 1 + i, t]) for i, t in enumerate(exact.token_ids[:k])]
    assert exact.metrics["answer_logprob"] == pytest.approx(sum(own) / k, abs=1e-2)
    assert stream.metrics["task_score"] == 0.0 and stream.metrics["agreement"] == 0.0
    assert stream.metrics["answer_logprob"] < exact.metrics["answer_logprob"] - 1.0


def test_stored_cells_get_their_agreement_from_their_texts():
    rec = {
        "cell": {"task": "niah_single_1", "length": 1024, "seed": 0, "depth": 0.5},
        "answer": "9837175",
        "meta": {"references": ["9837175"]},
        "runs": [
            {"method": "exact", "text": "1. 9837175", "token_ids": [1, 2], "metrics": {}},
            {"method": "snapkv", "text": "9837175!", "token_ids": [3], "metrics": {}},
            {"method": "knorm", "text": "1. 2. 3.", "token_ids": [1, 2], "metrics": {}},
        ],
    }
    assert [r["metrics"]["agreement"] for r in backfilled(rec)["runs"]] == [1.0, 1.0, 0.0]


def test_holm_and_mcnemar_against_textbook_values():
    assert ranking.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    a = {f"p{i}": 1.0 for i in range(10)}
    b = {f"p{i}": (0.0 if i < 6 else 1.0) for i in range(10)}  # a right where b is wrong on 6 of 6 that differ
    n, diff, differ, wins, test, p = ranking.paired_test(a, b)
    assert (n, differ, wins, test) == (10, 6, 6, "mcnemar-exact") and p == pytest.approx(0.03125)
    assert diff == pytest.approx(0.6)
    c = {f"p{i}": -0.1 * i for i in range(8)}
    d = {f"p{i}": -0.1 * i - 0.5 - 0.01 * i for i in range(8)}  # c higher on all 8: Wilcoxon's exact p = 2/256
    assert ranking.paired_test(c, d)[4:] == ("wilcoxon", pytest.approx(2 / 256))


def _row(method: str, ratio: float, scores: list[float]) -> leaderboard.Row:
    names = [f"s{i}" for i in range(len(scores))]
    return leaderboard.Row(method, ratio, {"t": 100 * sum(scores) / len(scores)}, {"t": len(scores)},
                           {"t": scores}, {"t": names})  # fmt: skip


def test_ranks_count_the_methods_separated_above():
    exact = _row("exact", 0.0, [1.0] * 20)
    good = _row("good", 0.5, [1.0] * 19 + [0.0])
    bad = _row("bad", 0.5, [0.0] * 20)
    (rk,) = ranking.rank_board([exact, good, bad])
    assert rk.ranks == {"exact": 1, "good": 1, "bad": 3}
    assert {(p.a, p.b, p.verdict) for p in rk.separated} == {("exact", "bad", "above"), ("good", "bad", "above")}
    text = ranking.markdown(rk)
    assert "`good` above `bad`: higher on 19 of the 19 prompts" in text
