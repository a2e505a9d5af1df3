"""Methods made of another method, as kvpress wraps presses: the registry's entry for a name such as
``snapkv+kivi2`` (a composition, ``composed.Composition``) or ``ada-expected-attention`` (Ada-KV's
allocation, ``held_scorer.ScorerWrapper``; the other wrappers of a scorer are listed there).

A wrapper is a value, not a class made at run time: it holds its inner method (the class), adds its own
parameters, and builds an instance that holds an instance of the inner method or gives it a strategy
(``make``). To the registry, the page and the CLI it reads like a method class: ``name``, ``title``,
``group``, ``paper``, ``summary``, ``params``, ``defaults()``, ``resolve_params()``, and calling it
with ``(info, budget, params, seed)`` gives the instance; what it does not change (``streaming``,
``no_local_layers``, ...) is the inner method's. The instance carries the wrapper's name and title,
and ``remade`` makes its copies through the wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvlab.core.budgets import Budget
from kvlab.core.model import ModelInfo
from kvlab.methods.base import Compressor
from kvlab.methods.params import Param, resolve


@dataclass(frozen=True)
class Wrapper:
    """``inner`` with something added; ``own_params`` are the wrapper's, beside the inner method's."""

    inner: type[Compressor]
    name: str
    title: str
    summary: str
    own_params: tuple[Param, ...] = ()
    group: str = ""  # "": the inner method's
    paper: str = ""  # "": the inner method's
    inner_defaults: tuple[tuple[str, Any], ...] = ()  # the inner method's parameters at other defaults

    def __post_init__(self) -> None:
        clash = {p.name for p in self.own_params} & {p.name for p in self.inner.params}
        if clash:
            raise TypeError(f"{self.name}: parameters {sorted(clash)} clash with {self.inner.name}'s")
        unknown = {k for k, _ in self.inner_defaults} - {p.name for p in self.inner.params}
        if unknown:
            raise TypeError(f"{self.name}: {self.inner.name} has no parameters {sorted(unknown)}")
        object.__setattr__(self, "group", self.group or self.inner.group)
        object.__setattr__(self, "paper", self.paper or self.inner.paper)

    def __getattr__(self, attr: str) -> Any:
        """What the wrapper does not change reads as the inner method's (its declared capabilities)."""
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    @property
    def instance_class(self) -> type[Compressor]:
        """The class of the instances it makes (the inner method's, unless the wrapper's cache holds it)."""
        return self.inner

    @property
    def params(self) -> tuple[Param, ...]:
        other = dict(self.inner_defaults)
        inner = tuple(replace(p, default=other[p.name]) if p.name in other else p for p in self.inner.params)
        return inner + self.own_params

    def defaults(self) -> dict:
        return {p.name: p.default for p in self.params}

    def resolve_params(self, overrides: dict) -> dict:
        return resolve(self.name, self.params, overrides)

    def __call__(
        self, info: ModelInfo, budget: Budget | None = None, params: dict | None = None, seed: int = 0
    ) -> Compressor:
        given = dict(params or {})
        cfg = self.resolve_params(given)  # every parameter checked under the wrapper's name
        own_names = {p.name for p in self.own_params}
        inner_given = {**dict(self.inner_defaults), **{k: v for k, v in given.items() if k not in own_names}}
        own = {k: cfg[k] for k in own_names}
        comp = self.make(info, budget, inner_given, own, seed)
        comp.name, comp.title = self.name, self.title
        comp.made_by, comp.params_given = self, given
        comp.cfg.update(own)  # as ``make`` left them (normalized)
        return comp

    def make(self, info: ModelInfo, budget: Budget | None, params: dict, own: dict, seed: int) -> Compressor:
        """The instance: ``params`` are the inner method's as given, ``own`` the wrapper's resolved (``make``
        may normalize them in place; the instance's ``cfg`` shows them as left)."""
        raise NotImplementedError


__all__ = ["Wrapper"]
