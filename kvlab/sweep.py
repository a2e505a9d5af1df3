"""Sweeps: a task over lengths x depths x seeds, every method at every budget, with JSON + CSV + HTML report.

Each grid cell is one generated prompt (task, length, needle depth, seed); its methods and budgets run together
in one lockstep comparison. A cell's result is written to ``<out>/cells/<key>.json`` as soon as it
is done, and a re-run skips cells whose file exists (the key includes a hash of everything that
changes the result, the methods aside). A re-run that names methods a cell has not run runs only
those (beside ``exact``, the reference its measures are taken against, when the sweep has it) and
adds them to the cell's file: a method added to a finished leaderboard costs its own runs only.
Across processes (``accelerate launch --multi_gpu --num_processes N -m kvlab
sweep ...``, also on CPU-only machines where it runs N gloo processes; or torchrun) process r
runs cells r, r + W, r + 2W, ...; after a barrier, process 0 merges
all cell files into ``results.json``, ``results.csv`` and ``report.html``; a sweep with task scores at
fraction budgets also gets the leaderboard (``kvlab.report.leaderboard``): ``leaderboard.csv`` in
kvpress's columns and ``leaderboard.html``, its figure alone.

The protocol is kvpress's by default: query-agnostic (each task's context compressed alone, its
question asked after compression); ``protocol="query-aware"`` puts the question inside the
compressed prompt. Every mean the merge reports comes with n and a 95% interval
(``kvlab.core.statistics``): ``results.json`` holds each run label's ``summary`` per task (task score,
text similarity) and the ``leaderboard`` rows with theirs.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvlab.core.budgets import parse_budgets
from kvlab.core.results import memory_figures
from kvlab.core.statistics import mean_interval, score_interval
from kvlab.engine.specs import GenerationSettings
from kvlab.measure.fidelity import agreement
from kvlab.measure.metrics import ProbeSettings
from kvlab.report import leaderboard, ranking
from kvlab.report.sweep_report import write_report
from kvlab.run import Comparison, compare
from kvlab.tasks import Task, make_task

FIDELITY_ONLY = ProbeSettings(attn_error=False, fidelity=True, maps=False)  # teacher forcing alone
FIDELITY = ("agreement", "answer_logprob")  # kvlab.measure.fidelity's scores, per run

CSV_FIELDS = (
    "task",
    "protocol",
    "length",
    "depth",
    "seed",
    "prompt_tokens",
    "label",
    "method",
    "budget",
    "kv_bytes",
    "exact_bytes",
    "bytes_fraction",
    "peak_bytes",
    "mean_bytes",
    "peak_fraction",
    "mean_fraction",
    "budget_use",
    "shared_bytes",
    "task_score",
    "agreement",
    "answer_logprob",
    "text_similarity",
    "first_divergence",
    "kl_mean",
    "top1_agreement",
    "perplexity",
    "attn_rel_error_mean",
    "prefill_s",
    "compress_s",
    "decode_s",
)


@dataclass
class SweepConfig:
    task: str  # one task, or several comma-separated (``--suite ruler``: RULER's eight)
    lengths: list[int]
    methods: list[str]
    budgets: list[str]  # budget labels, e.g. ["0.5", "0.25"]
    seeds: int = 1
    max_new_tokens: int | None = 16  # None: each task's own (RULER's tasks name theirs), else 16
    probes: bool = True
    depth: float = 0.5
    model: str = "embedded"
    out: str = "sweep-out"
    depths: list[float] = field(default_factory=list)  # needle depths of a depth x length grid; empty: [depth]
    protocol: str = "query-agnostic"  # kvpress's: the task's question asked after compression; or "query-aware"
    fidelity: bool = True  # teacher-forced answer likelihood even without ``probes`` (kvlab.measure.fidelity)

    @property
    def tasks(self) -> list[str]:
        return [t.strip() for t in self.task.split(",") if t.strip()]

    @property
    def grid_depths(self) -> list[float]:
        return list(self.depths) or [self.depth]

    def key(self) -> str:
        """Hash of everything besides the cell that changes a cell's result."""
        # a cell file lists its methods; teacher forcing adds measures, never changes what the runs generate
        skip = ("lengths", "seeds", "out", "depths", "depth", "methods", "fidelity")
        parts = {k: v for k, v in asdict(self).items() if k not in skip}
        if parts["protocol"] == "query-aware":  # keeps the keys of cells stored before the protocol existed
            del parts["protocol"]
        return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Cell:
    task: str
    length: int
    seed: int
    depth: float = 0.5

    @property
    def name(self) -> str:
        task = re.sub(r"[^\w.-]+", "_", self.task)  # file:PATH#TASK names hold slashes
        return f"{task}-{self.length}-d{self.depth:g}-s{self.seed}"


def cells(cfg: SweepConfig) -> list[Cell]:
    return [Cell(t, n, s, d) for t in cfg.tasks for n in cfg.lengths for d in cfg.grid_depths for s in range(cfg.seeds)]


def cell_path(cfg: SweepConfig, cell: Cell) -> Path:
    return Path(cfg.out) / "cells" / f"{cell.name}-{cfg.key()}.json"


def distributed() -> tuple[int, int, Callable[[], None]]:
    """(rank, world size, barrier) from accelerate when launched by it (or torchrun), else (0, 1, no-op)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, lambda: None
    import torch
    from accelerate import PartialState

    # without GPUs, gloo on the CPU (``accelerate launch --multi_gpu --num_processes N`` or torchrun)
    state = PartialState(cpu=not torch.cuda.is_available())
    return state.process_index, state.num_processes, state.wait_for_everyone


def run_cell(engine, cfg: SweepConfig, cell: Cell, methods: list[str] | None = None) -> dict:
    """One comparison on the cell's prompt (``methods``, default the sweep's); returns the compact record
    written to its file."""

    task = make_task(cell.task, cell.length, cell.seed, engine.lm.encode, cell.depth)
    methods = list(cfg.methods if methods is None else methods)
    comparison = Comparison(
        task,
        methods,
        cfg.budgets,
        settings=GenerationSettings(
            max_new_tokens=cfg.max_new_tokens if cfg.max_new_tokens is not None else task.max_new_tokens or 16
        ),
        measure=ProbeSettings() if cfg.probes else FIDELITY_ONLY if cfg.fidelity else None,
        protocol=cfg.protocol,
    )
    result = compare(engine, comparison)
    return {
        "cell": asdict(cell),
        "methods": methods,
        "protocol": result.protocol,
        "answer": task.answer,
        "meta": task.meta,
        "prompt_tokens": result.prompt_tokens,
        "timings": result.timings,
        "runs": [_compact(r) for r in result.runs if r.exact_kv_bytes_per_step],
        # runs that never ran: budgets a method cannot hold (and plans that raised)
        "refused": [r.error for r in result.runs if not r.exact_kv_bytes_per_step],
    }


def _compact(r) -> dict:
    """A run without the bulky parts (diff opcodes, attention maps); per-layer mean error kept."""
    m = {k: v for k, v in r.metrics.items() if k not in ("diff", "attn_rel_error", "kl")}
    err = r.metrics.get("attn_rel_error")
    if err:
        m["attn_rel_error_per_layer"] = [_finite_mean(col) for col in zip(*err)]
    return {
        "label": r.label,
        "method": r.method,
        "budget": r.budget,
        "text": r.text,
        "token_ids": r.token_ids,
        "kv_bytes": r.kv_bytes,
        "kv_bytes_per_step": r.kv_bytes_per_step,
        "exact_kv_bytes_per_step": r.exact_kv_bytes_per_step,
        "budget_use": r.budget_use,
        "shared_bytes": r.shared_bytes,
        "timings": asdict(r.timings),
        "metrics": m,
    }


def _finite_mean(xs) -> float | None:
    """Mean of the values that are not null (NaN was stored as null); null when none is left."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def run_sweep(
    cfg: SweepConfig, engine_factory: Callable[[], object], log: Callable[[str], None] = print
) -> Path | None:
    """Run this process's share of the grid, then (process 0) merge. Returns the report path on process 0."""
    rank, world, barrier = distributed()
    todo = [c for i, c in enumerate(cells(cfg)) if i % world == rank]
    engine = None
    for cell in todo:
        path = cell_path(cfg, cell)
        before = json.loads(path.read_text()) if path.exists() else None
        missing = [m for m in cfg.methods if before is None or m not in methods_of(before)]
        if not missing:
            log(f"[sweep {rank}] {cell.name}: done before, skipped")
            continue
        engine = engine or engine_factory()
        if before is None:
            rec = run_cell(engine, cfg, cell)
        else:  # only the methods this cell has not run, beside the reference
            reference = ["exact"] if "exact" in cfg.methods and "exact" not in missing else []
            rec = added_to(before, run_cell(engine, cfg, cell, reference + missing))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(path)
        what = f"{len(rec['runs'])} runs" if before is None else f"{', '.join(missing)} added"
        log(f"[sweep {rank}] {cell.name}: {what}, {rec['prompt_tokens']} tokens")
    barrier()
    if rank != 0:
        return None
    return merge(cfg)


def methods_of(rec: dict) -> list[str]:
    """The methods a cell's record ran (its ``methods``; a record written before they were listed: its runs')."""
    return list(rec.get("methods") or dict.fromkeys(r["method"] for r in rec["runs"]))


def added_to(before: dict, new: dict) -> dict:
    """A cell's record with the runs of ``new`` (the same prompt, other methods) added; the reference
    ``exact`` that ``new`` ran again is not stored twice (it must give the same tokens)."""
    have = {r["label"]: r for r in before["runs"]}
    for r in new["runs"]:
        if r["label"] in have:
            if r["token_ids"] != have[r["label"]]["token_ids"]:
                raise RuntimeError(f"{new['cell']}: {r['label']} ran again and generated other tokens")
            continue
        before["runs"].append(r)
    before["refused"] = list(dict.fromkeys(before.get("refused", []) + new.get("refused", [])))
    before["methods"] = list(dict.fromkeys(methods_of(before) + new["methods"]))
    return before


def load_cells(cfg: SweepConfig) -> list[dict]:
    """The cells' records, each with the runs of the sweep's methods only (a cell file may hold more)."""
    recs = []
    for cell in cells(cfg):
        path = cell_path(cfg, cell)
        if path.exists():
            rec = json.loads(path.read_text())
            rec["runs"] = [r for r in rec["runs"] if r["method"] in cfg.methods]
            recs.append(backfilled(rec))
    return recs


def backfilled(rec: dict) -> dict:
    """A cell's record with ``agreement`` set on runs stored before it was measured, from their stored texts
    and tokens against the cell's exact run (``kvlab.measure.fidelity.agreement``); the answer's
    log-probability needs the teacher-forced run and stays unset."""
    exact = next((r for r in rec["runs"] if r["method"] == "exact"), None)
    if exact is None or all("agreement" in r["metrics"] for r in rec["runs"]):
        return rec
    meta = rec.get("meta") or {}
    refs = meta.get("references")
    task = Task(rec["cell"]["task"], "", rec.get("answer"), meta, references=refs, metric="all" if refs else "number")
    for r in rec["runs"]:
        if "agreement" not in r["metrics"]:
            r["metrics"]["agreement"] = agreement(task, r["text"], r["token_ids"], exact["text"], exact["token_ids"])
    return rec


def rows(recs: list[dict], cfg_depth: float = 0.5) -> Iterator[dict]:
    """One flat row per (cell, run), the CSV's columns (``cfg_depth``: the depth of cells that name none)."""
    for rec in recs:
        c = rec["cell"]
        for r in rec["runs"]:
            m, exact = r["metrics"], r["exact_kv_bytes_per_step"][0]
            yield {
                "task": c["task"],
                "protocol": rec.get("protocol", "query-aware"),
                "length": c["length"],
                "depth": c.get("depth", cfg_depth),
                "seed": c["seed"],
                "prompt_tokens": rec["prompt_tokens"],
                "label": r["label"],
                "method": r["method"],
                "budget": r["budget"],
                "kv_bytes": r["kv_bytes"],
                "exact_bytes": exact,
                "bytes_fraction": r["kv_bytes"] / exact,
                **{
                    k: v
                    for k, v in memory_figures(
                        r["kv_bytes_per_step"], r["exact_kv_bytes_per_step"], r.get("budget_use"), r.get("shared_bytes")
                    ).items()
                    if k in CSV_FIELDS
                },
                **{
                    k: m.get(k)
                    for k in (
                        "task_score",
                        *FIDELITY,
                        "text_similarity",
                        "first_divergence",
                        "kl_mean",
                        "top1_agreement",
                        "perplexity",
                        "attn_rel_error_mean",
                    )
                },
                **{k: r["timings"][k] for k in ("prefill_s", "compress_s", "decode_s")},
            }


def merge(cfg: SweepConfig) -> Path:

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    recs = load_cells(cfg)
    board = leaderboard.rows(recs)
    protocol = leaderboard.protocol_of(recs) if recs else cfg.protocol
    data = {
        "config": asdict(cfg),
        "protocol": protocol,
        "summary": summary(recs),
        "leaderboard": [r.as_dict() for r in board],
        # which methods the paired, Holm-corrected tests separate, per ratio and score (kvlab.report.ranking)
        "ranking": [rk.as_dict() for metric in RANKED for rk in ranking.rank_board(board, metric)],
        "cells": recs,
    }
    (out / "results.json").write_text(json.dumps(data))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows(recs, cfg.depth))
    if board:  # kvpress's leaderboard columns (then the protocol and the intervals), and the figure alone
        leaderboard.write_csv(board, out / "leaderboard.csv", protocol)
        leaderboard.figure(board, protocol=protocol).write_html(out / "leaderboard.html", include_plotlyjs="inline")
    return write_report(cfg, recs, out / "report.html")


SUMMARY = ("task_score", *FIDELITY, "text_similarity")
RANKED = ("task_score", *FIDELITY)  # the per-prompt scores the leaderboard's ranking tests


def summary(recs: list[dict]) -> list[dict]:
    """Per task and run label: the mean task score, agreement with exact's answer, answer log-probability
    and text similarity over the cells, each with n and its 95% interval (the exact binomial interval for
    0/1 scores, else a bootstrap over the cells)."""
    acc: dict[tuple[str, str], dict[str, list[float]]] = {}
    for rec in recs:
        for r in rec["runs"]:
            per = acc.setdefault((rec["cell"]["task"], r["label"]), {k: [] for k in SUMMARY})
            for key in per:
                v = r["metrics"].get(key)
                if v is not None:
                    per[key].append(float(v))
    out = []
    for (task, label), per in acc.items():
        row: dict = {"task": task, "label": label}
        for key, xs in per.items():
            est = score_interval(xs) if key in ("task_score", "agreement") else mean_interval(xs)
            row[key] = est.as_dict() if est else None
        out.append(row)
    return out


def budget_labels(text: str) -> list[str]:

    return [b.label for b in parse_budgets(text)]


__all__ = [
    "Cell",
    "SweepConfig",
    "added_to",
    "cells",
    "merge",
    "methods_of",
    "rows",
    "run_cell",
    "run_sweep",
    "summary",
]
