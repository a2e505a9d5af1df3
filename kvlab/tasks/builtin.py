"""Built-in tasks, generated offline and seeded: pass-key, needle, several needles, line retrieval, documents.

Every task with an answer is shaped so that the embedded SmolLM2-135M-Instruct finds the answer
with the exact cache (calibrated with ``python -m kvlab tasks calibrate``; numbers in docs/tasks.md):
a task on which the reference fails cannot tell the compression methods apart.

* ``passkey`` — a random 5-digit pass key hidden at a chosen depth (0 = start, 1 = end) inside
  repeated filler text (Mohtashami & Jaggi, "Landmark Attention", 2023).
* ``needle`` — one fact sentence ("The special magic number for <word> is <number>.") placed at a
  chosen depth in real prose: CPython's reference manual (``pydoc_data.topics``), as in the
  needle-in-a-haystack test and RULER's ``niah_single`` (Hsieh et al., "RULER", 2024).
* ``multikey`` — the harder one: nine such sentences for nine different words at depths 0.1,
  0.2, ..., 0.9 of the prose, and the question asks for one of them (RULER's ``niah_multikey``,
  with more keys). The others are distractors, so exact is good but not perfect and compression
  has room to hurt.
* ``lines`` — LongEval-style line retrieval (Li et al., "How long can open-source LLMs truly
  promise on context length?", 2023; used by ClusterGen, ``clustergen.txt`` Sec. 4.1): many lines
  ``line <key>: REGISTER_CONTENT is <number>`` and a question about one of them.
* ``document`` — a question or summary request over CPython's reference manual; no single answer,
  so scored by fidelity to the exact run (``text_similarity``).

How a task becomes token ids
----------------------------
``Task.prompt`` is the user turn: an instruction, the context, then ``Task.question`` at the very
end (``Task.context`` is everything before it). ``Task.answer_prefix`` is the first words of the
assistant's answer ("The pass key is"); the model continues from there. ``prompt_ids(lm, task)``
gives the ids the engine takes: the chat-templated user turn, the template's assistant marker,
then the answer prefix's tokens (without the chat template: prompt, a blank line, the prefix).
Small models need the prefix: without it SmolLM2-135M tends to answer "The pass key is the pass
key is".

The query-agnostic protocol (docs/tasks.md) cuts those same ids at the end of the context
(``split_ids``): the context's ids are prefilled and compressed alone, and the rest (question, end
of the user turn, assistant marker, answer prefix) is fed afterwards through each compressed cache.
Both protocols see the identical token sequence; only where compression happens differs.

Scoring: the first number in the generated text (what follows the prefix) must equal the answer;
text after it is ignored. Lengths are prompt token counts (``1k`` = 1024) measured with the
model's own tokenizer and chat template, answer prefix included; ``make_task`` fills the context
up to the length.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from kvlab.tasks.base import (
    FILLER,
    RULER_TASKS,
    TASKS,
    Task,
    TaskError,
    fit,
    fit_prompt,
    manual_prose,
    parse_length,
    sentence_start,
)
from kvlab.tasks.datafiles import file_task
from kvlab.tasks.ruler import make_ruler_task

_WORDS = (
    "amber",
    "birch",
    "cedar",
    "delta",
    "ember",
    "fable",
    "gale",
    "harbor",
    "iris",
    "jade",
    "kite",
    "lumen",
    "maple",
    "nova",
    "onyx",
    "pearl",
    "quartz",
    "raven",
    "sable",
    "tide",
    "umber",
    "vale",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
)


def passkey(n_tokens: int, seed: int, encode: Callable[[str], list[int]], depth: float = 0.5) -> Task:
    rng = random.Random(f"passkey-{seed}")
    key = str(rng.randint(10000, 99999))
    # The key follows "The pass key is" twice, as in the answer prefix: no sentence in the prompt
    # continues "The pass key is" with anything but the key (the older "{key} is the pass key"
    # taught the model to answer "the pass key").
    needle = f"The pass key is {key}. Remember it. The pass key is {key}. "
    # The question comes first as well as last: with only an instruction at the top ("important info
    # hidden inside ..."), a key near the start of a 2k-4k prompt was not copied; the model explained
    # the words "pass key" or copied the instruction instead (docs/tasks.md, shapes C and D).
    head = "What is the pass key? It is hidden inside a lot of irrelevant text below. Find it and memorize it.\n\n"
    question = "\n\nWhat is the pass key?"
    prefix = "The pass key is"

    def build(k: int) -> str:
        at = round(depth * k)
        return head + FILLER * at + needle + FILLER * (k - at) + question

    prompt = fit_prompt(encode, build, n_tokens, prefix)
    meta = {"depth": depth, "seed": seed, "target_tokens": n_tokens}
    return Task("passkey", prompt, key, meta, question, prefix)


def _needles(
    name: str,
    n_tokens: int,
    seed: int,
    encode: Callable[[str], list[int]],
    depths: list[float],
    ask: int,
    rng: random.Random,
) -> Task:
    """Fact sentences for distinct words at ``depths`` in real prose; the question asks for needle ``ask``."""
    words = rng.sample(_WORDS, len(depths))
    keys = [str(rng.randint(100000, 999999)) for _ in depths]
    word = words[ask]
    several = len(depths) > 1
    head = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about one of them.\n\n"
        if several
        else "A special magic number is hidden within the following text. Make sure to memorize it.\n\n"
    )
    question = f"\n\nWhat is the special magic number for {word}?"
    prefix = f"The special magic number for {word} is"
    prose = manual_prose(seed)
    order = sorted(range(len(depths)), key=lambda i: depths[i])

    def build(k: int) -> str:
        text = prose[: 200 * k]
        out, last = [head], 0
        for i in order:
            at = max(sentence_start(text, round(depths[i] * len(text))), last)
            out += [text[last:at], f"\n\nThe special magic number for {words[i]} is {keys[i]}.\n\n"]
            last = at
        return "".join(out) + text[last:] + question

    prompt = fit_prompt(encode, build, n_tokens, prefix)
    meta: dict[str, object] = {"seed": seed, "target_tokens": n_tokens, "word": word}
    if several:
        meta.update({"depths": depths, "words": words, "asked": ask})
    else:
        meta["depth"] = depths[ask]
    return Task(name, prompt, keys[ask], meta, question, prefix)


def needle(n_tokens: int, seed: int, encode: Callable[[str], list[int]], depth: float = 0.5) -> Task:
    rng = random.Random(f"needle-{seed}")
    return _needles("needle", n_tokens, seed, encode, [depth], 0, rng)


MULTIKEY_DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def multikey(n_tokens: int, seed: int, encode: Callable[[str], list[int]], depth: float = 0.5) -> Task:
    """Needles at ``MULTIKEY_DEPTHS``; the one asked about is the one nearest ``depth``."""
    rng = random.Random(f"multikey-{seed}")
    depths = list(MULTIKEY_DEPTHS)
    ask = min(range(len(depths)), key=lambda i: abs(depths[i] - depth))
    return _needles("multikey", n_tokens, seed, encode, depths, ask, rng)


def lines(n_tokens: int, seed: int, encode: Callable[[str], list[int]], depth: float | None = None) -> Task:
    """LongEval's lines filling ``n_tokens``; the question asks for a line chosen by the seed, or (``depth``) the
    line at that depth of the record (0: the first line, 1: the last)."""
    rng = random.Random(f"lines-{seed}")
    pool = [f"{a}-{b}" for a in _WORDS for b in _WORDS if a != b]
    rng.shuffle(pool)
    values = [rng.randint(1000, 99999) for _ in pool]
    head = (
        "Below is a record of lines I want you to remember. Each line begins with 'line <name>' and contains "
        "a REGISTER_CONTENT. Remember the REGISTER_CONTENT of every line.\n\n"
    )

    def ask(target: str) -> str:
        return f"\nNow the record is over. Tell me what is the REGISTER_CONTENT in line {target}? I need the number."

    def build(k: int, pick: int | None = None) -> str:
        k = max(1, min(k, len(pool)))
        body = "".join(f"line {pool[i]}: REGISTER_CONTENT is <{values[i]}>\n" for i in range(k))
        return head + body + ask(pool[pick if pick is not None else k // 2])

    prefix_for = "The REGISTER_CONTENT in line {} is <"
    k = max(1, len(re.findall("\n", fit_prompt(encode, build, n_tokens, prefix_for.format(pool[0])))) - 3)
    k = min(k, len(pool))
    pick = rng.randrange(k) if depth is None else min(k - 1, max(0, round(depth * (k - 1))))
    meta = {"seed": seed, "lines": k, "line": pool[pick], "index": pick, "target_tokens": n_tokens}
    if depth is not None:
        meta["depth"] = depth
    return Task("lines", build(k, pick), str(values[pick]), meta, ask(pool[pick]), prefix_for.format(pool[pick]))


def document(n_tokens: int, seed: int, encode: Callable[[str], list[int]]) -> Task:
    from pydoc_data.topics import topics

    rng = random.Random(f"document-{seed}")
    keys = sorted(topics)
    rng.shuffle(keys)
    text = "\n\n".join(topics[k] for k in keys)
    ask = rng.choice(
        [
            "Summarize the text above in two sentences.",
            "What is the main topic of the text above? Answer in one sentence.",
            "List three keywords that the text above explains.",
        ]
    )
    question = "\n\n" + ask

    def build(chars: int) -> str:
        return text[: 200 * chars] + question

    prompt = fit(lambda c: len(encode(build(c))), build, n_tokens)
    meta = {"seed": seed, "topics": keys[:3], "question": ask, "target_tokens": n_tokens}
    return Task("document", prompt, None, meta, question)


def make_task(
    name: str, n_tokens: int | str, seed: int, encode: Callable[[str], list[int]], depth: float | None = None
) -> Task:
    """Task ``name`` at ``n_tokens``: ``depth`` places the needle (default 0.5) or, for ``lines``, picks the line
    asked about (default: one chosen by the seed)."""
    n = parse_length(n_tokens)
    at = 0.5 if depth is None else depth
    if name == "passkey":
        return passkey(n, seed, encode, at)
    if name == "needle":
        return needle(n, seed, encode, at)
    if name == "multikey":
        return multikey(n, seed, encode, at)
    if name == "lines":
        return lines(n, seed, encode, depth)
    if name == "document":
        return document(n, seed, encode)
    if name in RULER_TASKS:
        return make_ruler_task(name, n, seed, encode, at)
    if name.startswith(("file:", "hub:")):
        return file_task(name, seed)
    raise TaskError(
        f"unknown task {name!r}; allowed: {', '.join(TASKS)}, or file:PATH / hub:REPO of RULER or LongBench rows"
    )


def score_result(task: Task, result) -> None:
    """Set ``metrics.task_score`` on every run: exact match, or text similarity to the exact run."""
    for r in result.runs:
        r.metrics["task_score"] = task.score(r.text) if task.answer is not None else r.metrics.get("text_similarity")
