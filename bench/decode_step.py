"""A lockstep decode step against the model's forward alone, at the same number of rows.

Runs the lockstep setup of ``compare_lockstep`` (exact + 4 methods at budget 0.25 on a ~1.9k-token
prompt) and times, alternating ``--repeats`` times in one process: the 5-row forward alone
(``linear_rows.forward_ms``, rerouted linears, no cache), the decode step with the dense rows'
attention in one padded call per layer (``bench/padded_dense.py``; the rows of a class with
``attend_many`` in one call each), and the decode step with the per-row attention (``comp.attend``
per row and layer). A step is ``decode_s / steps`` of a run that decoded every step
(forward, appends, attention, the token pick and the byte count). Reported: medians and best times
in ms and the steps' ratios to the forward measured in the same run, with the load average before
and after; then one step's attention alone (all layers and rows, random queries on the compressed
prompt), batched and per row, best of 5 x ``--repeats`` alternating runs.

    python -m bench.decode_step [--methods ...] [--repeats 3] [--new 16] [--json out.json]
    python -m bench.decode_step --attention-only [--methods ...]   # each method's attention alone, best ms
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.compare_lockstep import add_setup_args, emit, setup, warm_up
from bench.linear_rows import forward_ms
from bench.padded_dense import attend_padded, paths
from kvlab.engine.comparison import Engine
from kvlab.engine.planning import make_compressors
from kvlab.engine.prefill import prefill_for
from kvlab.engine.specs import GenerationSettings


def step_ms(engine, ids, specs, new: int, batched: bool) -> float:
    """Mean ms of one lockstep decode step (up to ``new`` - 1 steps after the prefill's first token)."""
    engine = Engine(engine.lm, engine.time_limit_s, paths("padded" if batched else "per_row"))
    res = engine.compare(ids, specs, GenerationSettings(max_new_tokens=new))
    longest = max(res.runs, key=lambda r: len(r.token_ids))  # decoded every step (others may stop at EOS)
    return longest.timings.decode_s / max(1, len(longest.token_ids) - 1) * 1e3


def attention_ms(engine, ids, specs, repeats: int) -> dict[str, float]:
    """One decode step's attention alone (every layer, every row), batched and per row, best of ``repeats``
    (alternating): the methods compressed from the prompt's prefill, random queries at the model's shapes."""
    info = engine.info
    comps, _ = make_compressors(engine.info, specs, len(ids), 0, 1)
    state, _, _ = prefill_for(engine.lm, ids, comps)
    for c in comps:
        c.compress(state)
    del state
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(comps), info.n_heads, 1, info.head_dim, generator=g)
    for layer in range(info.n_layers):  # the contract: a new token before its query
        k, v = (torch.randn(info.n_kv_heads, 1, info.head_dim, generator=g) for _ in range(2))
        for c in comps:
            c.append(layer, k, v, len(ids))

    def timed(fn) -> float:
        t0 = time.perf_counter()
        for layer in range(info.n_layers):
            fn(layer)
        return (time.perf_counter() - t0) * 1e3

    batched, per_row = [], []
    alone: dict[str, list[float]] = {s.label: [] for s in specs}
    with torch.inference_mode():
        for _ in range(repeats):
            batched.append(timed(lambda layer: attend_padded(comps, layer, q)))
            per_row.append(timed(lambda layer: [c.attend(layer, q[i]) for i, c in enumerate(comps)]))
            for i, (s, c) in enumerate(zip(specs, comps)):
                alone[s.label].append(timed(lambda layer, i=i, c=c: c.attend(layer, q[i])))
    return {"batched": min(batched), "per_row": min(per_row), "per_method": {k: min(v) for k, v in alone.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_setup_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--attention-only", action="store_true", help="only one step's attention through each method alone, best ms"
    )
    ap.set_defaults(new=16, threads=1)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    lm, engine, specs, ids, _ = setup(args)
    warm_up(engine, ids, specs)
    attn = attention_ms(engine, ids, specs, 5 * args.repeats)
    print("attention alone, best ms:", attn, flush=True)
    if args.attention_only:
        per_method = {k: round(v, 1) for k, v in attn.pop("per_method").items()}
        load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        out = {"prompt_tokens": len(ids), "budget": args.budget, "threads": args.threads, "load_average": load}
        emit({**out, "attention_per_method_best_ms": per_method}, args.json)
        return
    rows = torch.randint(0, 1000, (len(specs), 1), generator=torch.Generator().manual_seed(0))
    fwd, batched, per_row = [], [], []
    for _ in range(args.repeats):
        fwd.append(forward_ms(lm.model, rows, True))
        batched.append(step_ms(engine, ids, specs, args.new, True))
        per_row.append(step_ms(engine, ids, specs, args.new, False))
        print(f"forward {fwd[-1]:.1f} ms, step batched {batched[-1]:.1f} ms, per row {per_row[-1]:.1f} ms", flush=True)
    runs = {"forward": fwd, "batched": batched, "per_row": per_row}
    med = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: min(v) for k, v in runs.items()}  # timeit-style: noise only adds time
    out = {
        "prompt_tokens": len(ids),
        "rows": len(specs),
        "methods": [s.label for s in specs],
        "threads": args.threads,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "forward_ms": [round(x, 1) for x in fwd],
        "step_batched_ms": [round(x, 1) for x in batched],
        "step_per_row_ms": [round(x, 1) for x in per_row],
        "median_ms": {k: round(v, 1) for k, v in med.items()},
        "best_ms": {k: round(v, 1) for k, v in best.items()},
        "ratio_batched_to_forward": {
            "median": round(med["batched"] / med["forward"], 2),
            "best": round(best["batched"] / best["forward"], 2),
        },
        "ratio_per_row_to_forward": {
            "median": round(med["per_row"] / med["forward"], 2),
            "best": round(best["per_row"] / best["forward"], 2),
        },
        "attention_only_best_ms": {k: round(v, 1) for k, v in attn.items() if k != "per_method"},
        "attention_per_method_best_ms": {k: round(v, 1) for k, v in attn["per_method"].items()},
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()
