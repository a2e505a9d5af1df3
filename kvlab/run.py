"""One comparison flow, shared by the CLI, the dashboard and the sweeps.

A ``Comparison`` says what to run: a prompt (or a ``Task``, which carries its prompt and its
answer), methods x budgets with their parameters, generation settings and which measurements to
take. ``stream`` runs it and yields the engine's progress ``Event``s; the last one (``done``)
carries the finished ``CompareResult``: bytes and texts from the engine, the costly measurements
when asked for (``measure``), the text metrics against the exact run and, for a task, its scores.
``compare`` returns that result.

    from kvlab.run import Comparison, compare
    result = compare(lm, Comparison("Why is the sky blue?", ["exact", "streaming"], ["0.5", "0.25"]))

A comparison may give a context and ``questions`` (or a ``Task`` with ``protocol="query-agnostic"``):
the query-agnostic protocol then compresses the context once and asks each question afterwards
through every compressed cache; ``protocol="query-aware"`` runs each question inside its own
prompt instead. Every question has its own result: ``compare_all`` returns them, the ``done``
event lists them in ``results`` (``result`` is the first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvlab.core.budgets import Budget
from kvlab.core.model import LoadedModel
from kvlab.core.results import PROTOCOLS, QUERY_AGNOSTIC, QUERY_AWARE, CompareResult
from kvlab.engine import faults
from kvlab.engine.comparison import Engine, each_in_own_prompt
from kvlab.engine.probe import Probe
from kvlab.engine.specs import Event, GenerationSettings, InputError, Question, RunSpec, expand_runs, results_of
from kvlab.measure.fidelity import add_fidelity
from kvlab.measure.health import HealthProbe
from kvlab.measure.metrics import MetricsProbe, ProbeSettings, add_text_metrics, answer_positions
from kvlab.measure.retention import RetentionProbe, RetentionSettings
from kvlab.tasks import Task, join_question, prompt_ids, prompt_text, score_result, split_ids


@dataclass
class Comparison:
    """What to compare. ``source``: the prompt text, or a ``Task`` (its prompt, scored by its answer).

    ``budgets`` are ``Budget``s or their text (``"0.25"``, ``"512t"``); ``params`` maps a method to
    its parameter overrides; ``measure`` None leaves out the costly measurements (attention error,
    teacher-forced fidelity, attention maps); ``chat`` feeds the prompt through the chat template;
    ``retention`` takes kept-position snapshots of every run (``kvlab.measure.retention``: what each layer
    and KV head holds, at a bounded number of steps).

    ``questions``: ``source`` is then the context, and each question is asked of it. ``protocol``:
    "query-agnostic" (the default with questions: the context compressed once, each question fed
    afterwards) or "query-aware" (the default otherwise, tasks included: the question is inside the
    compressed prompt). A task takes "query-agnostic" too: its context compressed, its question after.
    """

    source: str | Task
    methods: Sequence[str]
    budgets: Sequence[Budget | str] = ()
    params: dict[str, dict] = field(default_factory=dict)
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    measure: ProbeSettings | None = None
    chat: bool = True
    questions: Sequence[str] = ()
    protocol: str | None = None
    retention: RetentionSettings | None = None  # kept-position snapshots for the retention map (None: none)

    def __post_init__(self) -> None:
        self.budgets: Sequence[Budget] = [Budget.parse(b) for b in self.budgets]
        self.questions = [q for q in self.questions if q and q.strip()]

    @property
    def chosen_protocol(self) -> str:
        """The protocol this comparison runs (``protocol``, or its default)."""
        if self.protocol is not None:
            return self.protocol
        return QUERY_AGNOSTIC if self.questions else QUERY_AWARE

    def asked(self) -> list[tuple[str, str]]:
        """(question, answer prefix) pairs asked of the context; empty for a single query-aware prompt."""
        task = self.task
        if task is not None:
            return [(task.question, task.answer_prefix)] if self.chosen_protocol == QUERY_AGNOSTIC else []
        return [(q, "") for q in self.questions]

    def context(self) -> str:
        return self.source.context if isinstance(self.source, Task) else self.source

    def split(self, lm: LoadedModel) -> tuple[list[int], list[Question]]:
        """The context's ids and each question (its ids after the context, its text, its whole prompt's text)."""
        asked = self.asked()
        ctx, rests = split_ids(lm, self.context(), [q for q, _ in asked], [p for _, p in asked], chat=self.chat)
        if isinstance(self.source, Task):
            texts = [prompt_text(self.source)]
        else:
            texts = [join_question(self.source, q) for q, _ in asked]
        return ctx, [Question(ids, q, t) for ids, (q, _), t in zip(rests, asked, texts)]

    @property
    def task(self) -> Task | None:
        return self.source if isinstance(self.source, Task) else None

    @property
    def prompt(self) -> str:
        """The prompt as a person reads it (a task's: its user turn, then its answer's first words)."""
        return prompt_text(self.source) if isinstance(self.source, Task) else self.source

    def runs(self) -> list[RunSpec]:
        """Every method at every budget (``InputError`` for unknown methods or parameters)."""
        return expand_runs(list(self.methods), [Budget.parse(b) for b in self.budgets], self.params)

    def check(self) -> list[RunSpec]:
        """Everything that can be checked without a model: settings, methods, parameters. Returns the runs."""
        self.settings.validate()
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise InputError(f"unknown protocol {self.protocol!r}; allowed: {', '.join(PROTOCOLS)}")
        if self.task is not None and self.questions:
            raise InputError("a task carries its own question; give questions with a context, not with a task")
        if self.task is not None and self.chosen_protocol == QUERY_AGNOSTIC and not self.task.question:
            raise InputError(f"task {self.task.name!r} has no separate question to ask after compression")
        if self.task is None and not self.questions and self.chosen_protocol == QUERY_AGNOSTIC:
            raise InputError("the query-agnostic protocol needs a question to ask after compressing the context")
        return self.runs()

    def encoder(self, lm: LoadedModel) -> Callable[[str], list[int]]:
        """Text -> token ids as this comparison feeds the model (with or without the chat template)."""
        return functools.partial(lm.encode, chat=self.chat)

    def encode(self, lm: LoadedModel) -> list[int]:
        """The prompt's token ids as the model is fed (a task's answer prefix opens the assistant's turn).

        With questions: the longest question's whole prompt (context + question)."""
        if self.asked():
            ctx, questions = self.split(lm)
            return ctx + max((q.ids for q in questions), key=len)
        if isinstance(self.source, Task):
            return prompt_ids(lm, self.source, chat=self.chat)
        return self.encoder(lm)(self.source)


def stream(model: LoadedModel | Engine, comparison: Comparison, probes: Sequence[Probe] = ()) -> Iterator[Event]:
    """Run a comparison; yields the engine's ``Event``s, the last one (``done``) with the finished result.

    ``probes`` are extra engine probes (e.g. a live view); they run before the health flags' probe
    (always on: bytes against the budget, finite logits, a cache that did not compress) and the
    measurements' probe. Out of memory ends the comparison with ``faults.OutOfMemory`` once what it
    held is freed.
    """
    engine = as_engine(model)
    runs = comparison.check()
    measure: list[Probe] = [MetricsProbe(comparison.measure)] if comparison.measure is not None else []
    if comparison.retention is not None:
        measure.append(RetentionProbe(comparison.retention, comparison.settings.max_new_tokens))
    every: list[Probe] = [*probes, HealthProbe(), *measure]
    settings, task = comparison.settings, comparison.task
    if not comparison.asked():  # one prompt, compressed with its question
        events: Iterator[Event] | None = engine.stream(
            comparison.encode(engine.lm), runs, settings, comparison.prompt, every
        )
    elif comparison.chosen_protocol == QUERY_AGNOSTIC:
        ctx, questions = comparison.split(engine.lm)
        events = engine.stream(ctx, runs, settings, probes=every, questions=questions)
    else:
        ctx, questions = comparison.split(engine.lm)
        events = each_in_own_prompt(engine, ctx, questions, runs, settings, every)
    oom = None
    try:
        assert events is not None
        for ev in events:
            if ev.kind == "done" and ev.results is not None:
                for r in ev.results:
                    if task is not None and not r.question:  # a task run query-aware: its question is inside
                        r.question = task.question
                    finish(r, task, engine.lm.decode)
                    if task is not None and comparison.measure is not None:  # where the maps mark the answer
                        r.settings["answer_positions"] = answer_positions(
                            r.prompt_token_ids, task.answer, engine.lm.decode
                        )
            yield ev
    except faults.OOM as exc:  # raised below, once the traceback (and the tensors its frames hold) is gone
        oom = faults.out_of_memory(exc)
    if oom is not None:
        measure, every, events = [], [], None
        faults.release()
        raise oom


def compare(model: LoadedModel | Engine, comparison: Comparison, probes: Sequence[Probe] = ()) -> CompareResult:
    """Run a comparison to the end; the (first question's) result, with its text metrics and task scores."""
    return compare_all(model, comparison, probes)[0]


def compare_all(
    model: LoadedModel | Engine, comparison: Comparison, probes: Sequence[Probe] = ()
) -> list[CompareResult]:
    """Run a comparison to the end; one result per question (one item without questions)."""
    return results_of(stream(model, comparison, probes))


def finish(
    result: CompareResult, task: Task | None = None, decode: Callable[[list[int]], str] | None = None
) -> CompareResult:
    """Text metrics against the exact run (diff, first divergence, similarity), the task's scores and, with
    ``decode`` (token ids -> text), the fidelity to exact's answer (``kvlab.measure.fidelity``)."""
    add_text_metrics(result)
    if task is not None:
        score_result(task, result)
    if decode is not None:
        add_fidelity(result, task, decode)
    return result


def as_engine(model: LoadedModel | Engine) -> Engine:
    return model if isinstance(model, Engine) else Engine(model)


__all__ = ["Comparison", "as_engine", "compare", "compare_all", "finish", "stream"]
