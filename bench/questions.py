"""Questions asked after compression: three questions on one compressed context against one question.

The query-agnostic protocol prefills and compresses a ~2k-token context (CPython's reference
manual) once, then feeds each question through a fork of every method's compressed cache in one
chunked forward and decodes. Three questions should cost little more than one (goal: <= 1.5x),
since the prefill and the compressions are shared. For reference it also times the query-aware
protocol on the same three questions (each prompt prefilled and compressed on its own), unless
``--no-aware``. Each configuration runs ``--repeats`` times after a warm-up; best times are
compared (noise on a shared machine only adds time). Prints JSON and writes it with ``--json``.

    OMP_NUM_THREADS=1 python -m bench.questions [--threads 1] [--new 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.compare_lockstep import emit
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model
from kvlab.engine.specs import GenerationSettings
from kvlab.run import Comparison, compare_all

METHODS = "exact,qjl,subgen-kcenter,balancekv,scissorhands"
QUESTIONS = (
    "What does an augmented assignment statement do?",
    "Which exception does a failed assert raise?",
    "Summarize the text above in one sentence.",
)


def context_text(lm, target_tokens: int) -> str:
    """About ``target_tokens`` tokens of the reference manual (chat template included)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    lo, hi = 100, len(text)
    while hi - lo > 200:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(lm.encode(text[:mid])) < target_tokens else (lo, mid)
    return text[:lo]


def timed(engine: Engine, comparison: Comparison) -> tuple[float, list]:
    t0 = time.perf_counter()
    results = compare_all(engine, comparison)
    return time.perf_counter() - t0, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="context length in tokens")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--new", type=int, default=16, help="new tokens per question")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-aware", action="store_true", help="skip the query-aware reference")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_model("embedded"))
    ctx = context_text(engine.lm, args.tokens)
    gen = GenerationSettings(max_new_tokens=args.new)
    methods = args.methods.split(",")

    def comparison(questions, protocol="query-agnostic", text=ctx, new=args.new):
        settings = GenerationSettings(max_new_tokens=new)
        return Comparison(text, methods, [args.budget], settings=settings, questions=questions, protocol=protocol)

    timed(engine, comparison(QUESTIONS[:2], text=ctx[:1200], new=3))  # warm-up: first-use costs
    configs = {"one question": comparison(QUESTIONS[:1]), "three questions": comparison(QUESTIONS)}
    if not args.no_aware:
        configs["three questions, query-aware"] = comparison(QUESTIONS, protocol="query-aware")
    times: dict[str, list[float]] = {name: [] for name in configs}
    detail: dict[str, dict] = {}
    for _ in range(max(1, args.repeats)):
        for name, cmp in configs.items():
            dt, results = timed(engine, cmp)
            times[name].append(round(dt, 2))
            detail[name] = {
                "context_tokens": results[0].context_tokens,
                "question_tokens": [r.prompt_tokens - r.context_tokens for r in results],
                "shared_s": round(results[0].timings.get("shared_s", 0.0), 2),
                "own_s": [round(r.timings.get("own_s", r.timings["compare_s"]), 2) for r in results],
                "question_s": [round(r.timings.get("question_s", 0.0), 3) for r in results],
            }
    best = {name: min(ts) for name, ts in times.items()}
    out = {
        "machine_load_1min": os.getloadavg()[0],
        "threads": args.threads,
        "methods": methods,
        "budget": args.budget,
        "new_tokens": gen.max_new_tokens,
        "times_s": times,
        "best_s": best,
        "detail": detail,
        "ratio_three_vs_one": round(best["three questions"] / best["one question"], 3),
    }
    if not args.no_aware:
        out["ratio_aware_vs_agnostic_three"] = round(best["three questions, query-aware"] / best["three questions"], 3)
    emit(out, args.json)


if __name__ == "__main__":
    main()
