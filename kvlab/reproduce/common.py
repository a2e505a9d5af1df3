"""What every reproduction shares: the quotes it pins, the rows it prints, its progress on disk.

A reproduction measures claims of one paper on the embedded model and returns a ``Report``
(``kvlab.reproduce.report``): rows of (setting, the paper's number, kvlab's number, n and the 95%
interval where kvlab's number is a mean over prompts, documents, seeds or draws, the verdict), the raw
measurements (JSON) and a plotly figure (HTML). The paper's numbers and sentences are ``Claim`` constants
(quotes): each carries the exact text it quotes and where in the paper it is, and a test checks that the
text is in the paper (``papers/<paper>.txt`` beside the repository).

A row is one of four kinds. A **claim** row is evidence for a paper claim at the paper's operating point
and carries one of the verdicts: ``holds``, ``does not hold``, ``inconclusive`` (the data cannot decide:
every method ties, the interval straddles the line, or too few prompts for the test to pass: "inconclusive
by design"), ``not testable here`` (the model or the data cannot test it; the row's note says why). A
**check** row verifies kvlab's own implementation, a **control** row is kvlab's own control; both carry a
verdict in the same words. A **context** row gives settings, references, other operating points or
bookkeeping and has no verdict. Each row names the registry id it bears on (``claim``, see
``kvlab.reproduce.claims``), the model it was measured on where a reproduction runs several (``model``),
and for a test, the smallest n at which it could pass (``min_n``).

A long reproduction is resumable: ``Progress`` keeps each finished unit of work (a document, a
prompt) on disk as it completes, and a rerun with the same settings reads those units back
instead of measuring them again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def papers_dir() -> Path | None:
    """The folder with the papers' text: ``$KVLAB_PAPERS``, else ``shared/papers`` beside the repository
    (``../shared/papers``) or beside one of its parent folders."""
    env = os.environ.get("KVLAB_PAPERS")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for base in (REPO_ROOT, *REPO_ROOT.parents):
        p = base / "shared" / "papers"
        if p.is_dir():
            return p
    return None


@dataclass(frozen=True)
class Claim:
    """A number or statement from a paper: ``quote`` appears verbatim in ``papers/<paper>.txt``."""

    paper: str  # file stem: qjl, subgen, clustergen, balancekv, scissorhands
    where: str  # section / table / figure
    quote: str  # verbatim text from the paper (whitespace as in the file)
    value: str  # what the table prints in the "paper" column

    def found_in_paper(self) -> bool | None:
        """True/False when the paper's text is available, None when it is not."""
        d = papers_dir()
        if d is None or not (d / f"{self.paper}.txt").is_file():
            return None
        return self.quote in (d / f"{self.paper}.txt").read_text(encoding="utf-8")


HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable here"
NOT_TESTABLE_SCALE = "not testable at this scale"  # a claim's verdict only: the paper ties it to a larger model
VERDICTS = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_TESTABLE)  # a row's verdict
CLAIM_VERDICTS = (*VERDICTS, NOT_TESTABLE_SCALE)  # a claim's verdict
CLAIM, CHECK, CONTROL, CONTEXT = "claim", "check", "control", "context"
KINDS = (CLAIM, CHECK, CONTROL, CONTEXT)
BY_DESIGN = "inconclusive by design"


@dataclass
class Row:
    """One line of a reproduction's table.

    ``holds`` (True / False) is shorthand for the verdicts "holds" / "does not hold"; a row given
    neither a direction nor a verdict is context. ``n`` and ``interval`` (kvlab's 95% interval, the
    same scale as ``kvlab``) where kvlab's number is a mean over prompts, documents, seeds or draws;
    ``claim`` the registry id the row bears on; ``model`` the model it was measured on (rows of several
    models); ``min_n`` the smallest n at which the row's test could pass: below it an inconclusive row
    says it is inconclusive by design."""

    setting: str
    paper: str
    kvlab: str
    holds: bool | None = None
    note: str = ""
    verdict: str | None = None
    kind: str = CLAIM
    n: int | None = None
    interval: tuple[float, float] | None = None
    claim: str = ""
    model: str = ""
    min_n: int | None = None

    def __post_init__(self) -> None:
        if self.verdict is None and self.holds is not None:
            self.verdict = HOLDS if self.holds else DOES_NOT_HOLD
        if self.verdict is None:
            self.kind = CONTEXT
        if self.kind not in KINDS:
            raise ValueError(f"row kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind == CONTEXT:
            self.verdict = None
        elif self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}; allowed: {', '.join(VERDICTS)}")
        if self.verdict == NOT_TESTABLE and not self.note:
            raise ValueError(f"{self.setting!r}: 'not testable here' needs its reason in the note")
        self.holds = {HOLDS: True, DOES_NOT_HOLD: False}.get(self.verdict or "")
        if self.interval is not None:
            self.interval = (float(self.interval[0]), float(self.interval[1]))
        short = self.min_n is not None and self.n is not None and self.n < self.min_n
        if short and self.verdict == HOLDS:
            raise ValueError(f"{self.setting!r}: holds at n = {self.n}, below the n = {self.min_n} its test needs")
        if short and self.verdict == INCONCLUSIVE and BY_DESIGN not in self.note:
            why = f"{BY_DESIGN}: its test cannot pass below n = {self.min_n}"
            self.note = f"{why}; {self.note}" if self.note else why

    @property
    def shown(self) -> str:
        """The verdict column: the verdict, "check: ..." / "control: ..." for kvlab's own, "(context)"."""
        if self.kind == CONTEXT:
            return "(context)"
        return f"{self.kind}: {self.verdict}" if self.kind in (CHECK, CONTROL) else str(self.verdict)

    @property
    def spread(self) -> str:
        """n and the interval as printed: "n = 10, [0.35, 0.93]", "n = 1", or ""; and the n the test needs."""
        if self.n is None:
            return ""
        out = f"n = {self.n}"
        if self.interval is not None:
            out += f", [{fmt(self.interval[0])}, {fmt(self.interval[1])}]"
        if self.min_n is not None and self.kind != CONTEXT:
            out += f"; passes from n = {self.min_n}"
        return out


class Progress:
    """The units of work one reproduction has finished, kept on disk so that an interrupted run resumes.

    The file is ``<cache>/reproduce/<name>-<digest>.json`` (``<cache>``: ``$KVLAB_CACHE`` or
    ``~/.cache/kvlab``, where the converted model lives too); the digest covers ``key`` (the model, the
    settings, the source of the reproduction's module), so a unit is read back only by a run that
    would measure it the same way. Each ``put`` rewrites the file whole (write, then rename); ``clear``
    removes it once the reproduction has finished, so that the next run measures afresh."""

    def __init__(self, name: str, key: dict):
        text = json.dumps(key, sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        root = os.environ.get("KVLAB_CACHE") or os.path.join(Path.home(), ".cache", "kvlab")
        self.path = Path(root) / "reproduce" / f"{name}-{digest}.json"
        self.units: dict[str, Any] = {}
        if self.path.is_file():
            try:
                self.units = dict(json.loads(self.path.read_text()))
            except (ValueError, TypeError):  # a file cut short: measure again
                self.units = {}

    @classmethod
    def of(cls, ctx: Any, name: str, settings: dict, *module_files: str) -> Progress:
        """The progress of reproduction ``name`` run by ``ctx`` (its model) with ``settings``; the source of
        the modules that measure it (``module_files``) is part of the key, so a changed reproduction starts over."""
        source = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in module_files]
        return cls(name, {"model": getattr(ctx, "model", ""), "settings": settings, "source": source})

    def get(self, unit: str) -> Any:
        """What unit ``unit`` measured, or None when it has not finished."""
        return self.units.get(unit)

    def put(self, unit: str, value: Any) -> None:
        """Record a finished unit (JSON-able) and write the file."""
        self.units[unit] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.units))
        os.replace(tmp, self.path)

    def value(
        self, unit: str, compute: Callable[..., Any], *args: Any, log: Callable[[str], None] | None = None,
        say: str = "", **kwargs: Any,
    ) -> Any:  # fmt: skip
        """What unit ``unit`` measured: read back when it has finished, else measured by ``compute(*args,
        **kwargs)`` (``say`` written to ``log`` first), kept on disk and returned."""
        got = self.units.get(unit)
        if got is None:
            if log is not None and say:
                log(say)
            got = compute(*args, **kwargs)
            self.put(unit, got)
        return got

    def clear(self) -> None:
        """The reproduction has finished: forget its units."""
        self.path.unlink(missing_ok=True)


def row_from_json(r: dict) -> Row:
    """A ``Row`` back from its JSON (rows written before verdicts existed read their ``holds``)."""
    fields: dict[str, Any] = {k: r[k] for k in Row.__dataclass_fields__ if k in r}
    if fields.get("interval") is not None:
        fields["interval"] = tuple(fields["interval"])
    return Row(**fields)


def estimate_fields(est) -> dict:
    """``Row`` keywords n and interval from a ``kvlab.core.statistics.Estimate`` (or None)."""
    if est is None:
        return {}
    interval = None if est.low is None or est.high is None else (est.low, est.high)
    return {"n": est.n, "interval": interval}


def markdown_table(rows: list[dict]) -> str:
    """A report's rows (as in its JSON) as a Markdown table."""
    out = ["| setting | paper | kvlab | n, 95% interval | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        row = row_from_json(r)
        note = f" ({md(row.note)})" if row.note else ""
        out.append(f"| {md(row.setting)} | {md(row.paper)} | {md(row.kvlab)} | {md(row.spread)} | {row.shown}{note} |")
    return "\n".join(out)


def md(s: str) -> str:
    """Text for a Markdown table cell."""
    return s.replace("|", "\\|")


def clean(x):
    """JSON-safe: non-finite floats become null, floats get 5 significant digits."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, float):
        return None if not math.isfinite(x) else float(f"{x:.5g}")
    return x


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"
