"""Run reproductions: print each table, write ``NAME.json`` / ``NAME.html``, ``summary.json`` and ``tables.md``.

The summary tallies the papers' claims only (holds / does not hold / inconclusive / not testable
here); kvlab's own controls and the context rows are counted apart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvlab.reproduce.common import VERDICTS, Report, markdown_section
from kvlab.reproduce.registry import REPRODUCTIONS, get_reproduction
from kvlab.reproduce.setup import ReproductionSetup


def run_reproductions(which: list[str], ctx: ReproductionSetup, out: str | Path, echo=print) -> list[Report]:
    out = Path(out)
    mods = [get_reproduction(n) for n in which]  # unknown names fail before any work
    t0 = time.perf_counter()
    reports = []
    for mod in mods:
        ctx.log(f"{mod.NAME}: running")
        rep = mod.run(ctx)
        paths = rep.write(out)
        reports.append(rep)
        echo(f"\n== {rep.title}\n   {rep.setting}\n   ({rep.seconds:.0f} s; {', '.join(str(p) for p in paths)})")
        echo(rep.table())
        for note in rep.notes:
            echo(f"   note: {note}")
    total = time.perf_counter() - t0
    claims, controls = dict.fromkeys(VERDICTS, 0), dict.fromkeys(VERDICTS, 0)
    context = 0
    for r in reports:
        t = r.tally()
        context += t["context"]
        for v in VERDICTS:
            claims[v] += t["claims"][v]
            controls[v] += t["controls"][v]
    summary = {
        "quick": ctx.quick,
        "seconds": round(total, 1),
        "claims": claims,  # the papers' claims only
        "controls": controls,  # kvlab's own controls, apart
        "context_rows": context,  # settings, references, bookkeeping: no verdict
        "reproductions": {
            r.name: {"verdict": r.verdict, "tally": r.tally(), "seconds": round(r.seconds, 1)} for r in reports
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    line = tally_line(claims, controls, context)
    (out / "tables.md").write_text(f"{line}\n\n" + "\n".join(markdown_section(r.to_json()) for r in reports))
    echo(f"\n{len(reports)} reproduction(s) in {total:.0f} s; output in {out}\n{line}")
    return reports


def tally_line(claims: dict, controls: dict, context: int) -> str:
    """The tally as a sentence: the papers' claims by verdict, then kvlab's controls and the context rows."""

    def words(counts: dict) -> str:
        return ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "none"

    return (
        f"The papers' claims: {words(claims)}. kvlab's own controls (apart): {words(controls)}. "
        f"Context rows: {context}."
    )


def expand(name: str) -> list[str]:
    return list(REPRODUCTIONS) if name == "all" else [name]
