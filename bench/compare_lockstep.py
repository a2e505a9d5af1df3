"""Lockstep vs one-by-one: one shared prefill + batched decode, against per-method pipelines.

Runs `compare` of exact + 4 methods on a ~1.9k-token prompt (CPython's reference manual), 32 new
tokens, 2 CPU threads; then the same 5 configurations one by one, each with its own prefill. The
goal is lockstep <= 0.35x of one-by-one. The pair is repeated (``--repeats``, default 3)
because a shared 2-core machine is noisy: reported are every pair's ratio, the median pair's, and
the ratio of best times (each configuration's fastest run, as ``timeit`` advises: noise only adds time).
Prints JSON and writes it with ``--json``.

    python -m bench.compare_lockstep [--methods exact,qjl,subgen,balancekv,scissorhands] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvlab.core.budgets import Budget
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import names

DEFAULT = "exact,qjl,subgen,balancekv,scissorhands"


def long_prompt(lm, target_tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    lo, hi = 100, len(text)
    while hi - lo > 200:  # binary search on characters for the token target
        mid = (lo + hi) // 2
        if len(lm.encode(text[:mid] + "\n\nSummarize the text above.")) < target_tokens:
            lo = mid
        else:
            hi = mid
    return lm.encode(text[:lo] + "\n\nSummarize the text above.")


def emit(out: dict, path: str | None) -> None:
    """Print a benchmark's result as JSON, and write it to ``path`` when given."""
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def add_setup_args(ap: argparse.ArgumentParser) -> None:
    """The benchmark setup shared by the lockstep and probe benchmarks."""
    ap.add_argument("--methods", default=DEFAULT)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--tokens", type=int, default=1900)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")


def setup(args):
    """Model, engine, run specs, prompt ids and generation settings for ``args``."""
    torch.set_num_threads(args.threads)
    lm = load_model("embedded")
    engine = Engine(lm)
    wanted = [m for m in args.methods.split(",") if m in names()]
    budget = Budget.parse(args.budget)
    specs = [RunSpec(m, None if m == "exact" else budget) for m in wanted]
    return lm, engine, specs, long_prompt(lm, args.tokens), GenerationSettings(max_new_tokens=args.new)


def warm_up(engine, ids, specs, **kw) -> None:
    """Run every spec once on the prompt's first 300 tokens: first-use costs (lazy kernel set-up,
    cached tables, the allocator's first pages) would otherwise land on whichever run comes first."""
    engine.compare(ids[:300], specs, GenerationSettings(max_new_tokens=3), **kw)


def timed_pair(engine, ids, specs, gen) -> tuple[float, object, dict[str, float]]:
    """One lockstep compare of all specs, then each spec alone: (lockstep s, its result, alone s per label)."""
    t0 = time.perf_counter()
    together = engine.compare(ids, specs, gen)
    lockstep_s = time.perf_counter() - t0
    alone = {}
    for spec in specs:
        t0 = time.perf_counter()
        engine.compare(ids, [spec], gen)
        alone[spec.label] = time.perf_counter() - t0
    return lockstep_s, together, alone


def main() -> None:
    ap = argparse.ArgumentParser()
    add_setup_args(ap)
    ap.add_argument(
        "--repeats", type=int, default=3, help="lockstep / one-by-one pairs (median pair and best times reported)"
    )
    args = ap.parse_args()
    lm, engine, specs, ids, gen = setup(args)
    warm_up(engine, ids, specs)

    pairs = [timed_pair(engine, ids, specs, gen) for _ in range(max(1, args.repeats))]
    lockstep = [p[0] for p in pairs]
    one_by_one = [sum(p[2].values()) for p in pairs]
    ratios = [a / b for a, b in zip(lockstep, one_by_one)]
    mid = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]  # the median pair
    lockstep_s, together, alone = pairs[mid]
    best_alone = {label: min(p[2][label] for p in pairs) for label in alone}  # timeit-style: noise only adds time
    out = {
        "prompt_tokens": len(ids),
        "new_tokens": args.new,
        "threads": args.threads,
        "methods": [s.label for s in specs],
        "repeats": len(pairs),
        "ratio_median_pair": round(ratios[mid], 3),
        "ratio_best_times": round(min(lockstep) / sum(best_alone.values()), 3),
        "ratios": [round(r, 3) for r in ratios],
        "lockstep_s": [round(x, 2) for x in lockstep],
        "one_by_one_s": [round(x, 2) for x in one_by_one],
        "best": {
            "lockstep_s": round(min(lockstep), 2),
            "one_by_one_s": round(sum(best_alone.values()), 2),
            "per_method_alone_s": {k: round(v, 2) for k, v in best_alone.items()},
        },
        "median_pair": {
            "lockstep_s": round(lockstep_s, 2),
            "prefill_s": round(together.timings["prefill_s"], 2),
            "compress_s": {r.label: round(r.timings.compress_s, 3) for r in together.runs},
            "decode_s": round(max(r.timings.decode_s for r in together.runs), 2),
            "one_by_one_s": round(one_by_one[mid], 2),
            "per_method_alone_s": {k: round(v, 2) for k, v in alone.items()},
        },
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()
