"""What the retention map costs: the kept-position snapshots of a 4k-token prompt with 10 runs.

One comparison on a ~4,000-token prompt of CPython's reference manual (the dashboard's limit), 10 runs
(exact and nine methods at budget 0.25, five of which change their cache while decoding), 32 new tokens,
with the retention snapshots the dashboard takes (``RetentionSettings()``: after compression, up to 8 decode
steps for the methods that change while decoding, the end). Reported: the snapshots' size as stored in the
result (the JSON of ``extras["retention"]``, per run and in all: what the page holds per comparison while
it runs and after), the masks' size unpacked (2 bits per position, layer and KV head, per snapshot), the
time the probe took (its ``snapshot`` calls, timed apart) and the time to draw the maps at one step.

    python -m bench.retention [--tokens 4000] [--new 32]

Writes ``bench/results/retention.json`` with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = "exact,scissorhands,streaming,snapkv,h2o,kivi,qjl,subgen,balancekv-stream,decoding-knorm"  # 10 runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "retention.json"))
    args = ap.parse_args(argv)

    from pydoc_data.topics import topics

    from kvlab.engine.loader import load_model
    from kvlab.engine.specs import GenerationSettings
    from kvlab.measure import retention
    from kvlab.report import retention_map
    from kvlab.run import Comparison, compare

    lm = load_model("embedded")
    text = "\n\n".join(topics[k] for k in sorted(topics))
    lo, hi = 1000, len(text)
    while hi - lo > 200:  # the longest stretch under the token count
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(lm.encode(text[:mid])) < args.tokens else (lo, mid)
    prompt = text[:lo]

    spent = [0.0]
    taken = retention.snapshot

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return taken(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    retention.snapshot = timed  # the probe's snapshots, timed apart
    t0 = time.perf_counter()
    result = compare(
        lm,
        Comparison(prompt, METHODS.split(","), ["0.25"], settings=GenerationSettings(max_new_tokens=args.new),
                   retention=retention.RetentionSettings()),
    )  # fmt: skip
    compare_s = time.perf_counter() - t0
    runs = []
    for r in result.runs:
        ret = r.extras.get("retention") or {}
        shots = ret.get("snapshots", [])
        unpacked = sum(2 * ret["layers"] * ret["kv_heads"] * s["seen"] / 8 for s in shots)
        runs.append(
            {
                "run": r.label,
                "snapshots": len(shots),
                "stored_bytes": len(json.dumps(ret)),
                "unpacked_bytes": int(unpacked),
                "changes_while_decoding": bool(ret.get("streaming")),
            }
        )
    t1 = time.perf_counter()
    retention_map.figure(result, step=retention_map.last_step(result) // 2)
    draw_s = time.perf_counter() - t1
    out = {
        "command": "python -m bench.retention " + " ".join(argv or sys.argv[1:]),
        "prompt_tokens": result.prompt_tokens,
        "new_tokens": args.new,
        "runs": runs,
        "stored_bytes": sum(r["stored_bytes"] for r in runs),
        "unpacked_bytes": sum(r["unpacked_bytes"] for r in runs),
        "snapshot_s": round(spent[0], 3),
        "compare_s": round(compare_s, 1),
        "draw_s": round(draw_s, 2),
        "machine": {
            "cpus": os.cpu_count(),
            "threads": int(__import__("torch").get_num_threads()),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    for r in runs:
        print(f"| {r['run']} | {r['snapshots']} | {r['stored_bytes']:,} | {r['unpacked_bytes']:,} |")


if __name__ == "__main__":
    main()
