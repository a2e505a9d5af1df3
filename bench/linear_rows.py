"""The model's decode forward at 1 and at a few rows, with F.linear as MKL runs it and rerouted.

Why ``kvlab/engine/few_rows.py`` exists: a lockstep step runs the model on one token per run, and on
the CPU MKL's kernel for x @ W^T with a few rows is much slower than its kernel for W @ x^T. This
times the embedded model's one-token forward (no cache, so only the linears and the small ops
count) at each row count, plain and under ``few_row_linears``, alternating ``--repeats`` times,
and reports each one's median in ms.

    python -m bench.linear_rows [--rows 1,2,5,8,10] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from bench.compare_lockstep import emit
from kvlab.engine.few_rows import few_row_linears
from kvlab.engine.loader import load_model


def forward_ms(model, ids: torch.Tensor, rerouted: bool, n: int = 10) -> float:
    ctx = few_row_linears(len(ids), "cpu") if rerouted else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        model(input_ids=ids, use_cache=False)  # warm
        t0 = time.perf_counter()
        for _ in range(n):
            model(input_ids=ids, use_cache=False)
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,5,8,10")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("embedded").model
    out = {"threads": args.threads, "forward_ms": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        ids = torch.randint(0, 1000, (rows, 1), generator=torch.Generator().manual_seed(rows))
        plain, rerouted = [], []
        for _ in range(args.repeats):
            plain.append(forward_ms(model, ids, False))
            rerouted.append(forward_ms(model, ids, True))
        out["forward_ms"][rows] = {
            "plain": round(statistics.median(plain), 1),
            "rerouted": round(statistics.median(rerouted), 1),
        }
    emit(out, args.json)


if __name__ == "__main__":
    main()
