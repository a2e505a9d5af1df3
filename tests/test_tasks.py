"""Built-in tasks: lengths measured with the real tokenizer, seeded, answers where they should be."""

import pytest

from kvlab.tasks import TaskError, make_task, parse_length


def test_parse_length():
    assert parse_length("2k") == 2048 and parse_length("1500") == 1500
    with pytest.raises(TaskError, match="token counts"):
        parse_length("lots")


@pytest.mark.parametrize("name", ["passkey", "lines", "document"])
def test_length_and_seeding(lm, name):
    t = make_task(name, 400, 3, lm.encode)
    n = len(lm.encode(t.prompt))
    assert 300 <= n <= 400, n
    assert make_task(name, 400, 3, lm.encode).prompt == t.prompt
    assert make_task(name, 400, 4, lm.encode).prompt != t.prompt


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_needle_depth_and_score(lm, depth):
    t = make_task("passkey", 500, 1, lm.encode, depth=depth)
    assert t.prompt.count(t.answer) == 2 and len(t.answer) == 5
    at = t.prompt.index(t.answer) / len(t.prompt)
    assert abs(at - depth) < 0.15, at
    assert t.score(f" {t.answer}. That is it.") == 1.0
    assert t.score(f"maybe 12345 or {t.answer}") == (1.0 if t.answer == "12345" else 0.0)
    assert t.score("I don't know") == 0.0


def test_line_retrieval_answer_matches_its_line(lm):
    t = make_task("lines", 600, 2, lm.encode)
    line = t.meta["line"]
    assert f"line {line}: REGISTER_CONTENT is <{t.answer}>" in t.prompt
    assert t.prompt.rstrip().endswith(f"line {line}? I need the number.")
    assert t.prompt.count(f"line {line}:") == 1 and t.meta["lines"] > 10


def test_document_is_scored_by_fidelity(lm):
    t = make_task("document", 300, 0, lm.encode)
    assert t.answer is None and t.score("anything") is None
    with pytest.raises(TaskError, match="allowed"):
        make_task("nope", 300, 0, lm.encode)
