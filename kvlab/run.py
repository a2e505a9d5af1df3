"""One comparison flow, shared by the CLI, the dashboard and the sweeps.

A ``Comparison`` says what to run: a prompt (or a ``Task``, which carries its prompt and its
answer), methods x budgets with their parameters, generation settings and which measurements to
take. ``stream`` runs it and yields the engine's progress ``Event``s; the last one (``done``)
carries the finished ``CompareResult``: bytes and texts from the engine, the costly measurements
when asked for (``measure``), the text metrics against the exact run and, for a task, its scores.
``compare`` returns that result.

    from kvlab.run import Comparison, compare
    result = compare(lm, Comparison("Why is the sky blue?", ["exact", "streaming"], ["0.5", "0.25"]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvlab import faults
from kvlab.budgets import Budget
from kvlab.engine import Engine, Event, GenerationSettings, Probe, RunSpec, expand_runs
from kvlab.health import HealthProbe
from kvlab.metrics import MetricsProbe, ProbeSettings, add_text_metrics
from kvlab.models import LoadedModel
from kvlab.results import CompareResult
from kvlab.tasks import Task, prompt_ids, prompt_text, score_result


@dataclass
class Comparison:
    """What to compare. ``source``: the prompt text, or a ``Task`` (its prompt, scored by its answer).

    ``budgets`` are ``Budget``s or their text (``"0.25"``, ``"512t"``); ``params`` maps a method to
    its parameter overrides; ``measure`` None leaves out the costly measurements (attention error,
    teacher-forced fidelity, attention maps); ``chat`` feeds the prompt through the chat template.
    """

    source: str | Task
    methods: Sequence[str]
    budgets: Sequence[Budget | str] = ()
    params: dict[str, dict] = field(default_factory=dict)
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    measure: ProbeSettings | None = None
    chat: bool = True

    def __post_init__(self) -> None:
        self.budgets = [Budget.parse(b) for b in self.budgets]

    @property
    def task(self) -> Task | None:
        return self.source if isinstance(self.source, Task) else None

    @property
    def prompt(self) -> str:
        """The prompt as a person reads it (a task's: its user turn, then its answer's first words)."""
        return prompt_text(self.source) if isinstance(self.source, Task) else self.source

    def runs(self) -> list[RunSpec]:
        """Every method at every budget (``InputError`` for unknown methods or parameters)."""
        return expand_runs(list(self.methods), list(self.budgets), self.params)

    def check(self) -> list[RunSpec]:
        """Everything that can be checked without a model: settings, methods, parameters. Returns the runs."""
        self.settings.validate()
        return self.runs()

    def encoder(self, lm: LoadedModel) -> Callable[[str], list[int]]:
        """Text -> token ids as this comparison feeds the model (with or without the chat template)."""
        return functools.partial(lm.encode, chat=self.chat)

    def encode(self, lm: LoadedModel) -> list[int]:
        """The prompt's token ids as the model is fed (a task's answer prefix opens the assistant's turn)."""
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
    ids = comparison.encode(engine.lm)
    measure = [MetricsProbe(comparison.measure)] if comparison.measure is not None else []
    oom = None
    try:
        for ev in engine.stream(
            ids, runs, comparison.settings, prompt_text=comparison.prompt, probes=[*probes, HealthProbe(), *measure]
        ):
            if ev.kind == "done":
                finish(ev.result, comparison.task)
            yield ev
    except faults.OOM as exc:  # raised below, once the traceback (and the tensors its frames hold) is gone
        oom = faults.out_of_memory(exc)
    if oom is not None:
        measure = probes = None
        faults.release()
        raise oom


def compare(model: LoadedModel | Engine, comparison: Comparison, probes: Sequence[Probe] = ()) -> CompareResult:
    """Run a comparison to the end; the result carries its text metrics and, for a task, its scores."""
    result = None
    for ev in stream(model, comparison, probes):
        if ev.kind == "done":
            result = ev.result
    return result


def finish(result: CompareResult, task: Task | None = None) -> CompareResult:
    """Text metrics against the exact run (diff, first divergence, similarity) and the task's scores."""
    add_text_metrics(result)
    if task is not None:
        score_result(task, result)
    return result


def as_engine(model: LoadedModel | Engine) -> Engine:
    return model if isinstance(model, Engine) else Engine(model)


__all__ = ["Comparison", "as_engine", "compare", "finish", "stream"]
