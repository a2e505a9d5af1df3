"""Eager vs compiled (``kernels.compiled``) per decode-step kernel, on the embedded model's shapes.

Shapes: 3 KV heads of head_dim 64 (SmolLM2-135M), m = 2 x 64 sign bits, 8 outlier channels per group
of 32 tokens, 2-bit values in groups of 32; R = query rows per KV head (3 = one row, 15 = five rows in
lockstep). For each kernel: the project's eager path (kernels.qjl / kernels.quant; float32 products),
the fused formulation run eagerly, and compiled, median of ``--reps`` calls; for QJL's split estimate
also the eager path with bfloat16 products (QJL's default on the CPU); plus compile seconds (first
process: cold cache; later processes read inductor's on-disk cache).

    PYTHONPATH=. python -m bench.fused --threads 1 --clock cpu --json bench/results/fused.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch

from kernels import compiled as C
from kernels.qjl import qjl_estimate_grouped, qjl_estimate_split_pair
from kernels.quant import dequantize_groups, quantize_groups, weighted_token_sum

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def timed(fn, reps: int, eager: bool = False) -> float:
    with C.eager() if eager else contextlib.nullcontext():
        return _timed(fn, reps)


def _timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return statistics.median(ts) * 1e3


def compiled_call(f: C.Fused, *args):
    """The compiled code itself, whether or not the warm-up found it faster (``f(...)`` would route a
    slower one to the eager function, and this column would time the eager one)."""
    with torch.no_grad():
        return (f.compiled or f.eager)(*args)


def cases(n: int, r: int) -> dict:
    hkv, d, group, n_out = 3, 64, 32, 8
    ex = C.examples(hkv=hkv, g=r // 2 if r > 1 else 1, d=d, n=n, group=group, n_out=n_out)
    sp = list(ex[C.SPLIT_PAIR.name])
    sp[0] = torch.randn(hkv, r, d)
    es = list(ex[C.ESTIMATE.name])
    es[0] = sp[0]
    v = quantize_groups(torch.randn(hkv, n, d), 2, 32, dim=-1)
    w = torch.softmax(torch.randn(hkv, r, n), -1)
    kq = quantize_groups(torch.randn(hkv, n, d), 2, 32, dim=-2)
    sh = C.shifts_for(2)
    return {
        "qjl_split_pair_estimate": (
            lambda: qjl_estimate_split_pair(*sp, group),
            lambda: C.split_pair_estimate(*sp),
            lambda: compiled_call(C.SPLIT_PAIR, *sp),
            lambda: qjl_estimate_split_pair(*sp, group, torch.bfloat16),  # QJL's default CPU products
        ),
        "qjl_estimate": (
            lambda: qjl_estimate_grouped(*es),
            lambda: C.estimate(*es),
            lambda: compiled_call(C.ESTIMATE, *es),
            None,
        ),
        "value_read": (
            lambda: weighted_token_sum(w, v),
            lambda: C.value_read(w, v.codes, v.scale, v.minimum, sh, v.group),
            lambda: compiled_call(C.VALUE_READ, w, v.codes, v.scale, v.minimum, sh, v.group),
            None,
        ),
        "kivi_dequantize_keys": (
            lambda: dequantize_groups(kq),
            lambda: C.dequantize_keys(kq.codes, kq.scale, kq.minimum, sh, kq.group),
            lambda: compiled_call(C.DEQUANTIZE_KEYS, kq.codes, kq.scale, kq.minimum, sh, kq.group),
            None,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--rows", default="3,15")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="wall: seconds; cpu: this thread's CPU seconds (steadier on a shared machine; use with --threads 1)",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    os.environ["KVLAB_COMPILE"] = "1"
    C.warm_up(background=False)
    warm_s = time.perf_counter() - t0
    rows = []
    with torch.no_grad():
        for n in map(int, args.sizes.split(",")):
            for r in map(int, args.rows.split(",")):
                for name, (ref, fused, comp, bf16) in cases(n, r).items():
                    out = {
                        "eager_ms": timed(ref, args.reps, eager=True),
                        "fused_eager_ms": timed(fused, args.reps),
                        "compiled_ms": timed(comp, args.reps),
                    }
                    if bf16 is not None:  # the eager path with bfloat16 products (a formulation, not compiled)
                        out["eager_bf16_products_ms"] = timed(bf16, args.reps, eager=True)
                    with C.eager():
                        want = ref()
                    have = comp()  # the compiled code (compiled_call)
                    if name == "kivi_dequantize_keys":
                        have = have[..., : want.shape[-2], :]
                    err = (have.float() - want.float()).abs().max().item()
                    rows.append({"kernel": name, "n": n, "rows": r, **{k: round(x, 3) for k, x in out.items()}})
                    rows[-1]["max_abs_diff"] = err
                    print(rows[-1], flush=True)
    res = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}",
        "clock": args.clock,
        "load_before": round(load0, 1),
        "load_after": round(os.getloadavg()[0], 1),
        "warm_up_s": round(warm_s, 1),
        "compile": C.status(),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
