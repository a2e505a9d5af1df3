"""Probes on vs off: what the costly measurements add to a lockstep comparison.

The setup of bench/compare_lockstep.py: exact + 4 methods on a ~1.9k-token
prompt from CPython's reference manual, 32 new tokens, 2 CPU threads. Runs the comparison without
probes and with ``MetricsProbe`` (shadow-cache attention error at every layer and step,
teacher-forced KL / agreement / perplexity, attention maps), alternating ``--repeats`` times, and
reports the median ratio. Goal: probes on <= 1.6x probes off.

    python -m bench.probes [--methods exact,qjl,subgen,balancekv,scissorhands] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.compare_lockstep import add_setup_args, emit, setup, warm_up
from kvlab.measure.metrics import MetricsProbe, add_text_metrics


def timed(engine, ids, specs, gen, probes: bool):
    t0 = time.perf_counter()
    res = engine.compare(ids, specs, gen, probes=[MetricsProbe()] if probes else [])
    dt = time.perf_counter() - t0
    add_text_metrics(res)
    return dt, res


def main() -> None:
    ap = argparse.ArgumentParser()
    add_setup_args(ap)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    lm, engine, specs, ids, gen = setup(args)
    warm_up(engine, ids, specs, probes=[MetricsProbe()])

    off, on, res = [], [], None
    for _ in range(args.repeats):
        off.append(timed(engine, ids, specs, gen, False)[0])
        dt, res = timed(engine, ids, specs, gen, True)
        on.append(dt)
    out = {
        "prompt_tokens": len(ids),
        "new_tokens": args.new,
        "threads": args.threads,
        "methods": [s.label for s in specs],
        "probes_off_s": [round(x, 2) for x in off],
        "probes_on_s": [round(x, 2) for x in on],
        "ratio": round(statistics.median(on) / statistics.median(off), 3),
        "metrics": {
            r.label: {
                k: r.metrics.get(k)
                for k in (
                    "attn_rel_error_mean",
                    "kl_mean",
                    "top1_agreement",
                    "perplexity",
                    "first_divergence",
                    "text_similarity",
                )
            }
            for r in res.runs
        },
        "result_json_bytes": len(res.dumps(indent=None)),
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()
