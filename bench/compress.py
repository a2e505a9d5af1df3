"""Compression time vs prefill time at several prompt lengths (goal: each method at most 10% of the prefill).

Per prompt length (CPython's reference manual cut to that many tokens): a plain exact prefill (the
reference), then one with the query window and accumulated attention the methods ask for, then the
one a comparison runs (the same plus the methods' window observers, which count what a method needs
from the attention of the last queries while the prefill computes it: Scissorhands' records); the
captures' extra costs are reported apart. Then each method's ``plan`` + ``compress`` on the last,
timed separately (the best of ``--repeats``; the first uses what the prefill observed for it).
Both wall-clock and process CPU time are recorded: on a shared machine the CPU time of a
one-thread run is the steadier figure. Prints a table and writes JSON.

    python -m bench.compress [--methods all|qjl,subgen,...] [--tokens 2000,4000] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.compare_lockstep import emit, long_prompt
from kvlab.core.budgets import Budget
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model
from kvlab.engine.prefill import prefill, prefill_for
from kvlab.methods import PrefillNeeds, budget_search, get
from kvlab.methods.registry import names


def measure(engine: Engine, lm, methods: list[str], budget: Budget, tokens: int, repeats: int) -> dict:
    """One prefill of ``tokens`` prompt tokens and each method's plan + compress on it (best of ``repeats``)."""
    ids = long_prompt(lm, tokens)
    comps = {m: get(m)(lm.info, budget, {}, seed=0) for m in methods}
    for c in comps.values():
        budget_search.planned(c, len(ids))
    needs = [c.prefill_needs(len(ids)) for c in comps.values()]
    window = max(x.query_window for x in needs)
    acc = any(x.acc_attn for x in needs)
    t0, c0 = time.perf_counter(), time.process_time()
    prefill(lm, ids)
    prefill_s, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    prefill(lm, ids, PrefillNeeds(query_window=window, acc_attn=acc))
    capture_s, capture_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    state, _, _ = prefill_for(lm, ids, list(comps.values()))  # as a comparison does: observers included
    observed_s, observed_cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = {}
    exact_bytes = state.keys.numel() * 2 * state.keys.element_size()
    for name in methods:
        best, best_cpu = float("inf"), float("inf")
        for i in range(repeats):
            # the first repeat compresses with what the prefill observed for it; later ones recompute
            comp = comps[name] if i == 0 else get(name)(lm.info, budget, {}, seed=0)
            t0, c0 = time.perf_counter(), time.process_time()
            budget_search.planned(comp, len(ids))
            comp.compress(state)
            best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
        rows[name] = {
            "compress_s": round(best, 3),
            "compress_cpu_s": round(best_cpu, 3),
            "of_prefill": round(best / prefill_s, 4),
            "of_prefill_cpu": round(best_cpu / prefill_cpu, 4),
            "bytes_fraction": round(comp.nbytes() / exact_bytes, 4),
        }
        print(
            f"  {len(ids):5d} {name:20s} {best:7.3f} s ({100 * best / prefill_s:5.1f}%)  cpu {best_cpu:7.3f} s"
            f" ({100 * best_cpu / prefill_cpu:5.1f}% of the prefill's)",
            flush=True,
        )
    return {
        "prompt_tokens": len(ids),
        "query_window": window,
        "prefill_s": round(prefill_s, 2),
        "prefill_cpu_s": round(prefill_cpu, 2),
        "capture_prefill_s": round(capture_s, 2),
        "capture_prefill_cpu_s": round(capture_cpu, 2),
        "observed_prefill_s": round(observed_s, 2),
        "observed_prefill_cpu_s": round(observed_cpu, 2),
        "methods": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="all", help="comma-separated, or 'all' registered methods")
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--tokens", default="2000,4000", help="comma-separated prompt lengths")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("embedded")
    engine = Engine(lm)
    methods = names() if args.methods == "all" else args.methods.split(",")
    budget = Budget.parse(args.budget)
    prefill(lm, long_prompt(lm, 64))  # warm up
    runs = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        run = measure(engine, lm, methods, budget, tokens, args.repeats)
        print(
            f"prompt {run['prompt_tokens']} tokens: prefill {run['prefill_s']:.2f} s"
            f" (cpu {run['prefill_cpu_s']:.2f} s);"
            f" with window {run['query_window']} + accumulated attention {run['capture_prefill_s']:.2f} s"
            f" (cpu {run['capture_prefill_cpu_s']:.2f} s); the same with the methods' observers"
            f" {run['observed_prefill_s']:.2f} s (cpu {run['observed_prefill_cpu_s']:.2f} s)"
        )
        runs.append(run)
    for r in runs:
        name, m = max(r["methods"].items(), key=lambda kv: kv[1]["of_prefill_cpu"])
        print(f"  at {r['prompt_tokens']} tokens the slowest is {name}: {100 * m['of_prefill_cpu']:.1f}% (cpu)")
    load = os.getloadavg()[0]
    emit({"budget": args.budget, "threads": args.threads, "load_average_end": round(load, 1), "runs": runs}, args.json)


if __name__ == "__main__":
    main()
