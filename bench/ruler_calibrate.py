"""Exact's accuracy on RULER's synthetic tasks (``kvlab.tasks.ruler``) per length, seeds as the outer loop.

``python -m bench.ruler_calibrate --lengths 1k,2k,4k --seeds 5 --out bench/results``

A run resumes where the files in ``--out`` stop: (task, seed) pairs already there are skipped, so
the same command with a larger ``--seeds`` adds seeds.

Like ``python -m kvlab tasks calibrate`` (same prompts, same greedy full-cache decoding, same
JSON per task: ``calibrate-<task>.json``), but every task advances one seed at a time, so a run
cut short has about as many seeds for every task and length. Each file is rewritten after every
sample. The tasks that reach ``ABLE`` (exact's mean score) at a length are recorded per model in
``kvlab/data/calibration.json``, which decides the page's presets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvlab.calibrate import calibrate, format_calibration, summarize
from kvlab.engine.loader import load_model
from kvlab.tasks import RULER_TASKS, parse_length


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(RULER_TASKS))
    p.add_argument("--lengths", default="1k,2k,4k")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="embedded")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--table", action="store_true", help="print the Markdown table of the files in --out and stop")
    p.add_argument("--merge-from", default="", help="add the samples of another run's folder to --out and stop")
    args = p.parse_args(argv)
    if args.merge_from:
        merge_from(Path(args.merge_from), Path(args.out))
        return 0
    if args.table:
        print(markdown_table(Path(args.out), [t for t in args.tasks.split(",") if t]))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    lm = load_model(args.model, "auto")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, dict] = {}
    seconds = {t: dict.fromkeys(lengths, 0.0) for t in tasks}
    for task in tasks:  # resume: the samples already in the task's file are kept and not run again
        path = out / f"calibrate-{task}.json"
        if path.exists():
            data[task] = json.loads(path.read_text())
            for r in data[task]["results"]:
                seconds[task][r["length"]] = r["seconds"]
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for task in tasks:
            done = {s["length"] for s in data.get(task, {}).get("samples", []) if s["seed"] == seed}
            missing = [n for n in lengths if n not in done]
            if not missing:
                continue
            t0 = time.perf_counter()
            one = calibrate(lm, task, missing, 1, max_new_tokens=10, first_seed=seed)
            for s in one["samples"]:  # the per-length time of this seed, split evenly over its lengths
                seconds[task][s["length"]] += (time.perf_counter() - t0) / len(missing)
            d = data.setdefault(task, one | {"samples": []})
            d["samples"] += one["samples"]
            d["results"] = summarize(d["samples"], lengths, seconds[task])
            d["command"] = "python -m bench.ruler_calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
            (out / f"calibrate-{task}.json").write_text(json.dumps(d, indent=1))
            print(f"seed {seed} {task}: " + ", ".join(f"{s['length']}:{s['hit']:.2f}" for s in one["samples"]),
                  flush=True)  # fmt: skip
    for task in tasks:
        print(format_calibration(data[task]))
    return 0


def _cell(row: dict) -> str:
    """``0.80 [0.44, 0.97] (10)``: exact's mean score, its 95% interval and the prompts."""
    ci = row.get("interval") or {}
    spread = f" [{ci['low']:.2f}, {ci['high']:.2f}]" if ci.get("low") is not None else ""
    return f"{row['accuracy']:.2f}{spread} ({row['seeds']})"


def merge_from(other: Path, out: Path) -> None:
    """Add the samples of the calibration files in ``other`` (another process's seeds) to those in ``out``:
    a (length, seed) pair already in ``out`` is kept; each file's results are summarized again."""
    for path in sorted(other.glob("calibrate-*.json")):
        theirs = json.loads(path.read_text())
        mine_path = out / path.name
        mine = json.loads(mine_path.read_text()) if mine_path.exists() else theirs | {"samples": []}
        have = {(s["length"], s["seed"]) for s in mine["samples"]}
        mine["samples"] += [s for s in theirs["samples"] if (s["length"], s["seed"]) not in have]
        seconds = {r["length"]: r["seconds"] for r in mine.get("results", [])}
        for r in theirs.get("results", []):
            seconds[r["length"]] = seconds.get(r["length"], 0.0) + r["seconds"]
        lengths = sorted({s["length"] for s in mine["samples"]})
        mine["results"] = summarize(mine["samples"], lengths, seconds)
        mine_path.write_text(json.dumps(mine, indent=1))


def markdown_table(folder: Path, tasks: list[str]) -> str:
    """docs/tasks.md's table: exact's mean score (seeds) per task and length, and whether it is >= ABLE."""
    from kvlab.tasks.exact_accuracy import ABLE

    rows, lengths, per = [], [], {}
    for task in tasks:
        path = folder / f"calibrate-{task}.json"
        if path.exists():
            data = json.loads(path.read_text())
            seen = sorted({s["length"] for s in data["samples"]})
            per[task] = {r["length"]: r for r in summarize(data["samples"], seen)}  # intervals from the samples
            lengths += [n for n in per[task] if n not in lengths]
    lengths.sort()
    rows.append("| task | " + " | ".join(f"{n} tokens" for n in lengths) + " | exact can do it (mean >= 0.8) at |")
    rows.append("| --- " * (len(lengths) + 2) + "|")
    for task, res in per.items():
        cells = [_cell(res[n]) if n in res else "—" for n in lengths]
        able = [str(n) for n in lengths if n in res and res[n]["accuracy"] >= ABLE]
        rows.append(f"| `{task}` | " + " | ".join(cells) + f" | {', '.join(able) or 'none'} |")
    literal = {t: {n: round(r["accuracy"], 3) for n, r in res.items()} for t, res in per.items()}
    return "\n".join(rows) + "\n\nkvlab.tasks.exact_accuracy entry:\n" + json.dumps(literal)


if __name__ == "__main__":
    raise SystemExit(main())
