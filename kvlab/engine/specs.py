"""What a comparison is made of: the runs (method x budget), the generation settings, the questions
asked after compression, the progress events, and the error for bad input.

``expand_runs`` turns methods x budgets into ``RunSpec``s; ``Engine.stream`` (``kvlab.engine.comparison``) takes
them and yields ``Event``s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvlab.core.budgets import Budget
from kvlab.core.results import CompareResult
from kvlab.methods import get


class InputError(ValueError):
    """Bad input from a user (prompt, methods, budgets, settings); the message says what is allowed."""


@dataclass(frozen=True)
class RunSpec:
    """One method at one budget (``budget`` None: the method's own default, e.g. exact)."""

    method: str
    budget: Budget | None = None
    params: dict = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget.label}"


@dataclass
class GenerationSettings:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= 4096:
            raise InputError(f"max_new_tokens={self.max_new_tokens} is out of range; allowed: 1..4096")
        if self.do_sample and not self.temperature > 0:  # NaN too
            raise InputError(f"temperature={self.temperature} must be > 0 when sampling")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.seed < 2**63:
            raise InputError(f"seed={self.seed} is out of range; allowed: 0..{2**63 - 1}")


@dataclass
class Question:
    """A question asked after compression: the prompt's token ids after the context, and its text.

    ``ids`` are the question, the end of the user turn, the assistant marker and any answer
    prefix; ``prompt_text`` is the whole prompt as a person reads it (shown with the result).
    """

    ids: list[int]
    text: str = ""
    prompt_text: str = ""


@dataclass
class Event:
    """Progress: ``kind`` is prefill | compress | question | step | run_done | done; ``progress`` in [0, 1].

    ``result`` of the ``done`` event is the (first) question's result; ``results`` lists every
    question's result (one item when the prompt had one question or none).
    """

    kind: str
    message: str
    progress: float
    step: int | None = None
    total: int | None = None
    run: str | None = None
    result: CompareResult | None = None
    results: list[CompareResult] | None = None


def results_of(events: Iterable[Event]) -> list[CompareResult]:
    """Run a comparison's events to the end: the results of its ``done`` event (one per question)."""
    results: list[CompareResult] = []
    for ev in events:
        if ev.kind == "done" and ev.results is not None:
            results = ev.results
    return results


def expand_runs(methods: list[str], budgets: list[Budget], params: dict[str, dict] | None = None) -> list[RunSpec]:
    """Every method at every budget; methods without a budget knob (exact) run once.

    Unknown methods or parameters raise ``InputError`` naming what is allowed.
    """
    params = params or {}
    methods = [m.strip() for m in methods if m and m.strip()]
    if not methods:
        raise InputError("no method selected; choose at least one (e.g. exact,streaming)")
    budgets = list(dict.fromkeys(budgets))  # a budget given twice runs once
    specs: list[RunSpec] = []
    for m in dict.fromkeys(methods):
        try:
            cls = get(m)
            cls.resolve_params(params.get(m, {}))
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if cls.name == "exact" or not budgets:
            specs.append(RunSpec(m, None, dict(params.get(m, {}))))
        else:
            specs.extend(RunSpec(m, b, dict(params.get(m, {}))) for b in budgets)
    for m in params:
        if m not in methods:
            raise InputError(f"parameters given for {m!r}, which is not among the methods {', '.join(methods)}")
    return specs


__all__ = ["Event", "GenerationSettings", "InputError", "Question", "RunSpec", "expand_runs", "results_of"]
