"""Fidelity to exact, per prompt: whether a compressed run gives exact's answer, and how likely it finds it.

A compression method's job is to make the model behave as it does with the full cache, whether or not
the full cache answers right. Two scores are defined on every prompt of a task, exact's misses included
(docs/metrics.md, "Fidelity to exact"):

* ``agreement`` (0 or 1): the task's answer extractor (``Task.extract``: for a needle, the numbers
  found) gives the same answer on the run's text as on exact's. A task without an extractor
  (word lists, free text) compares the first ``FIRST_TOKENS`` generated tokens instead.
* ``answer_logprob`` (nats per token, <= 0): the mean log-probability the run gives exact's answer
  tokens, teacher-forced along exact's continuation through the run's own compressed cache
  (``MetricsProbe``'s ``forced_logprob``). Exact's answer tokens are its generated tokens up to the
  end of the answer it gave (its first ``FIRST_TOKENS`` when it gave none or the task has no
  extractor). Needs the teacher-forced probe (``ProbeSettings.fidelity``); None without it.

Exact's own row has agreement 1 and its own confidence as its answer log-probability.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlab.tasks import Task

FIRST_TOKENS = 8


def answer_tokens(task: Task, exact_text_of: Callable[[int], str], exact_ids: list[int]) -> int:
    """How many of exact's generated tokens carry its answer: the shortest prefix whose text holds the
    answer's end (``exact_text_of(k)``: the text of the first k tokens), else ``FIRST_TOKENS``."""
    full = exact_text_of(len(exact_ids))
    end = task.answer_end(full)
    if end is None:
        return min(FIRST_TOKENS, len(exact_ids))
    lo, hi = 1, len(exact_ids)
    while lo < hi:  # the text grows with the tokens: the first prefix that reaches ``end``
        mid = (lo + hi) // 2
        if len(exact_text_of(mid)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def agreement(task: Task | None, run_text: str, run_ids: list[int], exact_text: str, exact_ids: list[int]) -> float:
    """1.0 when the run gives exact's answer (the task's extractor, else the first generated tokens), else 0.0."""
    if task is not None:
        mine, theirs = task.extract(run_text), task.extract(exact_text)
        if mine is not None and theirs is not None:
            return float(mine == theirs)
    return float(run_ids[:FIRST_TOKENS] == exact_ids[:FIRST_TOKENS])


def add_fidelity(result, task: Task | None, decode: Callable[[list[int]], str]) -> None:
    """Set ``metrics.agreement`` and ``metrics.answer_logprob`` on every run of ``result`` (None without an
    exact run; the log-probability also None without the teacher-forced probe's ``forced_logprob``)."""
    exact = next((r for r in result.runs if r.method == "exact" and not r.error), None)
    if exact is None:
        for r in result.runs:
            r.metrics.update(agreement=None, answer_logprob=None)
        return
    span = answer_tokens(task, lambda k: decode(exact.token_ids[:k]), exact.token_ids) if task else FIRST_TOKENS
    for r in result.runs:
        if r.error:
            continue
        r.metrics["agreement"] = agreement(task, r.text, r.token_ids, exact.text, exact.token_ids)
        forced = r.metrics.get("forced_logprob")
        take = forced[:span] if forced else []
        r.metrics["answer_logprob"] = round(sum(take) / len(take), 4) if take and None not in take else None
        r.metrics["answer_tokens"] = span


__all__ = ["FIRST_TOKENS", "add_fidelity", "agreement", "answer_tokens"]
