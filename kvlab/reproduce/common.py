"""What every reproduction shares: the paper claims it checks, the table it prints, the files it writes.

A reproduction measures one claim of one paper on the embedded model and returns a ``Report``:
rows of (setting, the paper's number, kvlab's number, whether the paper's direction holds), the
raw measurements (JSON) and a plotly figure (HTML). The paper's numbers are ``Claim`` constants:
each carries the exact text it quotes and where in the paper it is, and a test checks that the
text is in the paper (``papers/<paper>.txt`` beside the repository).
"""

from __future__ import annotations

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


@dataclass
class Row:
    setting: str
    paper: str
    kvlab: str
    holds: bool | None  # None: no direction to check (context row, or exact itself fails)
    note: str = ""


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
        checked = [r.holds for r in self.rows if r.holds is not None]
        return None if not checked else all(checked)

    def table(self) -> str:
        head = ("setting", "paper", "kvlab", "holds")
        body = [(r.setting, r.paper, r.kvlab, _yes(r.holds) + (f" ({r.note})" if r.note else "")) for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(x[:3], widths)) + "  " + x[3] for x in [head, *body]]
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
                "holds": self.holds,
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
    out = ["| setting | paper | kvlab | holds |", "|---|---|---|---|"]
    for r in rows:
        note = f" ({_md(r['note'])})" if r.get("note") else ""
        out.append(f"| {_md(r['setting'])} | {_md(r['paper'])} | {_md(r['kvlab'])} | {_yes(r['holds'])}{note} |")
    return "\n".join(out)


def markdown_section(data: dict) -> str:
    """One report's JSON as a Markdown section: title, command, setting, time, table."""
    return (
        f"### {data['title']}\n\n`{data['command']}` ({data['seconds']:.0f} s)\n\n"
        f"Setting: {data['setting']}\n\n{markdown_table(data['rows'])}\n"
    )


def _yes(h: bool | None) -> str:
    return "n/a" if h is None else ("yes" if h else "no")


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
