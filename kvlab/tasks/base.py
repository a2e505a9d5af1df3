"""What every task is: the ``Task`` type, its scorers, and the helpers that turn a task into the token
ids the engine takes (``prompt_ids``, ``split_ids`` for the query-agnostic protocol) and fit a
context to a length in tokens (``fit``, ``fit_prompt``).

The built-in tasks (``kvlab.tasks.builtin``), RULER's (``kvlab.tasks.ruler``) and rows from data
files (``kvlab.tasks.datafiles``) are all built on this module; none of them imports another.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

OWN_TASKS = ("passkey", "needle", "multikey", "lines", "document")
# RULER's synthetic tasks (``kvlab.tasks.ruler`` builds them)
RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
TASKS = OWN_TASKS + RULER_TASKS
SUITES = {"ruler": RULER_TASKS}

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def string_match_all(text: str, refs: list[str]) -> float:
    """RULER's ``string_match_all`` for one prediction: the share of ``refs`` found in ``text``."""
    low = text.lower()
    return sum(r.lower() in low for r in refs) / len(refs)


def string_match_part(text: str, refs: list[str]) -> float:
    """RULER's ``string_match_part`` (QA): 1.0 when any of ``refs`` is found in ``text``."""
    low = text.lower()
    return float(any(r.lower() in low for r in refs))


class TaskError(ValueError):
    pass


@dataclass
class Task:
    """One generated prompt. ``answer`` None: scored by fidelity to the exact run.

    ``prompt`` is the user turn and ends with ``question``; ``answer_prefix`` opens the assistant's
    turn (see ``prompt_ids``).
    """

    name: str
    prompt: str
    answer: str | None
    meta: dict = field(default_factory=dict)
    question: str = ""
    answer_prefix: str = ""
    references: list[str] | None = None  # RULER-style answers: strings the reply must contain
    metric: str = "number"  # "number": first number == answer; "all" / "part": RULER's string match
    max_new_tokens: int | None = None  # tokens the answer needs, where the task names them

    @property
    def context(self) -> str:
        """The prompt without its final question (what a query-agnostic run compresses)."""
        if self.question and self.prompt.endswith(self.question):
            return self.prompt[: len(self.prompt) - len(self.question)]
        return self.prompt

    def score(self, text: str) -> float | None:
        """Exact match: the first number in the generated text equals the answer (1.0 or 0.0).

        RULER's tasks (``metric`` "all" or "part") score by string match over ``references``: the
        share of them found in the text ("all"), or 1.0 when any is ("part") .
        """
        if self.answer is None:
            return None
        if self.metric in ("all", "part"):
            refs = self.references or [self.answer]
            return (string_match_all if self.metric == "all" else string_match_part)(text, refs)
        nums = re.findall(r"\d+", text)
        return float(bool(nums) and nums[0] == self.answer)

    def extract(self, text: str) -> tuple[str, ...] | None:
        """The answer as this task reads it from a generated text (None: the task has no extractor).

        A number-answer task: the first number. A task whose references are all numbers (RULER's
        needles): the distinct numbers of at least the references' length, in order, as many as it
        asks for; all upper-case names (RULER's variable tracking): the same with names. Other tasks
        (word lists, free text): None. ``kvlab.measure.fidelity`` compares two runs' answers with it.
        """
        if self.answer is None:
            return None
        if self.metric not in ("all", "part"):
            nums = re.findall(r"\d+", text)
            return tuple(nums[:1])
        shape = answer_shape(self.references or [self.answer])
        if shape is None:
            return None
        found = list(dict.fromkeys(re.findall(shape, text)))
        return tuple(found[: len(self.references or [self.answer])])

    def answer_end(self, text: str) -> int | None:
        """Where the extracted answer ends in ``text`` (characters), or None when nothing is extracted."""
        items = self.extract(text)
        if not items:
            return None
        end = 0
        for item in items:  # each item's first occurrence, in order
            at = text.find(item, end)
            end = at + len(item) if at >= 0 else end
        return end or None


def answer_shape(refs: list[str]) -> str | None:
    """A regex that finds answers shaped like ``refs`` in a text: numbers of at least their length, or
    upper-case names of their length; None for any other shape."""
    if refs and all(r.isdigit() for r in refs):
        return rf"(?<!\d)\d{{{min(len(r) for r in refs)},}}(?!\d)"
    if refs and all(r.isalpha() and r.isupper() for r in refs):
        return rf"(?<![A-Z])[A-Z]{{{min(len(r) for r in refs)},{max(len(r) for r in refs)}}}(?![A-Z])"
    return None


def prompt_ids(lm, task: Task, chat: bool = True) -> list[int]:
    """The token ids the engine is given for ``task``: user turn, assistant marker, answer prefix.

    ``lm`` is a ``LoadedModel`` (anything with ``encode(text, chat=...)``). Without the chat
    template the prefix follows the prompt after a blank line.
    """
    return turn_ids(lm, task.prompt, task.answer_prefix, chat)


def turn_ids(lm, user: str, answer_prefix: str = "", chat: bool = True) -> list[int]:
    """Ids of a user turn ``user`` and the assistant's first words ``answer_prefix`` (see ``prompt_ids``).

    A model without a chat template (a base model) reads the raw text, the prefix after a blank line."""
    tok = getattr(lm, "tokenizer", None)
    if not chat or (tok is not None and not getattr(tok, "chat_template", None)):
        text = user + (f"\n\n{answer_prefix}" if answer_prefix else "")
        return lm.encode(text, chat=False)
    ids = lm.encode(user, chat=True)
    return ids + (lm.encode(answer_prefix, chat=False) if answer_prefix else [])


def join_question(context: str, question: str) -> str:
    """The user turn of ``context`` followed by ``question`` (a blank line between, unless either side has one)."""
    if not context or context[-1:].isspace() or question[:1].isspace():
        return context + question
    return f"{context}\n\n{question}"


def split_ids(
    lm, context: str, questions: list[str], answer_prefixes: list[str] | None = None, chat: bool = True
) -> tuple[list[int], list[list[int]]]:
    """The full prompt ids of each question (``turn_ids`` of context + question), cut where the context ends.

    Returns (context ids, per question the rest: question, end of turn, assistant marker, answer
    prefix). The cut is the longest prefix that every full prompt shares with the context's own
    ids, so a token that the tokenizer merges across the boundary goes with the questions and
    context + rest is exactly each full prompt's ids.
    """
    prefixes = answer_prefixes or [""] * len(questions)
    fulls = [turn_ids(lm, join_question(context, q), p, chat) for q, p in zip(questions, prefixes)]
    alone = lm.encode(context, chat=chat)
    cut = min(_common_prefix(alone, f) for f in fulls)
    return fulls[0][:cut], [f[cut:] for f in fulls]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_text(task: Task) -> str:
    """The prompt as a person reads it: the user turn, then the answer's first words."""
    return task.prompt + (f"\n\n[answer begins] {task.answer_prefix}" if task.answer_prefix else "")


def parse_length(text: str | int) -> int:
    """``"2k"`` -> 2048, ``"1500"`` -> 1500."""
    s = str(text).strip().lower()
    try:
        return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)
    except ValueError:
        raise TaskError(f"length {text!r} is not valid; use token counts such as 1500 or 2k") from None


def fit(count: Callable[[int], int], build: Callable[[int], T], target: int) -> T:
    """The largest ``k`` (units of filler) whose prompt ``build(k)`` has at most ``target`` tokens."""
    lo, hi = 0, 1
    while count(hi) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= target else (lo, mid)
    return build(lo)


def fit_prompt(encode: Callable[[str], list[int]], build: Callable[[int], str], target: int, prefix: str) -> str:
    """``fit`` with the answer prefix's tokens counted (``encode`` may or may not add a chat template)."""
    extra = len(encode(prefix)) - len(encode("")) if prefix else 0
    return fit(lambda k: len(encode(build(k))) + extra, build, target)


def sentence_start(text: str, at: int) -> int:
    """The start of the sentence or paragraph at or before character ``at`` (0 at the top)."""
    if at <= 0:
        return 0
    if at >= len(text):
        return len(text)
    cut = max(text.rfind(". ", 0, at), text.rfind("\n", 0, at))
    return cut + (2 if text[cut : cut + 2] == ". " else 1) if cut >= 0 else 0


def manual_prose(seed: int) -> str:
    """CPython's reference manual, topics in a seeded order (real prose and code, offline)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    random.Random(f"prose-{seed}").shuffle(keys)
    return "\n\n".join(topics[k] for k in keys)
