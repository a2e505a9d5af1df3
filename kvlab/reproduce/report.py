"""A reproduction's result: its rows, its registry entries' verdicts, the files it writes.

``Report`` is what ``run(ctx)`` returns; ``report(ctx, module, ...)`` builds it from the module's own
``NAME``, ``TITLE``, ``CLAIMS`` (quotes) and ``DECLARED`` (registry entries), so no reproduction repeats
that. ``verdicts`` gives one verdict per declared id (``claims.decide``); ``tally`` counts the paper claims,
the implementation checks and the controls apart, one each per id, and the context rows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.reproduce.claims import Declared, combine, decide, validate
from kvlab.reproduce.common import (
    CHECK,
    CLAIM,
    CLAIM_VERDICTS,
    CONTEXT,
    CONTROL,
    NOT_TESTABLE_SCALE,
    Claim,
    Row,
    clean,
    md,
    row_from_json,
)

GROUPS = {CLAIM: "claims", CHECK: "implementation_verified", CONTROL: "controls"}


def empty_tally() -> dict:
    return {**{g: dict.fromkeys(CLAIM_VERDICTS, 0) for g in GROUPS.values()}, "context_rows": 0}


def verdicts_of(declared: tuple[Declared, ...] | list[Declared], rows: list[Row]) -> dict[str, dict]:
    """Each declared id's verdict (``claims.decide``) from ``rows``."""
    return {e.id: decide(e, rows) for e in declared}


def tally_of(declared, rows: list[Row]) -> dict:
    """One verdict per declared id, counted by kind (claims, implementation checks, controls), and the context
    rows."""
    out = empty_tally()
    for e in declared:
        out[GROUPS[e.kind]][decide(e, rows)["verdict"]] += 1
    out["context_rows"] = sum(r.kind == CONTEXT for r in rows)
    return out


def overall(verdicts: list[str]) -> str | None:
    """A reproduction's verdict from its claims' verdicts (``claims.combine``; "not testable at this scale" when
    every claim is so)."""
    if not verdicts:
        return None
    if all(v == NOT_TESTABLE_SCALE for v in verdicts):
        return NOT_TESTABLE_SCALE
    return combine(verdicts)


@dataclass
class Report:
    name: str
    title: str
    command: str
    setting: str
    rows: list[Row]
    data: dict[str, Any]
    claims: list[Claim] = field(default_factory=list)  # the quotes
    figure: Any = None  # plotly Figure
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    declared: tuple[Declared, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        validate(self.declared, self.rows, self.name)

    def verdicts(self) -> dict[str, dict]:
        return verdicts_of(self.declared, self.rows)

    @property
    def verdict(self) -> str | None:
        """The verdict over this reproduction's paper claims (None when it declares none)."""
        v = self.verdicts()
        return overall([v[e.id]["verdict"] for e in self.declared if e.kind == CLAIM])

    def tally(self) -> dict:
        return tally_of(self.declared, self.rows)

    def table(self) -> str:
        head = ("setting", "paper", "kvlab", "n, 95% interval", "verdict")
        body = [
            (r.setting + (f" [{r.model}]" if r.model else ""), r.paper, r.kvlab, r.spread,
             r.shown + (f" ({r.note})" if r.note else ""))
            for r in self.rows
        ]  # fmt: skip
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(x[:4], widths)) + "  " + x[4] for x in [head, *body]]
        verdicts = self.verdicts()
        lines += [f"  {e.id} ({e.kind}): {verdicts[e.id]['verdict']}" for e in self.declared]
        return "\n".join(lines)

    def markdown(self) -> str:
        return markdown_table([asdict(r) for r in self.rows])

    def to_json(self) -> dict:
        return clean(
            {
                "name": self.name,
                "title": self.title,
                "command": self.command,
                "setting": self.setting,
                "description": self.description,
                "verdict": self.verdict,
                "verdicts": self.verdicts(),
                "tally": self.tally(),
                "seconds": round(self.seconds, 1),
                "rows": [asdict(r) for r in self.rows],
                "declared": [e.as_dict() for e in self.declared],
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


def report(
    ctx, module: str, setting: str, rows: list[Row], data: dict, figure=None, notes: list[str] | None = None
) -> Report:
    """The ``Report`` of reproduction module ``module`` (its ``__name__``): its name, title, quotes and registry
    entries from the module, the command from ``ctx``; the runner sets the seconds."""
    mod = sys.modules[module]
    return Report(
        mod.NAME,
        mod.TITLE,
        ctx.command(mod.NAME),
        setting,
        rows,
        data,
        list(mod.CLAIMS),
        figure,
        0.0,
        list(notes or []),
        tuple(getattr(mod, "DECLARED", ())),
        (mod.__doc__ or "").strip(),
    )


def markdown_table(rows: list[dict]) -> str:
    """A report's rows (as in its JSON) as a Markdown table, each row with the registry id it bears on."""
    out = ["| id | setting | paper | kvlab | n, 95% interval | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        row = row_from_json(r)
        note = f" ({md(row.note)})" if row.note else ""
        model = f" [{row.model}]" if row.model else ""
        out.append(
            f"| {md(row.claim) or '-'} | {md(row.setting)}{md(model)} | {md(row.paper)} | {md(row.kvlab)} | "
            f"{md(row.spread)} | {row.shown}{note} |"
        )
    return "\n".join(out)


__all__ = ["GROUPS", "Report", "empty_tally", "markdown_table", "overall", "report", "tally_of", "verdicts_of"]
