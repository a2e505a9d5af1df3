"""Compression time vs prefill time on a long prompt (goal: each at most 25% of the prefill).

One exact prefill of a ~4k-token prompt (CPython's reference manual) with the query window and
accumulated attention the methods ask for, then each method's ``plan`` + ``compress`` on it, timed
separately. Prints a table and writes JSON.

    python -m bench.compress [--methods qjl,subgen,subgen-kcenter,balancekv,scissorhands] [--tokens 4000]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.compare_lockstep import emit, long_prompt
from kvlab.budgets import Budget
from kvlab.compressors import get
from kvlab.engine import Engine
from kvlab.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="qjl,subgen,subgen-kcenter,balancekv,scissorhands")
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("embedded")
    engine = Engine(lm)
    ids = long_prompt(lm, args.tokens)
    budget = Budget.parse(args.budget)
    comps = {m: get(m)(lm.info, budget, {}, seed=0) for m in args.methods.split(",")}
    for c in comps.values():
        c.plan(len(ids))
    window = max(c.query_window() for c in comps.values())
    acc = any(c.needs_acc_attn for c in comps.values())
    engine.prefill(ids[:64])  # warm up
    t0 = time.perf_counter()
    state, _ = engine.prefill(ids, window, acc)
    prefill_s = time.perf_counter() - t0
    rows = {}
    for name, comp in comps.items():
        t0 = time.perf_counter()
        comp.compress(state)
        dt = time.perf_counter() - t0
        rows[name] = {
            "compress_s": round(dt, 3),
            "of_prefill": round(dt / prefill_s, 3),
            "bytes_fraction": round(comp.nbytes() / (state.keys.numel() * 2 * state.keys.element_size()), 4),
        }
    out = {"prompt_tokens": len(ids), "query_window": window, "prefill_s": round(prefill_s, 2), "methods": rows}
    print(f"prompt {len(ids)} tokens, prefill {prefill_s:.2f} s (query window {window})")
    for name, r in rows.items():
        print(
            f"  {name:16s} {r['compress_s']:7.3f} s  {100 * r['of_prefill']:5.1f}% of prefill"
            f"  bytes {r['bytes_fraction']:.3f} of exact"
        )
    if args.json:
        emit(out, args.json)


if __name__ == "__main__":
    main()
