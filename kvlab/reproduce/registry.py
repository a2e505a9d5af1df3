"""The reproductions by name, in the order ``all`` runs them.

A reproduction is a module of this package with ``NAME``, ``TITLE``, ``CLAIMS`` (the quotes it pins),
``DECLARED`` (its registry entries: paper claims, implementation checks, controls; ``kvlab.reproduce.claims``)
and ``run(ctx) -> Report``. Adding one is one line in ``_MODULES``: its claims come with it.

``APART`` are run by name only, not by ``all``: the engines' caches (``kv-asymmetric-bits``,
``turboquant-qjl-residual``) took 6,127 s together on the 2-core CPU (both embedded models); their results
are committed apart, in ``bench/results/reproduce-engines/``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = {
    "balancekv-fig2": "balancekv_fig2",
    "balancekv-table1": "balancekv_table1",
    "qjl-estimator": "qjl_estimator",
    "qjl-3bit": "qjl_3bit",
    "qjl-kivi-rd": "qjl_kivi_rd",
    "clustergen-lines": "clustergen_lines",
    "scissorhands-persistence": "scissorhands_persistence",
    "scissorhands-ppl": "scissorhands_ppl",
    "subgen-theorem1": "subgen_theorem1",
    "subgen-sublinear": "subgen_sublinear",
    "scissorhands-fig3": "scissorhands_fig3",
    "scissorhands-table4": "scissorhands_table4",
    "turboquant-bounds": "turboquant_bounds",
    "quantizers-matched": "quantizers_matched",
    "polarquant-distortion": "polarquant_distortion",
    "kv-asymmetric-bits": "kv_asymmetric_bits",
    "turboquant-qjl-residual": "turboquant_qjl_residual",
}
APART = ("kv-asymmetric-bits", "turboquant-qjl-residual")  # by name only, not in ``all`` (1.7 hours together)
REPRODUCTIONS = tuple(n for n in _MODULES if n not in APART)  # what ``all`` runs, in order
ALSO = ("gemma3-270m",)  # the models ``kvlab reproduce`` runs the task claims on beside ``--model`` by default


class UnknownReproduction(ValueError):
    pass


def names() -> list[str]:
    """Every reproduction runnable by name: ``all``'s, then ``APART``."""
    return list(_MODULES)


def get_reproduction(name: str) -> ModuleType:
    """The module of one reproduction (it defines NAME, TITLE, CLAIMS and ``run(ctx) -> Report``)."""
    if name not in _MODULES:
        raise UnknownReproduction(f"unknown reproduction {name!r}; allowed: {', '.join(_MODULES)} or all")
    return importlib.import_module(f"kvlab.reproduce.{_MODULES[name]}")


def declared() -> dict[str, tuple[str, object]]:
    """Every registry entry of every reproduction (``DECLARED`` in each module): id -> (reproduction, entry).
    A new reproduction's claims fold in by its module's line in ``_MODULES``; ids must be unique."""
    out: dict[str, tuple[str, object]] = {}
    for name in _MODULES:
        for entry in getattr(get_reproduction(name), "DECLARED", ()):
            if entry.id in out:
                raise ValueError(f"claim id {entry.id!r} is declared by both {out[entry.id][0]} and {name}")
            out[entry.id] = (name, entry)
    return out
