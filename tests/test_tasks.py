"""Built-in tasks: lengths measured with the real tokenizer, seeded, answers where they should be,
the answer prefix after the assistant marker, and `tasks calibrate`."""

import json

import pytest

from kvlab.cli import main
from kvlab.tasks import TASKS, TaskError, make_task, parse_length, prompt_ids


def test_parse_length():
    assert parse_length("2k") == 2048 and parse_length("1500") == 1500
    with pytest.raises(TaskError, match="token counts"):
        parse_length("lots")


@pytest.mark.parametrize("name", TASKS)
def test_length_and_seeding(lm, name):
    t = make_task(name, 400, 3, lm.encode)
    n = len(prompt_ids(lm, t))
    assert 300 <= n <= 400, n
    assert make_task(name, 400, 3, lm.encode).prompt == t.prompt
    assert make_task(name, 400, 4, lm.encode).prompt != t.prompt
    assert t.prompt.endswith(t.question) and t.context + t.question == t.prompt


@pytest.mark.parametrize("name", ["passkey", "needle", "multikey", "lines"])
def test_answer_prefix_follows_the_assistant_marker(lm, name):
    t = make_task(name, 300, 0, lm.encode)
    assert t.answer_prefix and t.answer is not None
    ids = prompt_ids(lm, t)
    head, tail = lm.encode(t.prompt), lm.encode(t.answer_prefix, chat=False)
    assert ids == head + tail  # user turn + assistant marker, then the prefix
    assert lm.tokenizer.decode(head).rstrip().endswith("assistant")
    # one tokenization of the whole text gives the same ids
    text = lm.tokenizer.decode(head) + t.answer_prefix
    assert lm.tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    raw = prompt_ids(lm, t, chat=False)
    assert lm.tokenizer.decode(raw).endswith("\n\n" + t.answer_prefix) and len(raw) < len(ids)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_needle_depth_and_score(lm, depth):
    t = make_task("passkey", 500, 1, lm.encode, depth=depth)
    assert t.prompt.count(t.answer) == 2 and len(t.answer) == 5
    at = t.prompt.index(t.answer) / len(t.prompt)
    assert abs(at - depth) < 0.15, at
    assert t.score(f" {t.answer}. That is it.") == 1.0
    assert t.score(f" {t.answer}. Remember it. The pass key is 12345") == 1.0  # trailing text ignored
    assert t.score(f"maybe 12345 or {t.answer}") == (1.0 if t.answer == "12345" else 0.0)
    assert t.score("I don't know") == 0.0
    assert t.score(f" {t.answer}7") == 0.0


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_needle_sits_in_real_prose_at_its_depth(lm, depth):
    t = make_task("needle", 800, 2, lm.encode, depth=depth)
    fact = f"The special magic number for {t.meta['word']} is {t.answer}."
    assert t.prompt.count(t.answer) == 1 and fact in t.prompt and len(t.answer) == 6
    assert t.question.strip() == f"What is the special magic number for {t.meta['word']}?"
    body = t.context
    at = body.index(fact) / len(body)
    assert abs(at - depth) < 0.15, at
    from pydoc_data.topics import topics

    manual = "\n\n".join(topics.values())
    tail = body[body.index(fact) + len(fact) :].strip()[:200]
    assert tail in manual  # the haystack is CPython's manual
    assert t.answer_prefix == f"The special magic number for {t.meta['word']} is"


@pytest.mark.parametrize("depth", [0.1, 0.6, 0.9])
def test_multikey_asks_for_one_of_nine(lm, depth):
    t = make_task("multikey", 800, 5, lm.encode, depth=depth)
    words = t.meta["words"]
    assert len(set(words)) == 9 and t.meta["depths"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert t.meta["word"] == words[t.meta["asked"]] and t.meta["depths"][t.meta["asked"]] == depth
    assert t.prompt.count("The special magic number for ") == 9
    positions = [t.prompt.index(f"The special magic number for {w} is ") for w in words]
    assert positions == sorted(positions)  # in depth order
    at = t.context.index(f"for {t.meta['word']} is {t.answer}.") / len(t.context)
    assert abs(at - depth) < 0.12, at
    assert t.question.strip() == f"What is the special magic number for {t.meta['word']}?"
    assert t.score(f" {t.answer}.") == 1.0


def test_passkey_asks_before_and_after_the_filler(lm):
    """The pinned shape (docs/tasks.md): question, instruction, filler with the key sentence, question."""
    t = make_task("passkey", 600, 0, lm.encode, depth=0.5)
    key = t.answer
    assert t.prompt.startswith("What is the pass key? It is hidden inside a lot of irrelevant text below.")
    assert t.question == "\n\nWhat is the pass key?" and t.prompt.count("What is the pass key?") == 2
    assert f"The pass key is {key}. Remember it. The pass key is {key}. " in t.prompt
    # every "The pass key is" in the prompt is followed by the key, as the answer prefix will be
    assert t.prompt.count("The pass key is") == 2 and t.answer_prefix == "The pass key is"


def test_line_retrieval_answer_matches_its_line(lm):
    t = make_task("lines", 600, 2, lm.encode)
    line = t.meta["line"]
    assert f"line {line}: REGISTER_CONTENT is <{t.answer}>" in t.prompt
    assert t.prompt.rstrip().endswith(f"line {line}? I need the number.")
    assert t.prompt.count(f"line {line}:") == 1 and t.meta["lines"] > 10
    assert t.score(f"{t.answer}>") == 1.0


def test_document_is_scored_by_fidelity(lm):
    t = make_task("document", 300, 0, lm.encode)
    assert t.answer is None and t.score("anything") is None and not t.answer_prefix
    with pytest.raises(TaskError, match="allowed"):
        make_task("nope", 300, 0, lm.encode)


def test_calibrate_cli_writes_json(lm, tmp_path, capsys):
    out = tmp_path / "cal.json"
    args = ["tasks", "calibrate", "--task", "needle", "--lengths", "200", "--seeds", "2", "--max-new-tokens", "8"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "needle" in printed and "accuracy" in printed
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert row["length"] == 200 and row["seeds"] == 2 and 0 <= row["accuracy"] <= 1
    assert row["hits"] == sum(bool(s["hit"]) for s in data["samples"]) and len(data["samples"]) == 2
    ci = row["interval"]  # the exact binomial interval of hits out of 2 seeds
    assert ci["n"] == 2 and ci["method"] == "clopper-pearson" and ci["low"] <= row["accuracy"] <= ci["high"]
    assert "95% interval" in printed and f"[{ci['low']:.2f}, {ci['high']:.2f}]" in printed
    assert data["command"].startswith("python -m kvlab tasks calibrate --task needle")
    assert main(["tasks", "calibrate", "--task", "document"]) == 2
    assert main(["tasks", "calibrate", "--task", "passkey", "--depths", "2"]) == 2
    assert "cannot be calibrated" in capsys.readouterr().err
