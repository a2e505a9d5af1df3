"""Run reproductions: print each table, write ``NAME.json`` / ``NAME.html``, ``summary.json`` and ``tables.md``.

One invocation makes one summary: every reproduction asked for, run by this code, with the time it took
and the load it ran under. It is resumable: each finished reproduction is kept on disk (``Progress``,
keyed by the settings and the models, each reproduction under the digest of its code) and a rerun reads
it back instead of measuring it again, where its code is unchanged; the summary lists the reproductions
read back, and their seconds are those of the process that measured them. Inside a reproduction, its own ``Progress``
keeps each prompt as it finishes.

The summary counts one verdict per registry id (``kvlab.reproduce.claims``): the papers' claims, kvlab's
implementation checks and its controls, each apart, and the context rows; docs/reproductions.md and the
README's tally are generated from it (``kvlab.reproduce.docs``).

``rejudge_reproductions`` decides a finished run again from its stored ``NAME.json`` files, measuring nothing:
for a reproduction whose module decides its rows from its stored data alone (``rows_of(data)``), the rows are
made by this code from the measurements of the run that stored them. Files of one reproduction measured one
model at a time are joined, model by model.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import resource
import time
from pathlib import Path

from kvlab.engine.embedded import EMBEDDED, embedded
from kvlab.reproduce.claims import EVERY_ROW
from kvlab.reproduce.common import Progress, clean, row_from_json
from kvlab.reproduce.registry import REPRODUCTIONS, get_reproduction
from kvlab.reproduce.report import GROUPS, Report, empty_tally, markdown_table, verdicts_of
from kvlab.reproduce.setup import ReproductionSetup

HERE = Path(__file__).resolve().parent


def _source_digest(module_file: str) -> str:
    """The digest of a reproduction module's source and of every module of this package it imports, directly
    or not (the docs generator aside): a changed reproduction is measured again, the others are read back."""
    seen: set[Path] = set()
    todo = [Path(module_file)]
    while todo:
        f = todo.pop()
        if f in seen or f.name == "docs.py" or not f.is_file():
            continue
        seen.add(f)
        todo += [HERE / f"{m}.py" for m in re.findall(r"^from kvlab\.reproduce\.(\w+) import", f.read_text(), re.M)]
        todo += [HERE / "setup.py", HERE / "runner.py"]  # what runs every reproduction
    h = hashlib.sha256()
    for f in sorted(seen):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _report_from_json(data: dict, mod) -> Report:
    """A finished reproduction read back (its figure is not kept)."""
    return Report(
        data["name"],
        data["title"],
        data["command"],
        data["setting"],
        [row_from_json(r) for r in data["rows"]],
        data["data"],
        list(mod.CLAIMS),
        None,
        float(data["seconds"]),
        list(data.get("notes", [])),
        tuple(getattr(mod, "DECLARED", ())),
        data.get("description", ""),
    )


def run_reproductions(which: list[str], ctx: ReproductionSetup, out: str | Path, echo=print) -> list[Report]:
    out = Path(out)
    mods = [get_reproduction(n) for n in which]  # unknown names fail before any work
    key = {"quick": ctx.quick, "models": ctx.all_models, "overrides": ctx.overrides}
    done = Progress("run", key)  # each finished reproduction, under the digest of the code that measured it
    started, t0, cpu0, load0 = datetime.datetime.now().astimezone(), time.perf_counter(), _cpu_seconds(), _load()
    reports, resumed = [], []
    for mod in mods:
        unit = f"{mod.NAME}/{_source_digest(str(mod.__file__))}"
        saved = done.get(unit)
        if saved is not None:
            rep = _report_from_json(saved, mod)
            resumed.append(mod.NAME)
            ctx.log(f"{mod.NAME}: read back from an earlier run of this command ({rep.seconds:.0f} s)")
        else:
            ctx.log(f"{mod.NAME}: running")
            t = time.perf_counter()
            rep = mod.run(ctx)
            rep.seconds = time.perf_counter() - t
            done.put(unit, rep.to_json())
        paths = rep.write(out)
        reports.append(rep)
        echo(f"\n== {rep.title}\n   {rep.setting}\n   ({rep.seconds:.0f} s; {', '.join(str(p) for p in paths)})")
        echo(rep.table())
        for note in rep.notes:
            echo(f"   note: {note}")
    invocation = {
        "command": ctx.command("all" if list(which) == list(REPRODUCTIONS) else " ".join(which)),
        "quick": ctx.quick,
        "models": [ctx.on(m).label for m in ctx.all_models],
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(_cpu_seconds() - cpu0, 1),
        "seconds": round(sum(r.seconds for r in reports), 1),
        "resumed": resumed,
        "threads": _threads(),
        "cpus": os.cpu_count(),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "load_average": {"start": load0, "end": _load()},
    }
    summary = build_summary(reports, invocation)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "tables.md").write_text(tables_markdown(summary))
    done.clear()
    echo(f"\n{len(reports)} reproduction(s) in {invocation['seconds']:.0f} s; output in {out}\n{tally_line(summary)}")
    return reports


class RejudgeError(ValueError):
    pass


def _stored_models(stored: dict, spec: str | None) -> dict[str, dict]:
    """The prompts of each model in one stored ``NAME.json``: ``data["models"]``, or for a file of one model
    (``data["prompts"]``) that model's label: ``spec`` (a model spec) where given, else the ``--model`` of the
    command that measured it (none: the embedded default)."""
    data = stored["data"]
    if "models" in data:
        return dict(data["models"])
    m = re.search(r"--model (\S+)", stored.get("command", ""))
    spec = spec or (m.group(1) if m else EMBEDDED)
    model = embedded(spec)
    label = model.display.split(" (")[0] if model is not None else spec.split("/")[-1]
    return {label: data["prompts"]}


def _model_flag(stored: dict, spec: str | None) -> str:
    """`` --model SPEC`` for a file whose command does not name the model given for it (not the default)."""
    if not spec or "--model" in stored.get("command", "") or embedded(spec) is embedded(EMBEDDED):
        return ""
    return f" --model {spec}"


def rejudge_reproductions(paths: list[str], out: str | Path, echo=print) -> list[Report]:
    """Each reproduction's rows decided again from stored ``NAME.json`` files (``paths``; ``PATH=MODEL`` names the
    model of a one-model file whose command does not), nothing measured: the files of one reproduction are joined
    model by model, its module's ``rows_of`` decides the rows, its seconds are those of the runs that measured
    it. Writes ``NAME.json``, ``summary.json`` and ``tables.md`` to ``out``."""
    groups: dict[str, list[tuple[Path, dict, str | None]]] = {}
    for arg in paths:
        path, _, given = str(arg).partition("=")
        p = Path(path)
        try:
            stored = json.loads(p.read_text())
            groups.setdefault(stored["name"], []).append((p, stored, given or None))
        except (OSError, ValueError, KeyError) as exc:
            raise RejudgeError(f"--rejudge: {p} is not a reproduction's stored NAME.json ({exc})") from None
    t0, reports = time.perf_counter(), []
    for name, files in groups.items():
        mod = get_reproduction(name)
        if not hasattr(mod, "rows_of"):
            raise RejudgeError(f"--rejudge: {name} cannot be decided from stored data (its module has no rows_of)")
        models: dict[str, dict] = {}
        for p, stored, spec in files:
            for label, prompts in _stored_models(stored, spec).items():
                if label in models:
                    raise RejudgeError(f"--rejudge: {name} on {label} is stored twice (again in {p})")
                models[label] = prompts
        data = {**files[0][1]["data"], "models": models}
        data.pop("prompts", None)
        commands = [stored["command"] + _model_flag(stored, spec) for _, stored, spec in files]
        how = f"decided from the stored measurements of {'; '.join(commands)} (kvlab reproduce --rejudge)"
        notes = [*files[0][1].get("notes", []), how]
        rep = Report(name, mod.TITLE, "; ".join(commands), mod.setting_of(data), mod.rows_of(data), data,
                     list(mod.CLAIMS), mod.figure(data), sum(float(s["seconds"]) for _, s, _ in files), notes,
                     tuple(mod.DECLARED), (mod.__doc__ or "").strip())  # fmt: skip
        paths_out = rep.write(Path(out))
        reports.append(rep)
        echo(f"\n== {rep.title}\n   {rep.setting}\n   ({rep.seconds:.0f} s measured; {', '.join(map(str, paths_out))})")
        echo(rep.table())
    invocation = {
        "command": "python -m kvlab reproduce --rejudge " + " ".join(str(p) for p in paths),
        "rejudged": True,
        "measured_by": {r.name: r.command for r in reports},
        "quick": False,
        "models": list(dict.fromkeys(m for r in reports for m in r.data["models"])),
        "seconds": round(sum(r.seconds for r in reports), 1),
        "decide_seconds": round(time.perf_counter() - t0, 1),
        "resumed": [],
    }
    summary = build_summary(reports, invocation)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1))
    (Path(out) / "tables.md").write_text(tables_markdown(summary))
    echo(f"\n{len(reports)} reproduction(s) decided again; output in {out}\n{tally_line(summary)}")
    return reports


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def build_summary(reports: list[Report], invocation: dict) -> dict:
    """The run as JSON: the invocation, the tally (one verdict per registry id), each registry entry with its
    verdict and where its rows are, and each reproduction with its rows."""
    tally = empty_tally()
    groups: dict[str, list] = {g: [] for g in GROUPS.values()}
    for rep in reports:
        verdicts = verdicts_of(rep.declared, rep.rows)
        for e in rep.declared:
            v = verdicts[e.id]
            tally[GROUPS[e.kind]][v["verdict"]] += 1
            rows = [i for i, r in enumerate(rep.rows) if r.claim == e.id]
            groups[GROUPS[e.kind]].append({**e.as_dict(), **v, "reproduction": rep.name, "rows": rows})
        tally["context_rows"] += sum(r.kind == "context" for r in rep.rows)
    return clean(
        {
            "invocation": invocation,
            "tally": tally,
            "rule": EVERY_ROW,
            **groups,
            "reproductions": {
                r.name: {
                    **{k: v for k, v in r.to_json().items() if k not in ("data", "declared", "verdicts")},
                    "resumed": r.name in invocation.get("resumed", []),
                }
                for r in reports
            },
        }
    )


def tally_line(summary: dict) -> str:
    """The tally as a sentence: the papers' claims by verdict, then the implementation checks and the controls."""
    t = summary["tally"]

    def words(counts: dict) -> str:
        n = sum(counts.values())
        return f"{n} ({', '.join(f'{c} {v}' for v, c in counts.items() if c) or 'none'})"

    return (
        f"The papers' claims: {words(t['claims'])}. Implementation verified (apart): "
        f"{words(t['implementation_verified'])}. Controls (apart): {words(t['controls'])}. "
        f"Context rows: {t['context_rows']}."
    )


def tables_markdown(summary: dict) -> str:
    """Every reproduction's table, after the tally."""
    parts = [tally_line(summary), ""]
    for rep in summary["reproductions"].values():
        parts.append(
            f"### {rep['title']}\n\n`{rep['command']}` ({rep['seconds']:.0f} s)\n\nSetting: {rep['setting']}\n\n"
            f"{markdown_table(rep['rows'])}\n"
        )
    return "\n".join(parts)


def expand(name: str) -> list[str]:
    return list(REPRODUCTIONS) if name == "all" else [name]


__all__ = [
    "RejudgeError",
    "build_summary",
    "expand",
    "rejudge_reproductions",
    "run_reproductions",
    "tables_markdown",
    "tally_line",
]
