"""Compression time vs prefill time at several prompt lengths (goal: each method at most 10% of the prefill).

Per prompt length: one exact prefill of CPython's reference manual cut to that many tokens, with the
query window and accumulated attention the methods ask for, then each method's ``plan`` + ``compress``
on it, timed separately (the best of ``--repeats``). Prints a table and writes JSON.

    python -m bench.compress [--methods all|qjl,subgen,...] [--tokens 2000,4000] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.compare_lockstep import emit, long_prompt
from kvlab.budgets import Budget
from kvlab.compressors import get
from kvlab.compressors.registry import names
from kvlab.engine import Engine
from kvlab.models import load_model


def measure(engine: Engine, lm, methods: list[str], budget: Budget, tokens: int, repeats: int) -> dict:
    """One prefill of ``tokens`` prompt tokens and each method's plan + compress on it (best of ``repeats``)."""
    ids = long_prompt(lm, tokens)
    comps = {m: get(m)(lm.info, budget, {}, seed=0) for m in methods}
    for c in comps.values():
        c.plan(len(ids))
    window = max(c.query_window() for c in comps.values())
    acc = any(c.needs_acc_attn for c in comps.values())
    t0 = time.perf_counter()
    state, _ = engine.prefill(ids, window, acc)
    prefill_s = time.perf_counter() - t0
    rows = {}
    exact_bytes = state.keys.numel() * 2 * state.keys.element_size()
    for name in methods:
        best = float("inf")
        for _ in range(repeats):
            comp = get(name)(lm.info, budget, {}, seed=0)
            t0 = time.perf_counter()
            comp.plan(len(ids))
            comp.compress(state)
            best = min(best, time.perf_counter() - t0)
        rows[name] = {
            "compress_s": round(best, 3),
            "of_prefill": round(best / prefill_s, 4),
            "bytes_fraction": round(comp.nbytes() / exact_bytes, 4),
        }
        print(f"  {len(ids):5d} {name:20s} {best:7.3f} s  {100 * best / prefill_s:5.1f}% of prefill", flush=True)
    return {"prompt_tokens": len(ids), "query_window": window, "prefill_s": round(prefill_s, 2), "methods": rows}


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
    engine.prefill(long_prompt(lm, 64))  # warm up
    runs = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        run = measure(engine, lm, methods, budget, tokens, args.repeats)
        print(f"prompt {run['prompt_tokens']} tokens, prefill {run['prefill_s']:.2f} s (window {run['query_window']})")
        runs.append(run)
    worst = {r["prompt_tokens"]: max(r["methods"].items(), key=lambda kv: kv[1]["of_prefill"]) for r in runs}
    for n, (name, r) in worst.items():
        print(f"  at {n} tokens the slowest is {name}: {100 * r['of_prefill']:.1f}% of the prefill")
    emit({"budget": args.budget, "threads": args.threads, "runs": runs}, args.json)


if __name__ == "__main__":
    main()
