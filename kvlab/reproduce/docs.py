"""docs/reproductions.md and the README's tally, generated from one run's ``summary.json``.

``python -m kvlab reproduce --docs-from bench/results/reproduce/summary.json`` rewrites
docs/reproductions.md whole and the README's results block between its two markers; ``reproduce all
--docs`` does the same after a run. Nothing in them is written by hand: the claims, the implementation
checks and the controls are listed apart, each with its threshold and where the threshold comes from (the
paper, or "kvlab's, declared"), every reproduction's description is its module's docstring and its table
the rows it measured.

The engines' two reproductions (``registry.APART``, run by name only) are decided apart, in
``bench/results/reproduce-engines/summary.json``; the page's last section ("The engines' cache types",
between its own two markers, out of the papers' tally) is generated from that file by the same functions.
``--docs-from`` given that file rewrites that section alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.reproduce.claims import KVLAB, PAPER
from kvlab.reproduce.common import NOT_TESTABLE_SCALE, md
from kvlab.reproduce.registry import APART
from kvlab.reproduce.report import markdown_table

README_START = "<!-- reproduce:tally (generated from bench/results/reproduce/summary.json; do not edit) -->"
README_END = "<!-- /reproduce:tally -->"
SUMMARY = "bench/results/reproduce/summary.json"
ENGINES_SUMMARY = "bench/results/reproduce-engines/summary.json"
ENGINES_START = f"<!-- reproduce:engines (generated from {ENGINES_SUMMARY}; do not edit) -->"
ENGINES_END = "<!-- /reproduce:engines -->"
PAGE = "docs/reproductions.md"

INTRO = f"""\
`python -m kvlab reproduce NAME|all [--out DIR] [--quick]` measures the claims of the papers kvlab
implements on the embedded models and prints, for each reproduction, a table: the setting, the paper's
number, kvlab's number, n and the 95% interval where kvlab's number is a mean or an accuracy over
prompts, documents, seeds or draws (with the smallest n at which the row's test can pass), and a verdict.
`all` writes `summary.json` and `tables.md` to `--out` (default `reproduce-out/`) from one invocation;
it is resumable (each finished reproduction, and inside one each finished prompt, is kept under
`~/.cache/kvlab/reproduce/` and read back by a rerun of the same command). The task claims run on
SmolLM2-135M-Instruct and on Gemma 3 270M (`--also gemma3-270m`, the default; `--also none` skips it).
`--quick` runs small settings: a smoke run, not a measurement. This page and the README's tally are
generated from the committed run's `summary.json` (`python -m kvlab reproduce --docs-from {SUMMARY}`).

**Claims, counted once.** Every paper claim kvlab reproduces has an id (`scissorhands:table3-comparable-to-full`)
in a registry that each reproduction declares in its own module (`DECLARED`, `kvlab/reproduce/claims.py`):
the sentence or table it pins (quoted verbatim; a test checks each quote against the paper's text), the
paper's operating point (model, length, ratio or bits, metric), where kvlab measures it, and the
threshold that decides it with its source: **the paper**, or **kvlab's, declared** with kvlab's reason
where the paper states no number. Rows are evidence under a claim; the claim's one verdict comes from
its rows by one rule, declared up front: *{{rule}}*. The tally counts claims, not rows.

**Three lists.** *The papers' claims*; *implementation verified*: kvlab's own code checked against a
proved statement or against what it stores (TurboQuant's bounds, QJL's estimator, PolarQuant's tensors),
counted apart; *controls*: checks of kvlab's making that tell a result's cause apart, counted apart too.

**Operating points.** A claim is judged only at the paper's operating point (its rate, its bits, its
configuration, its metric's kind); rows at other points are context. Where the paper ties a claim to a
model scale kvlab cannot load (Scissorhands' perplexity results, which the paper says depend on the
model's size), the verdict is **{NOT_TESTABLE_SCALE}** and the measured rows are shown as evidence.
Where a claim made on a 7B-8B model is measured on a 135M or 270M one, the verdict is evidence about the
method at that scale, not a verdict on the paper's table; where kvlab runs it on both embedded models,
the verdict per model is given beside the claim's.

**Statistics** (`kvlab/core/statistics.py`). A mean over fewer than 15 values carries the Student t
interval, from 15 on the percentile bootstrap; values that do not vary carry no interval, and the row says
so (an interval of zero width would claim a certainty two equal numbers cannot give). An accuracy carries
the exact (Clopper-Pearson) interval. Two right-or-wrong scores on the same prompts are compared by the
exact two-sided McNemar test, with an interval for the difference that excludes zero exactly when the
test rejects (its coverage, enumerated, is at least 95%): 6 of 6 differing prompts all one way give
p = 0.031, and the direction is called. A row whose test cannot pass at its n (a margin of 0.2 needs 17
prompts that all agree) says it is "inconclusive by design". Verdicts: **holds**, **does not hold**,
**inconclusive**, **not testable here** (the model or the offline data cannot test it; the row says why),
and for a claim, **{NOT_TESTABLE_SCALE}**.
"""


def _counts(counts: dict) -> str:
    n = sum(counts.values())
    parts = [f"{c} {v}" for v, c in counts.items() if c]
    return f"{n}" + (f": {', '.join(parts)}" if parts else "")


def tally_sentence(summary: dict) -> str:
    t = summary["tally"]
    return (
        f"Of the papers' claims, {_counts(t['claims'])}. Implementation verified (kvlab's own code, counted "
        f"apart): {_counts(t['implementation_verified'])}. Controls (apart): {_counts(t['controls'])}. "
        f"Context rows: {t['context_rows']}."
    )


def run_sentence(summary: dict) -> str:
    inv = summary["invocation"]
    load = inv.get("load_average") or {}
    resumed = inv.get("resumed") or []
    share = inv["cpu_seconds"] / inv["wall_seconds"] if inv.get("wall_seconds") else None
    out = (
        f"One invocation, `{inv['command']}`, on {', '.join(inv['models'])}: {inv['seconds']:,.0f} s "
        f"({inv['seconds'] / 60:.0f} min), started {inv['started']}, on {inv['cpus']} CPU cores ({inv['machine']}), "
        f"{inv['threads']} torch thread(s)"
    )
    if share is not None:
        out += f"; the process got {share:.0%} of a core over its wall time"
    if load.get("start") and load.get("end"):
        out += (
            f"; the machine's load average (1, 5, 15 min) was {', '.join(map(str, load['start']))} at the start and "
            f"{', '.join(map(str, load['end']))} at the end (other jobs ran beside it)"
        )
    if resumed:
        out += (
            f". Resumed: {', '.join(f'`{r}`' for r in resumed)} were read back from an earlier process of the same "
            "command (their seconds are that process's)"
        )
    return out + "."


def _verdict(entry: dict) -> str:
    v = f"**{entry['verdict']}**"
    by = entry.get("by_model") or {}
    if len(by) > 1 or (by and entry["verdict"] != next(iter(by.values()))):
        v += " (" + "; ".join(f"{m}: {x}" for m, x in by.items()) + ")"
    return v


def _threshold(entry: dict) -> str:
    t = entry["threshold"]
    return f"{md(t['rule'])} — *{t['source']}*: {md(t['why'])}"


def _quote(entry: dict) -> str:
    q = entry.get("quote")
    if not q:
        return "-"
    return f"{q['paper']}, {md(q['where'])}: “{md(' '.join(q['quote'].split()))}”"


def _n(entry: dict, summary: dict) -> str:
    rows = summary["reproductions"][entry["reproduction"]]["rows"]
    ns = sorted({rows[i]["n"] for i in entry["rows"] if rows[i]["kind"] != "context" and rows[i].get("n")})
    return ", ".join(map(str, ns)) or "-"


def claims_table(summary: dict, source: str = "the paper") -> str:
    """One row per claim; ``source`` names who makes the claims ("the paper", "the source")."""
    out = [
        f"| id | {source} says | {source}'s operating point | kvlab measures | threshold (source) | n | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in summary["claims"]:
        p = e["point"]
        point = f"{md(p['model'])}; {md(p['length'])}; {md(p['setting'])}; {md(p['metric'])}"
        scale = f" The paper ties it to {md(e['scale'])}." if e.get("scale") else ""
        out.append(
            f"| `{e['id']}` | {md(e['statement'])} ({_quote(e)}) | {point} | {md(e['kvlab_point'])}.{scale} | "
            f"{_threshold(e)} | {_n(e, summary)} | {_verdict(e)} |"
        )
    return "\n".join(out)


def entries_table(entries: list[dict], summary: dict) -> str:
    out = ["| id | what | threshold (source) | n | verdict |", "|---|---|---|---|---|"]
    for e in entries:
        out.append(f"| `{e['id']}` | {md(e['statement'])} | {_threshold(e)} | {_n(e, summary)} | **{e['verdict']}** |")
    return "\n".join(out)


def thresholds_list(summary: dict) -> str:
    """Every threshold with its source, grouped: the paper's, then kvlab's declared ones."""
    out = []
    for source in (PAPER, KVLAB):
        items = [e for g in ("claims", "implementation_verified", "controls") for e in summary[g]
                 if e["threshold"]["source"] == source]  # fmt: skip
        if not items:
            continue
        out.append(f"**{source[0].upper() + source[1:]}** ({len(items)}):\n")
        out += [f"* `{e['id']}`: {e['threshold']['rule']} ({e['threshold']['why']})" for e in items]
        out.append("")
    return "\n".join(out)


def time_table(summary: dict) -> str:
    out = ["| reproduction | seconds | claims | checks | controls |", "|---|---|---|---|---|"]
    for name, rep in summary["reproductions"].items():
        t = rep["tally"]
        cells = [sum(t[g].values()) for g in ("claims", "implementation_verified", "controls")]
        resumed = " (read back)" if rep.get("resumed") else ""
        out.append(f"| `{name}` | {rep['seconds']:,.0f}{resumed} | {' | '.join(map(str, cells))} |")
    out.append(f"| all | {summary['invocation']['seconds']:,.0f} | | | |")
    return "\n".join(out)


def reproduction_section(name: str, rep: dict, summary: dict) -> str:
    mine = [
        e for g in ("claims", "implementation_verified", "controls") for e in summary[g] if e["reproduction"] == name
    ]
    verdicts = "\n".join(f"* `{e['id']}` ({e['kind']}): {_verdict(e)}" for e in mine) or "* (none)"
    notes = "".join(f"\nNote: {n}\n" for n in rep.get("notes", []))
    return (
        f"### {rep['title']}\n\n`{rep['command']}` ({rep['seconds']:,.0f} s)\n\n{rep.get('description', '')}\n\n"
        f"Setting: {rep['setting']}\n\nVerdicts:\n\n{verdicts}\n\n{markdown_table(rep['rows'])}\n{notes}"
    )


def is_engines_summary(summary: dict) -> bool:
    """Whether ``summary`` decides the engines' reproductions (``APART``) and nothing else."""
    reps = summary.get("reproductions") or {}
    return bool(reps) and set(reps) <= set(APART)


def engines_run_sentence(engines: dict) -> str:
    """How the engines' results were measured and then decided (their summary records no machine or load)."""
    inv = engines["invocation"]
    measured = "; ".join(f"`{c}`" for c in (inv.get("measured_by") or {}).values())
    out = f"Measured on {', '.join(inv['models'])}" + (f" by {measured}" if measured else "")
    out += f", {inv['seconds']:,.0f} s ({inv['seconds'] / 60:.0f} min) of runs together"
    if inv.get("rejudged"):
        out += f"; decided again from the stored measurements, measuring nothing, by `{inv['command']}`"
    return out + "."


def engines_section(engines: dict) -> str:
    """The engines' two reproductions, between their markers, apart from the papers' tally."""
    names = ", ".join(f"`{n}`" for n in engines["reproductions"])
    sections = "\n".join(reproduction_section(n, r, engines) for n, r in engines["reproductions"].items())
    tally = tally_sentence(engines).replace("Of the papers' claims", "Of the engines' claims")
    return f"""{ENGINES_START}
## The engines' cache types

The serving engines' cache flags rest on claims of their own (vLLM's and llama.cpp's, not a paper's),
measured by two reproductions that run by name only (`python -m kvlab reproduce NAME`; `reproduce all`
leaves them out for their time): {names}. Their claims are **not counted in the papers' tally** above.
Their files are in `{ENGINES_SUMMARY.rsplit("/", 1)[0]}/`: `summary.json`, which this section is generated
from (`python -m kvlab reproduce --docs-from {ENGINES_SUMMARY}`), `tables.md`, and each model's
measurements, `smollm2/NAME.json` and `gemma3-270m/NAME.json`. What they test and why, and the machine and
load they ran on: [engine-caches](methods/engine-caches.md#the-two-reproductions).

{engines_run_sentence(engines)}

{tally} One rule decides a claim from its rows: *{engines["rule"]}*.

### The engines' claims

One row per claim id, with its verdict per model; n is that of its evidence rows, their intervals are in
the tables below.

{claims_table(engines, "the source")}

### The engines' thresholds and their source

{thresholds_list(engines)}
{sections}
{ENGINES_END}"""


def reproductions_md(summary: dict, engines: dict | None = None) -> str:
    """The whole of docs/reproductions.md; ``engines``, the engines' summary, adds their section at the end."""
    sections = "\n".join(reproduction_section(n, r, summary) for n, r in summary["reproductions"].items())
    page = f"""# Reproductions: the papers' claims measured on the embedded models

<!-- generated from {SUMMARY} by `python -m kvlab reproduce --docs-from {SUMMARY}`; do not edit by hand -->

{INTRO.replace("{rule}", summary["rule"])}
## Summary

{run_sentence(summary)}

{tally_sentence(summary)}

## The papers' claims

One row per claim id; n is that of its evidence rows.

{claims_table(summary)}

## Implementation verified

{entries_table(summary["implementation_verified"], summary)}

## Controls

{entries_table(summary["controls"], summary)}

## Every threshold and its source

{thresholds_list(summary)}
## Time

{time_table(summary)}

## The reproductions

{sections}"""
    return page if engines is None else f"{page}\n{engines_section(engines)}\n"


def readme_block(summary: dict) -> str:
    """The README's results block: the run, the tally, one line per claim."""
    lines = [
        README_START,
        "",
        f"`kvlab reproduce all` measures the papers' claims on the embedded models. {run_sentence(summary)} "
        f"{tally_sentence(summary)} Each claim is counted once, judged at the paper's operating point by a "
        "threshold whose source (the paper, or kvlab's, declared) is listed with it in "
        "[`docs/reproductions.md`](docs/reproductions.md), where the rows, intervals and the checks of "
        "kvlab's own code are.",
        "",
        "| claim | verdict |",
        "|---|---|",
    ]
    lines += [f"| `{e['id']}`: {md(e['statement'])} | {_verdict(e)} |" for e in summary["claims"]]
    lines += ["", README_END]
    return "\n".join(lines)


def with_block(text: str, start: str, end: str, block: str, where: str, append: bool = False) -> str:
    """``text`` with the part from ``start`` to ``end`` replaced by ``block`` (which holds both markers);
    without the markers, ``block`` is appended where ``append`` allows it, else a one-line error."""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    if not append:
        raise ValueError(f"{where}: no block ({start} ... {end}) to replace")
    return f"{text.rstrip()}\n\n{block}\n" if text.strip() else f"{block}\n"


def _summary(path: str | Path) -> dict:
    summary = json.loads(Path(path).read_text())
    if "invocation" not in summary:
        raise ValueError(
            f"{path}: a summary without 'invocation' predates the claim registry; write a new one with "
            "`python -m kvlab reproduce all --out DIR` (or `--rejudge`) and generate the docs from it"
        )
    return summary


def write_docs(summary_path: str | Path, root: str | Path) -> list[Path]:
    """Rewrite docs/reproductions.md and the README's block under ``root`` from ``summary_path``.

    The page carries the engines' section generated from ``root``'s ``ENGINES_SUMMARY`` where that file
    exists. Given the engines' summary itself (``is_engines_summary``), only their section is rewritten (or
    appended, on a page without its markers), and the README is left alone."""
    summary = _summary(summary_path)
    root = Path(root)
    doc = root / PAGE
    if is_engines_summary(summary):
        text = doc.read_text() if doc.is_file() else ""
        doc.write_text(with_block(text, ENGINES_START, ENGINES_END, engines_section(summary), str(doc), append=True))
        return [doc]
    engines = root / ENGINES_SUMMARY
    doc.write_text(reproductions_md(summary, _summary(engines) if engines.is_file() else None))
    readme = root / "README.md"
    readme.write_text(with_block(readme.read_text(), README_START, README_END, readme_block(summary), str(readme)))
    return [doc, readme]


__all__ = ["engines_section", "is_engines_summary", "readme_block", "reproductions_md", "tally_sentence", "write_docs"]
