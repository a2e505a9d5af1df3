"""What every reproduction shares: the paper claims it checks, the table it prints, the files it writes.

A reproduction measures one claim of one paper on the embedded model and returns a ``Report``:
rows of (setting, the paper's number, kvlab's number, n and the 95% interval where kvlab's number is
a mean over prompts or seeds, the verdict), the raw measurements (JSON) and a plotly figure (HTML).
The paper's numbers are ``Claim`` constants: each carries the exact text it quotes and where in the
paper it is, and a test checks that the text is in the paper (``papers/<paper>.txt`` beside the
repository).

A row is one of three kinds. A **claim** row tests the paper's own claim and carries one of four
verdicts: ``holds``, ``does not hold``, ``inconclusive`` (the data cannot decide: every method ties,
the interval straddles the line) or ``not testable here`` (the model or the data cannot test it; the
row's note says why). A **control** row is kvlab's own check (a control method, a threshold the
paper does not state) with a verdict in the same words; a **context** row gives settings, references
or bookkeeping and has no verdict. The tally counts claim rows only; controls and context are
listed apart.

A long reproduction is resumable: ``Progress`` keeps each finished unit of work (a document, a
prompt) on disk as it completes, and a rerun with the same settings reads those units back
instead of measuring them again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
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
VERDICTS = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_TESTABLE)
CLAIM, CONTROL, CONTEXT = "claim", "control", "context"
KINDS = (CLAIM, CONTROL, CONTEXT)


@dataclass
class Row:
    """One line of a reproduction's table.

    ``holds`` (True / False) is shorthand for the verdicts "holds" / "does not hold"; a row given
    neither a direction nor a verdict is context. ``n`` and ``interval`` (kvlab's 95% interval, the
    same scale as ``kvlab``) where kvlab's number is a mean over prompts or seeds."""

    setting: str
    paper: str
    kvlab: str
    holds: bool | None = None
    note: str = ""
    verdict: str | None = None
    kind: str = CLAIM
    n: int | None = None
    interval: tuple[float, float] | None = None

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

    @property
    def shown(self) -> str:
        """The verdict column: the verdict, "control: ..." for kvlab's own controls, "(context)"."""
        if self.kind == CONTEXT:
            return "(context)"
        return f"control: {self.verdict}" if self.kind == CONTROL else str(self.verdict)

    @property
    def spread(self) -> str:
        """n and the interval as printed: "n = 10, [0.35, 0.93]", "n = 1", or ""."""
        if self.n is None:
            return ""
        if self.interval is None:
            return f"n = {self.n}"
        return f"n = {self.n}, [{fmt(self.interval[0])}, {fmt(self.interval[1])}]"


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


def tally(rows: list[dict]) -> dict:
    """Counts of a report's rows (as in its JSON): the claims by verdict, kvlab's controls by verdict,
    and the context rows, each apart."""
    out: dict = {"claims": {v: 0 for v in VERDICTS}, "controls": {v: 0 for v in VERDICTS}, "context": 0}
    for r in map(row_from_json, rows):
        if r.kind == CONTEXT or r.verdict is None:
            out["context"] += 1
        else:
            out["claims" if r.kind == CLAIM else "controls"][r.verdict] += 1
    return out


def overall(rows: list[Row]) -> str | None:
    """A reproduction's verdict from its claim rows: "not testable here" when none could be tested, else
    "does not hold" if any claim does not, "inconclusive" if any is, "holds" when every tested one holds."""
    verdicts = [r.verdict for r in rows if r.kind == CLAIM]
    if not verdicts:
        return None
    tested = [v for v in verdicts if v != NOT_TESTABLE]
    if not tested:
        return NOT_TESTABLE
    for v in (DOES_NOT_HOLD, INCONCLUSIVE):
        if v in tested:
            return v
    return HOLDS


@dataclass
class Report:
    name: str
    title: str
    command: str
    setting: str
    rows: list[Row]
    data: dict[str, Any]
    claims: list[Claim] = field(default_factory=list)
    figure: Any = None  # plotly Figure
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def holds(self) -> bool | None:
        """True when every tested claim holds, False when any does not; None otherwise."""
        v = overall(self.rows)
        return {HOLDS: True, DOES_NOT_HOLD: False}.get(v or "")

    @property
    def verdict(self) -> str | None:
        return overall(self.rows)

    def tally(self) -> dict:
        return tally([asdict(r) for r in self.rows])

    def table(self) -> str:
        head = ("setting", "paper", "kvlab", "n, 95% interval", "verdict")
        body = [
            (r.setting, r.paper, r.kvlab, r.spread, r.shown + (f" ({r.note})" if r.note else "")) for r in self.rows
        ]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(x[:4], widths)) + "  " + x[4] for x in [head, *body]]
        return "\n".join(lines)

    def markdown(self) -> str:
        return markdown_table([asdict(r) for r in self.rows])

    def to_json(self) -> dict:
        return _clean(
            {
                "name": self.name,
                "title": self.title,
                "command": self.command,
                "setting": self.setting,
                "verdict": self.verdict,
                "holds": self.holds,
                "tally": self.tally(),
                "seconds": round(self.seconds, 1),
                "rows": [asdict(r) for r in self.rows],
                "claims": [asdict(c) for c in self.claims],
                "notes": self.notes,
                "data": self.data,
            }
        )

    def write(self, out: Path) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{self.name}.json"]
        paths[0].write_text(json.dumps(self.to_json(), indent=1))
        if self.figure is not None:
            paths.append(out / f"{self.name}.html")
            self.figure.write_html(paths[-1], include_plotlyjs="cdn", full_html=True)
        return paths


def markdown_table(rows: list[dict]) -> str:
    """A report's rows (as in its JSON) as a Markdown table."""
    out = ["| setting | paper | kvlab | n, 95% interval | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        row = row_from_json(r)
        note = f" ({_md(row.note)})" if row.note else ""
        out.append(
            f"| {_md(row.setting)} | {_md(row.paper)} | {_md(row.kvlab)} | {_md(row.spread)} | {row.shown}{note} |"
        )
    return "\n".join(out)


def markdown_section(data: dict) -> str:
    """One report's JSON as a Markdown section: title, command, setting, time, verdict, table."""
    t = tally(data["rows"])
    claims = ", ".join(f"{k} {v}" for k, v in t["claims"].items() if v) or "none"
    return (
        f"### {data['title']}\n\n`{data['command']}` ({data['seconds']:.0f} s)\n\n"
        f"Setting: {data['setting']}\n\nVerdict: **{data.get('verdict') or 'no claim tested'}** "
        f"(claims: {claims})\n\n{markdown_table(data['rows'])}\n"
    )


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def _clean(x):
    """JSON-safe: non-finite floats become null, floats get 5 significant digits."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return None if not math.isfinite(x) else float(f"{x:.5g}")
    return x


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"
