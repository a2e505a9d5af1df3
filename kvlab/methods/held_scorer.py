"""Methods that hold a prompt-time scorer and change how its choice is made, as kvpress's wrapper presses
hold a scorer press: ``ada-NAME`` (Ada-KV's allocation over the heads), ``criticalkv-NAME``,
``chunkkv-NAME``, ``lukv-NAME``, ``dms-NAME``.

The scorer is any registered method that ranks the prompt before choosing (``ranks_prompt``: the
``PromptScored`` methods and Expected Attention): planned at the wrapper's budget, it keeps its own knobs
(its window, its sinks, its per-layer budgets) and hands its scores over in ``ranking(state)`` (a
``dense.Ranking``). The cache (a ``HeldScorer``) holds an instance of it and plans, asks the prefill and
counts bytes through it; only the choice changes. The registry's entry is a ``ScorerWrapper`` (a
``wrapped.Wrapper``) built on demand for any scorer by a prefix (``scorer_named``): no class is made at
run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillNeeds
from kvlab.methods.wrapped import Wrapper


class HeldScorer(DenseCompressor):
    """A cache built around the prompt-time scorer it holds (``scorer``): the scorer plans the budget, says
    what the prefill must capture and what a kept token costs; a subclass makes the choice from its
    ``ranking``. A subclass adds its own knobs in ``own_knobs`` and its own prefill needs in ``own_needs``."""

    def __init__(self, info: ModelInfo, budget: Budget | None, params: dict, scorer: DenseCompressor, seed: int = 0):
        super().__init__(info, budget, params, seed=seed)
        self.scorer = scorer

    def check_semantics(self) -> None:
        self.scorer.check_semantics()

    def plan_tokens(self, n_prompt: int) -> dict:
        self.scorer.decode_steps = self.decode_steps
        return {**self.scorer.plan(n_prompt), **self.own_knobs(n_prompt)}

    def own_knobs(self, n_prompt: int) -> dict:
        """After the scorer planned: this method's own knobs for the budget (shown with the scorer's)."""
        return {}

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return self.own_needs(self.scorer.prefill_needs(n_prompt))

    def own_needs(self, needs: PrefillNeeds) -> PrefillNeeds:
        """The scorer's prefill needs with what this method needs besides."""
        return needs

    def planned_tokens(self, n_prompt: int) -> int:
        return self.scorer.planned_tokens(n_prompt)

    def per_token_bytes(self, with_logw: bool = False) -> int:
        return self.scorer.per_token_bytes(with_logw)

    def fixed_stream_bytes(self) -> float:
        return self.scorer.fixed_stream_bytes()


@dataclass(frozen=True)
class ScorerWrapper(Wrapper):
    """``PREFIX-NAME``: the scorer ``inner`` held by a ``cache`` (a ``HeldScorer`` subclass)."""

    cache: type[HeldScorer] = HeldScorer
    no_composition: str = ""  # why a composition cannot store this method's tokens ("": as the cache class says)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "no_composition", self.no_composition or self.cache.no_composition)

    @property
    def instance_class(self) -> type[Compressor]:
        return self.cache

    def make(self, info: ModelInfo, budget: Budget | None, params: dict, own: dict, seed: int) -> Compressor:
        scorer = self.inner(info, budget, params, seed=seed)
        assert isinstance(scorer, DenseCompressor) and scorer.ranks_prompt  # ``scorer_named`` admits scorers only
        comp = self.cache(info, budget, own, scorer, seed=seed)
        comp.cfg = {**scorer.cfg, **comp.cfg}
        return comp


def scorer_named(name: str, prefix: str, lookup: Callable[[str], Any]) -> type[DenseCompressor] | None:
    """The scorer named after ``prefix`` in ``name`` (``criticalkv-snapkv`` -> SnapKV): a registered method
    class that ranks the prompt (``ranks_prompt``), not a wrapper; None for any other name."""
    if not name.startswith(prefix):
        return None
    try:
        inner = lookup(name[len(prefix) :])
    except ValueError:
        return None
    if not isinstance(inner, type) or not issubclass(inner, DenseCompressor) or not inner.ranks_prompt:
        return None
    return inner


def scorer_resolver(
    prefix: str, wrap: Callable[[type[DenseCompressor]], ScorerWrapper]
) -> Callable[[str, Callable[[str], Any]], ScorerWrapper | None]:
    """The registry's resolver of ``PREFIX-NAME``: ``wrap(scorer)`` for a method that ranks the prompt, else None."""

    def resolve(name: str, lookup: Callable[[str], Any]) -> ScorerWrapper | None:
        inner = scorer_named(name, prefix, lookup)
        return None if inner is None else wrap(inner)

    return resolve


__all__ = ["HeldScorer", "ScorerWrapper", "scorer_named", "scorer_resolver"]
