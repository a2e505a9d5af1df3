"""The methods panel: registry methods by group, the default choice, and the per-method parameter table."""

from __future__ import annotations

from typing import Any

from kvlab.methods import methods


def method_groups() -> dict[str, list[tuple[str, str]]]:
    """Registry methods by group: {"paper": [(label, name)], "baseline": [...], "recent": [...], "quantizer": [...],
    "reference": [...]}."""
    out: dict[str, list[tuple[str, str]]] = {
        "reference": [],
        "paper": [],
        "baseline": [],
        "recent": [],
        "quantizer": [],
    }
    for name, cls in methods().items():
        out.setdefault(cls.group, []).append((f"{cls.title or name} ({name})" if cls.title else name, name))
    return out


CORE_PAPER_METHODS = (
    "qjl",
    "subgen-kcenter",
    "balancekv",
    "scissorhands",
)  # one per paper (SubGen as run in its experiments): the default comparison


def default_methods() -> tuple[list[str], list[str]]:
    """The default comparison: exact + the four papers' methods (their variants stay one tick away).

    Falls back to every registered paper method, then to StreamingLLM, while the registry is partial.
    """
    groups = method_groups()
    registered = [n for _, n in groups.get("paper", [])]
    papers = [n for n in CORE_PAPER_METHODS if n in registered] or registered
    baselines = [] if papers else [n for _, n in groups.get("baseline", []) if n == "streaming"]
    return papers, baselines


def param_rows() -> list[list[str]]:
    """One row per (method, parameter): method, parameter, value (editable), paper default, meaning."""
    rows = []
    for name, cls in methods().items():
        for p in cls.params:
            d = "auto" if p.default is None else str(p.default)
            rows.append([name, p.name, d, d, p.help])
    return rows


def params_from_rows(rows: Any, chosen: list[str]) -> dict[str, dict]:
    """Overrides for the chosen methods: rows whose value differs from the default."""
    if rows is None:
        return {}
    if hasattr(rows, "values") and hasattr(rows, "columns"):
        rows = rows.values.tolist()
    out: dict[str, dict] = {}
    for row in rows if isinstance(rows, (list, tuple)) else []:
        if not isinstance(row, (list, tuple)) or len(row) < 4:
            continue
        method, name, value, default = (str(x).strip() if x is not None else "" for x in row[:4])
        if method in chosen and value and value != default and value.lower() not in ("auto", "none"):
            out.setdefault(method, {})[name] = value
    return out
