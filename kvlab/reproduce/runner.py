"""Run reproductions: print each table, write ``NAME.json`` / ``NAME.html``, ``summary.json`` and ``tables.md``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvlab.reproduce.common import Report, markdown_section
from kvlab.reproduce.context import Context
from kvlab.reproduce.registry import REPRODUCTIONS, get_reproduction


def run_reproductions(which: list[str], ctx: Context, out: str | Path, echo=print) -> list[Report]:
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
    summary = {
        "quick": ctx.quick,
        "seconds": round(total, 1),
        "reproductions": {r.name: {"holds": r.holds, "seconds": round(r.seconds, 1)} for r in reports},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "tables.md").write_text("\n".join(markdown_section(r.to_json()) for r in reports))
    echo(f"\n{len(reports)} reproduction(s) in {total:.0f} s; output in {out}")
    return reports


def expand(name: str) -> list[str]:
    return list(REPRODUCTIONS) if name == "all" else [name]
