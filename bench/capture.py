"""Where the prefill's capture overhead comes from: the comparison's prefill taken apart.

At one prompt length (``--tokens``; CPython's reference manual as in the other benches), the default
comparison's methods (``--methods`` at ``--budget``) ask the prefill for the last queries (a window),
the accumulated attention, and window observers (the attention of the last queries handed to the
methods as it is computed). Timed, each in the same process after one warm-up prefill:

* plain: the exact prefill, nothing captured;
* window: only the last queries copied out (``window`` = the largest any method asks for);
* acc: only the accumulated attention (``kvlab.engine.attention.accumulated_attention`` per layer);
* window + acc: both;
* comparison: what a comparison's ``prefill.prefill_for`` runs (window, accumulated attention and
  observers);
* accumulated_attention alone, on the real queries and keys of every layer (no model).

CPU seconds of the process (``time.process_time``) and wall seconds; the CPU seconds are the steadier
number on a shared machine.

    python -m bench.capture --tokens 2000 --json bench/results/capture.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.scaling import default_setup, machine
from kvlab.engine.planning import make_compressors

METHODS = "exact,qjl,subgen-kcenter,balancekv,scissorhands"


def timed(fn) -> dict:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return {"cpu_s": round(time.process_time() - c0, 3), "wall_s": round(time.perf_counter() - w0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--budget", default="0.5")
    ap.add_argument("--new", type=int, default=32, help="decode steps the methods plan for")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from kvlab.engine.attention import accumulated_attention
    from kvlab.engine.prefill import MergedNeeds, prefill, prefill_for
    from kvlab.methods.handover import PrefillNeeds

    start = machine()
    engine, specs, ids = default_setup(args, args.tokens)
    fresh = lambda: make_compressors(engine.info, specs, len(ids), 0, args.new)[0]  # noqa: E731
    comps = fresh()
    needs = [c.prefill_needs(len(ids)) for c in comps]
    merged = MergedNeeds.of(needs)
    window, observers = merged.query_window, merged.observers
    lm = engine.lm
    with torch.inference_mode():
        prefill(lm, ids)  # warm-up
        rows = {
            "plain": timed(lambda: prefill(lm, ids)),
            "window": timed(lambda: prefill(lm, ids, PrefillNeeds(query_window=window))),
            "acc": timed(lambda: prefill(lm, ids, PrefillNeeds(acc_attn=True))),
            "window + acc": timed(lambda: prefill(lm, ids, PrefillNeeds(query_window=window, acc_attn=True))),
            "comparison": timed(lambda: prefill_for(lm, ids, fresh())),
        }
        state, _ = prefill(lm, ids, PrefillNeeds(query_window=len(ids)))  # every query: accumulated_attention alone
        q, k = state.queries, state.keys
        rows["accumulated_attention alone (all layers)"] = timed(
            lambda: [accumulated_attention(q[j], k[j], state.scaling) for j in range(q.shape[0])]
        )
    plain = rows["plain"]["cpu_s"]
    for r in rows.values():
        r["x_plain_cpu"] = round(r["cpu_s"] / plain, 3)
    out = {
        "machine": {**start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "prompt_tokens": len(ids),
        "threads": args.threads,
        "window": window,
        "observers": [type(o).__name__ for o in observers],
        "observer_rows": [o.rows for o in observers],
        "acc_attn_for": [s.method for s, x in zip(specs, needs) if x.acc_attn],
        "window_for": {s.method: x.query_window for s, x in zip(specs, needs) if x.query_window},
        "rows": rows,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
