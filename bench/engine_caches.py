"""The serving engines' KV-cache flags beside the papers' quantizers, at one budget, on one prose prompt.

vLLM's four TurboQuant presets and llama.cpp's q8_0 / q5_0 / q4_0 caches (with and without its Hadamard
rotation) run in one lockstep comparison with exact, ``fp8``, ``kivi``, ``turboquant`` and ``polarquant``, the
probes on (teacher-forced KL and top-1 agreement along exact's tokens, attention relative error). For each
flag the bytes its cache held after the prefill, per token, layer and KV head, are set beside the layout's
formula (docs/methods/engine-caches.md): llama.cpp (d / 32) x (key block bytes + value block bytes); vLLM
ceil(d kbits / 8) + 2 (or d for e4m3 keys) + ceil(d vbits / 8) + 4 on the coded layers, 4 d on its 2 + 2
16-bit boundary layers (per token held: a sliding-window layer holds its window). Writes
``bench/results/engine_caches[-MODEL].json`` and prints a Markdown table.

    python -m bench.engine_caches [--model embedded] [--length 768] [--new 16] [--budget 0.6]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

PAPERS = ["fp8", "kivi", "turboquant", "polarquant"]
BLOCK_BYTES = {"q8_0": 34, "q5_0": 22, "q4_0": 18}


def layer_bytes(flag, d: int, n_layers: int) -> list[float]:
    """The flag's bytes per token and KV head in each layer, from the docs' formula alone."""
    s = flag.settings
    if flag.engine == "llama.cpp":
        kind = {8: "q8_0", 5: "q5_0", 4: "q4_0"}
        return [d / 32 * (BLOCK_BYTES[kind[s["kbits"]]] + BLOCK_BYTES[kind[s["vbits"]]])] * n_layers
    key = d if s["kbits"] == 8 else math.ceil(d * s["kbits"] / 8) + 2
    slot = key + math.ceil(d * s["vbits"] / 8) + 4
    edge = min(2, n_layers // 2)
    return [4 * d if i < edge or i >= n_layers - edge else slot for i in range(n_layers)]


def formula(flag, info, n: int) -> float:
    """Bytes per token held, layer and KV head (mean over the tokens each layer holds: a sliding-window layer
    holds its window) from the formula."""
    per = layer_bytes(flag, info.head_dim, info.n_layers)
    held = [sem.held(n) for sem in info.semantics.layers]
    return sum(b * h for b, h in zip(per, held)) / sum(held)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--length", type=int, default=768)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--budget", default="0.6")
    args = ap.parse_args()
    from kvlab.core.budgets import Budget
    from kvlab.engine.specs import RunSpec
    from kvlab.measure.metrics import MetricsProbe, ProbeSettings
    from kvlab.methods.engine_flags import FLAGS
    from kvlab.reproduce.setup import ReproductionSetup

    ctx = ReproductionSetup(quick=False, model=args.model)
    info = ctx.info
    ids = ctx.prose(args.length)
    names = PAPERS + [f.name for f in FLAGS]
    runs = [RunSpec("exact")] + [RunSpec(m, Budget.parse(args.budget)) for m in names]
    t0 = time.perf_counter()
    probe = MetricsProbe(ProbeSettings(attn_error=True, fidelity=True, maps=False))
    res = ctx.compare(ids, runs, args.new, [probe])
    flags = {f.name: f for f in FLAGS}
    per_token = sum(sem.held(len(ids)) for sem in info.semantics.layers) * info.n_kv_heads  # tokens held
    rows = []
    for name, r in zip(names, res.runs[1:]):
        fr = [b / e for b, e in zip(r.kv_bytes_per_step, r.exact_kv_bytes_per_step) if e]
        flag = flags.get(name)
        rows.append(
            {
                "method": name,
                "flag": None if flag is None else f"{flag.engine}: {flag.flag}",
                "error": r.error,
                "kl": r.metrics.get("kl_mean"),
                "top1": r.metrics.get("top1_agreement"),
                "attn_error": r.metrics.get("attn_rel_error_mean"),
                "peak": max(fr) if fr else None,
                "mean": sum(fr) / len(fr) if fr else None,
                "bytes_per_token_head": r.kv_bytes_per_step[0] / per_token if r.kv_bytes_per_step else None,
                "formula": None if flag is None else formula(flag, info, len(ids)),
                "knobs": {k: v for k, v in r.params.items() if not isinstance(v, (list, dict))},
            }
        )
    seconds = time.perf_counter() - t0
    out = {
        "model": info.id,
        "prompt_tokens": len(ids),
        "new_tokens": args.new,
        "budget": args.budget,
        "seconds": round(seconds, 1),
        "rows": rows,
    }
    suffix = "" if args.model == "embedded" else f"-{args.model}"
    path = Path(__file__).parent / "results" / f"engine_caches{suffix}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"{info.id}, budget {args.budget}, {len(ids)} prompt tokens, {args.new} new ({seconds:.0f} s)")
    print("| run | bytes per token, layer and head (formula) | peak / mean | attention error | KL | top-1 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if row["error"]:
            print(f"| `{row['method']}` | refused: {row['error']} | | | | |")
            continue
        f = "" if row["formula"] is None else f" ({row['formula']:.1f})"
        print(
            f"| `{row['method']}` | {row['bytes_per_token_head']:.1f}{f} | {row['peak']:.3f} / {row['mean']:.3f} | "
            f"{row['attn_error']:.3f} | {row['kl']:.4f} | {row['top1']:.2f} |"
        )


if __name__ == "__main__":
    main()
