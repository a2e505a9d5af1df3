"""The reproductions by name, in the order ``all`` runs them."""

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
REPRODUCTIONS = tuple(_MODULES)


class UnknownReproduction(ValueError):
    pass


def names() -> list[str]:
    return list(REPRODUCTIONS)


def get_reproduction(name: str) -> ModuleType:
    """The module of one reproduction (it defines NAME, TITLE, CLAIMS and ``run(ctx) -> Report``)."""
    if name not in _MODULES:
        raise UnknownReproduction(f"unknown reproduction {name!r}; allowed: {', '.join(REPRODUCTIONS)} or all")
    return importlib.import_module(f"kvlab.reproduce.{_MODULES[name]}")
