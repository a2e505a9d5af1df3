"""Planning the runs of a comparison, and the runs that cannot run.

Before the prefill every run gets its compressor, planned for the prompt's tokens and the decode
steps to come (``make_compressors``). A run whose budget cannot be held (``BudgetRefused``), whose
model attention the method does not support (``UnsupportedAttention``) or whose constructor or
``plan`` raised (``PlanFailed``) is set aside (``Refusals``): it takes no part in the prefill or
the decoding, and is put back in the result, in the asked order, with the reason in its ``error``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

from torch import Tensor

from kvlab.core.budgets import BudgetRefused
from kvlab.core.model import ModelInfo
from kvlab.core.results import CompareResult, RunResult
from kvlab.core.semantics import UnsupportedAttention
from kvlab.engine import faults
from kvlab.engine.specs import Event, RunSpec
from kvlab.methods import Compressor, budget_search, get

T = TypeVar("T")


class PlanFailed(Exception):
    """A method's ``plan`` raised: its run ends before the prefill with this message as its error."""


Refused = BudgetRefused | UnsupportedAttention | PlanFailed  # why a run cannot run


def plan(comp: Compressor, n: int, decode_steps: int) -> dict | Refused:
    """The run's knobs; or why it cannot run: its budget refused, or its plan raised (that run only)."""
    comp.decode_steps = decode_steps
    try:
        return budget_search.planned(comp, n)
    except (BudgetRefused, UnsupportedAttention) as exc:  # the budget, or the model's attention, refused
        return exc
    except faults.OOM:
        raise
    except Exception as exc:  # a method's failure ends its own run
        return PlanFailed(faults.describe(exc))


def make_compressors(
    info: ModelInfo, runs: list[RunSpec], n: int, seed: int, decode_steps: int
) -> tuple[list[Compressor | None], list[dict | Refused]]:
    """One compressor per run, planned for ``n`` prompt tokens and ``decode_steps`` decode steps;
    returns them and their chosen knobs (or the ``BudgetRefused`` of a run that cannot hold its
    budget, or ``PlanFailed`` when its constructor or plan raised: its compressor is then None)."""
    made = [faults.made(get(spec.method), info, spec.budget, spec.params, seed=seed) for spec in runs]
    comps = [c if not isinstance(c, str) else None for c in made]  # None: its constructor raised
    return comps, [plan(c, n, decode_steps) if c is not None else PlanFailed(m) for c, m in zip(comps, made)]


@dataclass
class Refusals:
    """Runs whose plan refused its budget (``BudgetRefused``): left out of prefill and decoding, then put
    back in the result, in the asked order, as runs that ended ``refused`` with the reason in ``error``."""

    asked: list[RunSpec]
    refused: dict[int, Refused]

    def kept(self, xs: list[T]) -> list[T]:
        return [x for i, x in enumerate(xs) if i not in self.refused]

    def events(self) -> Iterator[Event]:
        for i, exc in self.refused.items():
            why = "ended on an error" if isinstance(exc, PlanFailed) else "refused"
            yield Event("run_done", f"{self.asked[i].label}: {why}: {exc}", -1, run=self.asked[i].label)

    def merged(self, result: CompareResult) -> CompareResult:
        ran = iter(result.runs)
        result.runs = [
            RunResult(
                spec.method,
                None if spec.budget is None else spec.budget.label,
                jsonable(dict(spec.params)),
                finish_reason="error" if isinstance(self.refused[i], PlanFailed) else "refused",
                error=str(self.refused[i]),
            )
            if i in self.refused
            else next(ran)
            for i, spec in enumerate(self.asked)
        ]
        return result


class Planned(NamedTuple):
    """The runs left after planning (refused ones set aside), their compressors and chosen knobs."""

    runs: list[RunSpec]
    comps: list[Compressor]
    knobs: list[dict]
    refusals: Refusals


def planned(info: ModelInfo, runs: list[RunSpec], n: int, seed: int, decode_steps: int) -> Planned:
    """Every run planned (``make_compressors``), the ones that cannot run set aside in ``refusals``."""
    comps, knobs = make_compressors(info, runs, n, seed, decode_steps)
    refusals = Refusals(runs, {i: k for i, k in enumerate(knobs) if isinstance(k, Exception)})
    # a run without a compressor has a ``PlanFailed``: what is kept are compressors and their knobs
    kept = cast(list[Compressor], refusals.kept(comps)), cast(list[dict], refusals.kept(knobs))
    return Planned(refusals.kept(runs), *kept, refusals)


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """A run's parameters as JSON holds them: tensors, tuples and sets as lists."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Tensor):
            v = v.tolist()
        elif isinstance(v, (tuple, set)):
            v = list(v)
        out[k] = v
    return out


__all__ = ["PlanFailed", "Planned", "Refusals", "jsonable", "make_compressors", "plan", "planned"]
