"""Each paper's operating point (``METHOD@paper``) against kvlab's default, one setting at a time.

On one prose prompt (CPython's manual, no chat template) at one budget, every variant runs in one
lockstep comparison with the probes on: teacher-forced KL and top-1 agreement along the exact run,
attention relative error, and the peak / mean bytes held (fractions of the exact cache's). Writes
``bench/results/presets.json`` and prints a Markdown table per method; the method pages quote them.

    python -m bench.presets [--length 768] [--new 16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

VARIANTS = {
    "balancekv": (
        "0.25",
        [
            ("balancekv", {}),
            ("balancekv@paper", {}),
            ("balancekv@paper", {"step": "algorithm2"}),
            ("balancekv", {"T": 2}),
            ("balancekv", {"step": "algorithm2"}),
        ],
    ),
    "scissorhands": (
        "0.25",
        [
            ("scissorhands", {}),
            ("scissorhands@paper", {}),
            ("scissorhands@paper", {"layer_ramp": 0.0}),
            ("scissorhands@paper", {"prompt": "window"}),
        ],
    ),
    "subgen": ("0.25", [("subgen", {}), ("subgen@theorem", {}), ("subgen@theorem", {"delta": 12.0})]),
    "qjl": ("0.5", [("qjl", {}), ("qjl@paper", {}), ("qjl@paper", {"n_outliers": 0})]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=768)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    from kvlab.core.budgets import Budget
    from kvlab.engine.specs import RunSpec
    from kvlab.measure.metrics import MetricsProbe, ProbeSettings
    from kvlab.reproduce.setup import ReproductionSetup

    ctx = ReproductionSetup(quick=False)
    ids = ctx.prose(args.length)
    out = {"prompt_tokens": len(ids), "new_tokens": args.new, "methods": {}}
    for method, (budget, variants) in VARIANTS.items():
        if args.only and method not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        runs = [RunSpec("exact")] + [RunSpec(m, Budget.parse(budget), p) for m, p in variants]
        probe = MetricsProbe(ProbeSettings(attn_error=True, fidelity=True, maps=False))
        res = ctx.compare(ids, runs, args.new, [probe])
        rows = []
        for (m, p), r in zip(variants, res.runs[1:]):
            fr = [b / e for b, e in zip(r.kv_bytes_per_step, r.exact_kv_bytes_per_step) if e]
            rows.append(
                {
                    "method": m,
                    "params": p,
                    "error": r.error,
                    "kl": r.metrics.get("kl_mean"),
                    "top1": r.metrics.get("top1_agreement"),
                    "attn_error": r.metrics.get("attn_rel_error_mean"),
                    "peak": max(fr) if fr else None,
                    "mean": sum(fr) / len(fr) if fr else None,
                    "knobs": {k: v for k, v in r.params.items() if not isinstance(v, list)},
                }
            )
        out["methods"][method] = {"budget": budget, "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
        print(f"\n{method} at budget {budget} ({len(ids)} tokens, {args.new} new; {time.perf_counter() - t0:.0f} s)")
        print("| run | KL | top-1 | attention error | peak / mean bytes |\n|---|---|---|---|---|")
        for row in rows:
            p = " ".join(f"{k}={v}" for k, v in row["params"].items())
            if row["error"]:
                print(f"| `{row['method']}` {p} | refused: {row['error']} | | | |")
                continue
            print(
                f"| `{row['method']}` {p} | {row['kl']:.3f} | {row['top1']:.2f} | {row['attn_error']:.3f} | "
                f"{row['peak']:.3f} / {row['mean']:.3f} |",
                flush=True,
            )
    path = Path(__file__).parent / "results" / "presets.json"
    path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
