"""Built-in tasks, generated offline and seeded: pass-key retrieval, line retrieval, document prompts.

* ``passkey`` — a random 5-digit pass key hidden at a chosen depth (0 = start, 1 = end) inside
  repeated filler text of a chosen token length (the needle-in-a-haystack / pass-key test of
  Mohtashami & Jaggi, "Landmark Attention", 2023). Scored by exact match.
* ``lines`` — LongEval-style line retrieval (Li et al., "How long can open-source LLMs truly
  promise on context length?", 2023; used by ClusterGen, ``clustergen.txt`` Sec. 4.1): many lines
  ``line <key>: REGISTER_CONTENT is <number>`` and a question about one of them. Exact match.
* ``document`` — a question or summary request over CPython's reference manual
  (``pydoc_data.topics``); no single answer, so scored by fidelity to the exact run
  (``text_similarity``).

Lengths are prompt token counts (``1k`` = 1024) measured with the model's own tokenizer and
chat template; ``make_task`` fills the context up to the length.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

TASKS = ("passkey", "lines", "document")

_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
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


class TaskError(ValueError):
    pass


@dataclass
class Task:
    """One generated prompt. ``answer`` None: scored by fidelity to the exact run."""

    name: str
    prompt: str
    answer: str | None
    meta: dict = field(default_factory=dict)

    def score(self, text: str) -> float | None:
        """Exact match: the first number in the generated text equals the answer (1.0 or 0.0)."""
        if self.answer is None:
            return None
        nums = re.findall(r"\d+", text)
        return float(bool(nums) and nums[0] == self.answer)


def parse_length(text: str | int) -> int:
    """``"2k"`` -> 2048, ``"1500"`` -> 1500."""
    s = str(text).strip().lower()
    try:
        return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)
    except ValueError:
        raise TaskError(f"length {text!r} is not valid; use token counts such as 1500 or 2k") from None


def _fit(count: Callable[[int], int], build: Callable[[int], str], target: int) -> str:
    """The largest ``k`` (units of filler) whose prompt ``build(k)`` has at most ``target`` tokens."""
    lo, hi = 0, 1
    while count(hi) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= target else (lo, mid)
    return build(lo)


def passkey(n_tokens: int, seed: int, encode: Callable[[str], list[int]], depth: float = 0.5) -> Task:
    rng = random.Random(f"passkey-{seed}")
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    head = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
    question = "\n\nWhat is the pass key? The pass key is"

    def build(k: int) -> str:
        at = round(depth * k)
        return head + _FILLER * at + needle + _FILLER * (k - at) + question

    prompt = _fit(lambda k: len(encode(build(k))), build, n_tokens)
    return Task("passkey", prompt, key, {"depth": depth, "seed": seed, "target_tokens": n_tokens})


def lines(n_tokens: int, seed: int, encode: Callable[[str], list[int]]) -> Task:
    rng = random.Random(f"lines-{seed}")
    pool = [f"{a}-{b}" for a in _WORDS for b in _WORDS if a != b]
    rng.shuffle(pool)
    values = [rng.randint(1000, 99999) for _ in pool]
    head = (
        "Below is a record of lines I want you to remember. Each line begins with 'line <name>' and contains "
        "a REGISTER_CONTENT. Remember the REGISTER_CONTENT of every line.\n\n"
    )

    def build(k: int, pick: int | None = None) -> str:
        k = max(1, min(k, len(pool)))
        body = "".join(f"line {pool[i]}: REGISTER_CONTENT is <{values[i]}>\n" for i in range(k))
        target = pool[pick if pick is not None else k // 2]
        return (
            head
            + body
            + f"\nNow the record is over. Tell me what is the REGISTER_CONTENT in line {target}? I need the number."
        )

    k = max(1, len(re.findall("\n", _fit(lambda k: len(encode(build(k))), build, n_tokens))) - 3)
    k = min(k, len(pool))
    pick = rng.randrange(k)
    return Task(
        "lines",
        build(k, pick),
        str(values[pick]),
        {"seed": seed, "lines": k, "line": pool[pick], "target_tokens": n_tokens},
    )


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

    def build(chars: int) -> str:
        return text[: 200 * chars] + "\n\n" + ask

    prompt = _fit(lambda c: len(encode(build(c))), build, n_tokens)
    return Task(
        "document", prompt, None, {"seed": seed, "topics": keys[:3], "question": ask, "target_tokens": n_tokens}
    )


def make_task(
    name: str, n_tokens: int | str, seed: int, encode: Callable[[str], list[int]], depth: float = 0.5
) -> Task:
    n = parse_length(n_tokens)
    if name == "passkey":
        return passkey(n, seed, encode, depth)
    if name == "lines":
        return lines(n, seed, encode)
    if name == "document":
        return document(n, seed, encode)
    raise TaskError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")


def score_result(task: Task, result) -> None:
    """Set ``metrics.task_score`` on every run: exact match, or text similarity to the exact run."""
    for r in result.runs:
        r.metrics["task_score"] = task.score(r.text) if task.answer is not None else r.metrics.get("text_similarity")
