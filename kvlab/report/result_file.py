"""Validation of a result JSON loaded from outside: a file is untrusted input.

``load_result_text`` parses and checks a kvlab export before anything renders it: the file's size,
every field's type, finite numbers only (``NaN``/``Infinity`` are refused), at most ``max_runs``
runs and ``max_tokens`` tokens per list, bounded strings and nesting. It raises ``ResultFileError``
with one message that names what is invalid (up to a few problems, each with its JSON path).
Strings are accepted as text; whoever renders them escapes them (the dashboard and report do).

Environment: ``KVLAB_IMPORT_MAX_RUNS`` (64), ``KVLAB_IMPORT_MAX_TOKENS`` (16384),
``KVLAB_IMPORT_MAX_BYTES`` (32 MiB).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.budgets import Budget
from kvlab.core.results import PROTOCOLS, CompareResult


class ResultFileError(ValueError):
    """A result file that kvlab will not load; the message lists what is invalid."""


@dataclass(frozen=True)
class ImportLimits:
    max_runs: int = 64
    max_tokens: int = 16384
    max_bytes: int = 32 * 1024**2
    max_string: int = 200_000  # characters in one string (a prompt or a generated text)
    max_name: int = 200  # characters in a method name, budget or dict key
    max_depth: int = 8
    max_items: int = 2_000_000  # numbers and strings in the whole file

    @classmethod
    def from_env(cls) -> ImportLimits:
        return cls(
            max_runs=int(os.environ.get("KVLAB_IMPORT_MAX_RUNS", cls.max_runs)),
            max_tokens=int(os.environ.get("KVLAB_IMPORT_MAX_TOKENS", cls.max_tokens)),
            max_bytes=int(os.environ.get("KVLAB_IMPORT_MAX_BYTES", cls.max_bytes)),
        )


@dataclass
class _Check:
    limits: ImportLimits
    problems: list[str] = field(default_factory=list)
    items: int = 0

    def bad(self, path: str, what: str) -> None:
        self.problems.append(f"{path or '$'}: {what}")

    # ----- generic walk: finite numbers, bounded strings, lists and depth ----------------------
    def walk(self, x: Any, path: str, depth: int = 0) -> None:
        self.items += 1
        if self.items > self.limits.max_items:
            if self.items == self.limits.max_items + 1:
                self.bad(path, f"more than {self.limits.max_items} values in the file")
            return
        if depth > self.limits.max_depth:
            self.bad(path, f"nested deeper than {self.limits.max_depth} levels")
        elif isinstance(x, bool) or x is None:
            pass
        elif isinstance(x, _NonFinite):
            self.bad(path, f"{x.name} is not a finite number")
        elif isinstance(x, float):
            if not math.isfinite(x):
                self.bad(path, "not a finite number")
        elif isinstance(x, int):
            if abs(x) > 2**63:
                self.bad(path, "integer out of range")
        elif isinstance(x, str):
            if len(x) > self.limits.max_string:
                self.bad(path, f"string of {len(x)} characters (at most {self.limits.max_string})")
        elif isinstance(x, list):
            cap = max(self.limits.max_tokens, self.limits.max_runs) * 4
            if len(x) > cap:
                self.bad(path, f"list of {len(x)} items (at most {cap})")
                return
            for i, v in enumerate(x):
                self.walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(x, dict):
            for k, v in x.items():
                if len(k) > self.limits.max_name:
                    self.bad(path, f"key of {len(k)} characters")
                    continue
                self.walk(v, f"{path}.{k}", depth + 1)
        else:  # pragma: no cover - json gives no other types
            self.bad(path, f"unexpected {type(x).__name__}")

    # ----- typed fields ---------------------------------------------------------------------
    def typed(self, obj: dict, path: str, key: str, kinds: tuple, required: bool = True) -> Any:
        if key not in obj:
            if required:
                self.bad(f"{path}.{key}", "missing")
            return None
        v = obj[key]
        if kinds == (int,) and isinstance(v, bool) or not isinstance(v, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            self.bad(f"{path}.{key}", f"must be {names}, got {type(v).__name__}")
            return None
        return v

    def ints(self, obj: dict, path: str, key: str, cap: int, required: bool = True) -> None:
        v = self.typed(obj, path, key, (list,), required)
        if v is None:
            return
        if len(v) > cap:
            self.bad(f"{path}.{key}", f"{len(v)} entries (at most {cap})")
        elif not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            self.bad(f"{path}.{key}", "must be a list of non-negative integers")

    def short(self, obj: dict, path: str, key: str, nullable: bool = False) -> None:
        v = self.typed(obj, path, key, (str, type(None)) if nullable else (str,))
        if isinstance(v, str) and len(v) > self.limits.max_name:
            self.bad(f"{path}.{key}", f"{len(v)} characters (at most {self.limits.max_name})")

    def protocol(self, data: dict, n_prompt: int | None) -> None:
        """Optional (older files lack them): protocol one of PROTOCOLS, question text, context_tokens <= prompt."""
        proto = self.typed(data, "$", "protocol", (str,), required=False)
        if isinstance(proto, str) and proto not in PROTOCOLS:
            self.bad("$.protocol", f"{proto[:40]!r} is not one of {', '.join(PROTOCOLS)}")
        self.typed(data, "$", "question", (str,), required=False)
        ctx = self.typed(data, "$", "context_tokens", (int,), required=False)
        if isinstance(ctx, int) and not 0 <= ctx <= (n_prompt if isinstance(n_prompt, int) else self.limits.max_tokens):
            self.bad("$.context_tokens", f"{ctx} is outside 0..prompt_tokens")

    def result(self, data: Any) -> None:
        if not isinstance(data, dict):
            self.bad("$", f"must be a JSON object, got {type(data).__name__}")
            return
        lim = self.limits
        for key in ("model", "settings", "timings"):
            self.typed(data, "$", key, (dict,))
        self.typed(data, "$", "prompt", (str,))
        n = self.typed(data, "$", "prompt_tokens", (int,))
        if isinstance(n, int) and not 0 <= n <= lim.max_tokens:
            self.bad("$.prompt_tokens", f"{n} is outside 0..{lim.max_tokens}")
        self.ints(data, "$", "prompt_token_ids", lim.max_tokens)
        self.protocol(data, n)
        runs = self.typed(data, "$", "runs", (list,))
        if runs is None:
            return
        if not 1 <= len(runs) <= lim.max_runs:
            self.bad("$.runs", f"{len(runs)} runs (1..{lim.max_runs} allowed)")
            return
        for i, r in enumerate(runs):
            p = f"$.runs[{i}]"
            if not isinstance(r, dict):
                self.bad(p, "must be an object")
                continue
            self.short(r, p, "method")
            self.short(r, p, "budget", nullable=True)
            if isinstance(r.get("budget"), str) and len(r["budget"]) <= self.limits.max_name:
                try:
                    Budget.parse(r["budget"])
                except ValueError as exc:
                    self.bad(f"{p}.budget", str(exc))
            self.typed(r, p, "text", (str,), required=False)
            self.ints(r, p, "token_ids", lim.max_tokens, required=False)
            self.ints(r, p, "kv_bytes_per_step", lim.max_tokens, required=False)
            self.ints(r, p, "exact_kv_bytes_per_step", lim.max_tokens, required=False)
            kv = self.typed(r, p, "kv_bytes", (int,), required=False)
            if isinstance(kv, int) and kv < 0:
                self.bad(f"{p}.kv_bytes", "must be >= 0")
            for key in ("params", "kv_bytes_breakdown", "timings", "metrics", "extras", "memory"):
                self.typed(r, p, key, (dict,), required=False)
            shared = self.typed(r, p, "shared_bytes", (dict,), required=False)
            if shared is not None and not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in shared.values()
            ):
                self.bad(f"{p}.shared_bytes", "must map names to non-negative integers")
            use = self.typed(r, p, "budget_use", (int, float, type(None)), required=False)
            if isinstance(use, (int, float)) and not isinstance(use, bool) and use < 0:
                self.bad(f"{p}.budget_use", "must be >= 0")
            health = self.typed(r, p, "health", (list,), required=False)
            if health is not None and not all(isinstance(f, dict) for f in health):
                self.bad(f"{p}.health", "must be a list of objects")
            self.short(r, p, "finish_reason") if "finish_reason" in r else None


@dataclass(frozen=True)
class _NonFinite:
    """Where the file has ``NaN`` / ``Infinity``: kept as a marker so that the check can name its path."""

    name: str


def load_result_text(text: str | bytes, limits: ImportLimits | None = None) -> CompareResult:
    """Parse and validate a result JSON; ``ResultFileError`` names what is invalid."""
    lim = limits or ImportLimits.from_env()
    if len(text) > lim.max_bytes:
        raise ResultFileError(f"the file has {len(text)} bytes; at most {lim.max_bytes} are accepted")
    try:
        data = json.loads(text, parse_constant=_NonFinite)
    except (ValueError, RecursionError) as exc:
        raise ResultFileError(f"not valid JSON: {str(exc)[:200]}") from None
    check = _Check(lim)
    check.walk(data, "$")
    if not check.problems:
        check.result(data)
    if check.problems:
        shown = "; ".join(check.problems[:4])
        more = f" (and {len(check.problems) - 4} more)" if len(check.problems) > 4 else ""
        raise ResultFileError(f"this is not a valid kvlab result: {shown}{more}")
    try:
        return CompareResult.from_json(data)
    except (TypeError, KeyError, ValueError) as exc:
        raise ResultFileError(f"this is not a valid kvlab result: {str(exc)[:200]}") from None
