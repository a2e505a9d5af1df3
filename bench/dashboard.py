"""Benchmark: the dashboard's default comparison, through the same callback the page runs.

Default comparison: exact + the papers' methods at one budget (0.25) on the ~1k-token document
preset, 32 new tokens, on the embedded model. Reports the time until the first results appear on
the page (cards with bytes, after prefill + compression) and until the comparison completes,
with the measurements (attention error, KL, maps) on and off. Numbers, not pass/fail.

    python -m bench.dashboard [--threads 2] [--new 32] [--no-measure] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run_once(dash, prompt: str, papers: list[str], budget: str, new: int, measure: bool, task=None) -> dict:
    t0 = time.perf_counter()
    first = None
    yields = 0
    status, data = "", None
    for out in dash.compare(
        "embedded", prompt, papers, [], budget, new, 0, None, measure, None, 0, task, progress=lambda *a, **k: None
    ):
        yields += 1
        status = out[0]
        if isinstance(out[2], dict):
            data = out[2]
        if first is None and "kv-card" in str(out[1]):
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {
        "measure": measure,
        "first_results_s": round(first or total, 2),
        "complete_s": round(total, 2),
        "yields": yields,
        "status": status.split("kv-progress-msg'>")[-1].removesuffix("</div>"),
        "prefill_s": round((data or {}).get("timings", {}).get("prefill_s", 0.0), 2),
        "compress_s": {r["method"]: round(r["timings"]["compress_s"], 2) for r in (data or {}).get("runs", [])},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("KVLAB_THREADS", 2)))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--no-measure", action="store_true", help="only the run without measurements")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from kvlab.models import load_model
    from kvlab.ui import DEFAULT_PRESET, Dashboard, default_methods, presets

    t0 = time.perf_counter()
    lm = load_model("embedded")
    load_s = time.perf_counter() - t0
    dash = Dashboard(lm)
    texts, dash.tasks = presets(lm)
    prompt = texts[DEFAULT_PRESET]
    papers, _ = default_methods()
    n_prompt = len(lm.encode(prompt))
    rows = []
    for measure in [False] if args.no_measure else [False, True]:
        rows.append(run_once(dash, prompt, papers, args.budget, args.new, measure, dash.task_of(DEFAULT_PRESET)))
    info = {
        "threads": args.threads,
        "prompt_tokens": n_prompt,
        "methods": ["exact", *papers],
        "budget": args.budget,
        "new_tokens": args.new,
        "load_s": round(load_s, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "runs": rows,
    }
    print(
        f"default comparison: exact + {', '.join(papers)} @ {args.budget}, {n_prompt} prompt tokens, "
        f"{args.new} new tokens, {args.threads} threads, load average {info['loadavg_1m']} on {info['cpus']} CPUs"
    )
    for r in rows:
        print(
            f"  measurements {'on ' if r['measure'] else 'off'}: first results {r['first_results_s']:6.1f} s · "
            f"complete {r['complete_s']:6.1f} s · prefill {r['prefill_s']} s · {r['status']}"
        )
        print(f"    compression s: {r['compress_s']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
