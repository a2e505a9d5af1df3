"""A scorer at prefill only against the same scorer re-applied while decoding, on a long generation.

For each scorer (SnapKV, KNorm, Expected Attention by default), at one budget: ``NAME`` (prefill only:
its budget covers the prompt, every generated token is kept whole) against ``decoding-NAME`` (the
scorer re-applied every N decode steps, the budget capping every step's bytes), beside the exact cache,
on prompts of CPython's reference manual with 256 new tokens (greedy; the end-of-sequence token does not
stop a run, so that every run generates all of them, as long-generation benchmarks do; ``--stop-at-eos``
lets it). Reported per run and averaged
over the prompts: the peak and the mean bytes held as shares of the exact cache's peak and mean, the
peak against the budget's share of it, the teacher-forced top-1 agreement with exact and the mean
KL(exact || method) along exact's tokens, and where the free-running text first parts from exact's.

    python -m bench.decoding_long [--prompts 3] [--tokens 500] [--new 256] [--budget 0.25]

Writes ``bench/results/decoding_long.json`` with the machine and its load; prints the markdown table of
bench/README.md. One comparison per prompt (every run in one lockstep decode), about 10 minutes per
prompt on one thread of the development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCORERS = "snapkv,knorm,expected-attention"


def prompts(lm, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of about ``tokens`` tokens: consecutive stretches of CPython's reference manual."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    out, start = [], 0
    for _ in range(count):
        lo, hi = start + 200, len(text)
        while hi - lo > 100:
            mid = (lo + hi) // 2
            if len(lm.encode(text[start:mid] + "\n\nSummarize the text above.")) < tokens:
                lo = mid
            else:
                hi = mid
        out.append(lm.encode(text[start:lo] + "\n\nSummarize the text above."))
        start = lo
    return out


def without_eos(lm):
    """``lm`` with no end-of-sequence token: every run generates all its new tokens."""
    from dataclasses import fields

    from kvlab.core.model import LoadedModel

    class NoEOS(LoadedModel):
        @property
        def eos_ids(self) -> set[int]:
            return set()

    return NoEOS(**{f.name: getattr(lm, f.name) for f in fields(lm)})


def one_prompt(engine, ids: list[int], methods: list[str], budget: str, new: int) -> dict:
    from kvlab.core.budgets import Budget
    from kvlab.engine.specs import GenerationSettings, RunSpec
    from kvlab.measure.health import HealthProbe
    from kvlab.measure.metrics import MetricsProbe, ProbeSettings, add_text_metrics

    specs = [RunSpec("exact")] + [RunSpec(m, Budget.parse(budget)) for m in methods]
    probes = [HealthProbe(), MetricsProbe(ProbeSettings(attn_error=False, fidelity=True, maps=False))]
    t0 = time.perf_counter()
    result = engine.compare(ids, specs, GenerationSettings(max_new_tokens=new), probes=probes)
    add_text_metrics(result)
    share = Budget.parse(budget).fraction_of(len(ids))
    runs = {}
    for r in result.runs[1:]:
        mem = r.memory
        runs[r.method] = {
            "peak_fraction": mem["peak_fraction"],
            "mean_fraction": mem["mean_fraction"],
            "peak_over_budget": round(mem["peak_fraction"] / share, 3),
            "top1_agreement": r.metrics.get("top1_agreement"),
            "kl_mean": r.metrics.get("kl_mean"),
            "first_divergence": r.metrics.get("first_divergence"),
            "text_similarity": r.metrics.get("text_similarity"),
            "new_tokens": len(r.token_ids),
            "health": [f["flag"] for f in r.health],
            "compression_interval": r.params.get("compression_interval"),
            "queries_held": r.params.get("queries_held"),
            "bytes_per_step": r.kv_bytes_per_step,
        }
    exact = result.runs[0]
    return {
        "prompt_tokens": len(ids),
        "exact_new_tokens": len(exact.token_ids),
        "exact_bytes_per_step": exact.exact_kv_bytes_per_step,
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": runs,
    }


def summary(per_prompt: list[dict], methods: list[str]) -> dict:
    keys = ("peak_fraction", "mean_fraction", "peak_over_budget", "top1_agreement", "kl_mean", "text_similarity")
    out = {}
    for m in methods:
        rows = [p["runs"][m] for p in per_prompt]
        out[m] = {k: round(statistics.mean(r[k] for r in rows), 4) for k in keys if all(r[k] is not None for r in rows)}
        out[m]["first_divergence"] = [r["first_divergence"] for r in rows]
        out[m]["n"] = len(rows)
    return out


def table(summ: dict, scorers: list[str], budget: str) -> str:
    lines = [
        f"| method @ {budget} | peak / exact's peak | peak / budget | mean / exact's mean | top-1 agreement | "
        "KL mean (nats) | first new token off exact's (per prompt) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scorers:
        for m in (s, f"decoding-{s}"):
            r = summ[m]
            lines.append(
                f"| `{m}` | {r['peak_fraction']:.3f} | {r['peak_over_budget']:.2f}x | {r['mean_fraction']:.3f} "
                f"| {r.get('top1_agreement', float('nan')):.3f} | {r.get('kl_mean', float('nan')):.3f} "
                f"| {', '.join(str(x) for x in r['first_divergence'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scorers", default=SCORERS)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stop-at-eos", action="store_true", help="let the end-of-sequence token end a run")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "decoding_long.json"))
    args = ap.parse_args()

    import torch

    from bench.scaling import machine
    from kvlab.engine.comparison import Engine
    from kvlab.engine.loader import load_model

    torch.set_num_threads(args.threads)
    start = machine()
    lm = load_model("embedded")
    if not args.stop_at_eos:
        lm = without_eos(lm)
    engine = Engine(lm, time_limit_s=None)
    scorers = args.scorers.split(",")
    methods = [m for s in scorers for m in (s, f"decoding-{s}")]
    done: list[dict] = []
    path = Path(args.json)
    partial = path.with_suffix(".partial.json")
    if partial.exists():  # resumable: prompts already measured are kept
        done = json.loads(partial.read_text())["per_prompt"]
    for i, ids in enumerate(prompts(engine.lm, args.prompts, args.tokens)):
        if i < len(done):
            continue
        print(f"prompt {i + 1}/{args.prompts}: {len(ids)} tokens, {args.new} new", file=sys.stderr, flush=True)
        done.append(one_prompt(engine, ids, methods, args.budget, args.new))
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"per_prompt": done}))
    summ = summary(done, methods)
    out = {
        "machine": {**start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "threads": args.threads,
        "stop_at_eos": args.stop_at_eos,
        "budget": args.budget,
        "new_tokens": args.new,
        "summary": summ,
        "table": table(summ, scorers, args.budget),
        "per_prompt": done,
    }
    print(out["table"])
    path.write_text(json.dumps(out, indent=1))
    partial.unlink(missing_ok=True)
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
