"""The committed sweeps a page shows without an upload: found by scanning ``bench/results/*/results.json``.

A sweep folder (``kvlab sweep --out bench/results/NAME``) holds ``results.json``; a new one committed there
appears on the page with no change of code. Each is read once (cached by path, size and modification time)
and described from its own file: the model, the prompt lengths, the protocol, the tasks and the prompts per
task, so that the page can say where every number it shows comes from.

* a **needle grid** is a sweep over at least two depths and two lengths (``kvlab.report.needle_grids``);
* a **leaderboard** is any other sweep over at least two fraction budgets (compression ratios) whose runs
  carry task scores (``kvlab.report.leaderboard``).

``KVLAB_BOARDS`` names another folder to scan (e.g. a page serving boards of its own).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kvlab.report.leaderboard import LeaderboardError, protocol_of, rows_from_results

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
MAX_BYTES = 64 * 1024 * 1024  # a results.json larger than this is skipped (and an upload refused)


def results_dir() -> Path:
    """The folder scanned for sweeps: ``KVLAB_BOARDS``, else the repository's ``bench/results``."""
    env = os.environ.get("KVLAB_BOARDS", "").strip()
    return Path(env) if env else RESULTS_DIR


def shown_path(path: Path) -> str:
    """How the page names a committed file: ``bench/results/NAME/results.json`` for the repository's own."""
    try:
        return str(Path("bench") / "results" / path.relative_to(RESULTS_DIR))
    except ValueError:
        return str(path)


def _length(n: int) -> str:
    """1024 -> "1k", 4096 -> "4k", 1500 -> "1500"."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def methods_text(methods) -> str:
    """How many methods a board compares, the reference apart: "exact + 14 methods", or "3 methods" without exact."""
    names = list(dict.fromkeys(methods))
    n = len([m for m in names if m != "exact"])
    counted = f"{n} method{'s' if n != 1 else ''}"
    return f"exact + {counted}" if "exact" in names else counted


@dataclass(frozen=True)
class Board:
    """One committed sweep, described from its own file."""

    path: Path  # its results.json
    name: str  # its folder's name
    model: str  # the model spec the sweep ran (config.model: "embedded", "gemma3-270m", a hub id, a folder)
    lengths: tuple[int, ...]
    protocol: str
    tasks: tuple[str, ...]
    prompts: int  # prompts (cells) per task
    budgets: tuple[str, ...]
    depths: tuple[float, ...]
    leaderboard: bool  # ranked by score against ratio
    grid: bool  # a depth x length grid
    fidelity: bool = False  # its runs carry agreement with exact / log p of exact's answer
    methods: tuple[str, ...] = field(default=())
    exact_score: float | None = None  # exact's mean task score over the cells (0-1): how far a ranking can go

    @property
    def length_text(self) -> str:
        return ", ".join(_length(n) for n in self.lengths) + " tokens"

    def label(self, model_name: str | None = None) -> str:
        """The picker's entry: model, length, protocol, tasks x prompts and the folder."""
        model = model_name or self.model
        return (
            f"{model} · {self.length_text} · {self.protocol} · {len(self.tasks)} task(s) x {self.prompts} prompt(s)"
            f" · {methods_text(self.methods)} ({self.name})"
        )


def read_results(path: Path) -> dict:
    """A sweep's results.json as JSON (``LeaderboardError`` when too large or not JSON)."""
    if path.stat().st_size > MAX_BYTES:
        raise LeaderboardError(f"{path.name} is larger than {MAX_BYTES // 2**20} MiB")
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LeaderboardError(f"{path} is not JSON") from None


def describe(path: Path, data: dict) -> Board | None:
    """The ``Board`` of a sweep's results (None when it is not a sweep's results.json)."""
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list) or not cells:
        return None
    config = data.get("config") or {}
    tasks = tuple(dict.fromkeys(str(c["cell"].get("task")) for c in cells if isinstance(c, dict) and "cell" in c))
    per_task = {t: sum(1 for c in cells if c.get("cell", {}).get("task") == t) for t in tasks}
    lengths = tuple(sorted({int(c["cell"]["length"]) for c in cells if c.get("cell", {}).get("length")}))
    depths = tuple(sorted({float(c["cell"]["depth"]) for c in cells if c.get("cell", {}).get("depth") is not None}))
    budgets = tuple(dict.fromkeys(str(r.get("budget")) for c in cells for r in c.get("runs", []) if r.get("budget")))
    fractions = [b for b in budgets if not b.endswith("t")]
    methods = tuple(dict.fromkeys(str(r.get("label", "")).split("@")[0] for c in cells for r in c.get("runs", [])))
    fidelity = any(
        r.get("metrics", {}).get("agreement") is not None or r.get("metrics", {}).get("answer_logprob") is not None
        for c in cells
        for r in c.get("runs", [])
    )
    exact = [
        float(r["metrics"]["task_score"])
        for c in cells
        for r in c.get("runs", [])
        if r.get("method") == "exact" and isinstance(r.get("metrics", {}).get("task_score"), int | float)
    ]
    try:
        rows_from_results(data)
        ranked = len(fractions) >= 2
    except LeaderboardError:
        ranked = False
    return Board(
        path=path,
        name=path.parent.name,
        model=str(config.get("model") or "?"),
        lengths=lengths,
        protocol=str(data.get("protocol") or config.get("protocol") or protocol_of(cells)),
        tasks=tasks,
        prompts=min(per_task.values()) if per_task else 0,
        budgets=budgets,
        depths=depths,
        leaderboard=ranked and not (len(depths) >= 2 and len(lengths) >= 2),
        grid=len(depths) >= 2 and len(lengths) >= 2,
        fidelity=fidelity,
        methods=methods,
        exact_score=sum(exact) / len(exact) if exact else None,
    )


@lru_cache(maxsize=32)
def _read(path: str, size: int, mtime: float) -> tuple[Board | None, dict | None]:
    try:
        data = read_results(Path(path))
    except (OSError, LeaderboardError):
        return None, None
    return describe(Path(path), data), data


def load(path: Path) -> tuple[Board | None, dict | None]:
    """A sweep's board and its data, read once while the file is unchanged."""
    st = path.stat()
    return _read(str(path), st.st_size, st.st_mtime)


def committed(root: Path | None = None) -> list[Board]:
    """Every sweep under ``root`` (default ``results_dir()``), folders in name order."""
    root = root or results_dir()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.glob("*/results.json")):
        board, _ = load(path)
        if board is not None:
            out.append(board)
    return out


def leaderboards(root: Path | None = None) -> list[Board]:
    """The committed leaderboards: the most prompts per task first (the tightest intervals), then the longest
    prompts, then the highest exact score (where the full cache answers, a method's losses are the
    compression's), then by name."""
    found = [b for b in committed(root) if b.leaderboard]
    return sorted(found, key=lambda b: (-b.prompts, -max(b.lengths, default=0), -(b.exact_score or 0.0), b.name))


def grids(root: Path | None = None) -> list[Board]:
    """The committed depth x length grids."""
    return [b for b in committed(root) if b.grid]


__all__ = [
    "Board",
    "committed",
    "describe",
    "grids",
    "leaderboards",
    "load",
    "methods_text",
    "read_results",
    "results_dir",
    "shown_path",
]
