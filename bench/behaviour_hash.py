"""A fingerprint of every method's behaviour, to show that a restructuring changed nothing.

On the embedded model, every registered method (and every ``METHOD@paper`` preset) runs at budgets
0.25 and 0.5 in two comparisons: a query-aware one with all measurements on (attention error,
teacher-forced fidelity, attention maps), and a query-agnostic one (context compressed, a question
fed after). Each run is reduced to its generated tokens, its bytes per step (and by kind), its
finish reason and its measurements rounded to 6 significant digits, and hashed. Writes
``bench/results/behaviour_hash.json``; ``--check FILE`` compares against an earlier file and
exits non-zero on any difference. With ``--check``, only the methods of that file run (a method
added since is left out and named): every method shares the lockstep batch, so a new row moves
the last bits of the others' measurements. Torch runs on one thread (``KVLAB_THREADS`` unless set):
a thread count fitted to the machine's load would move the float sums, and with them the hashes.

    python -m bench.behaviour_hash [--check bench/results/behaviour_hash.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

PROMPT = (
    "The lighthouse keeper wrote in his log every evening. On Monday the fog came in early and the "
    "supply boat was late. On Tuesday he repaired the lamp and counted 41 gulls on the rocks. On "
    "Wednesday a storm broke two windows, and he noted the barometer at 982 hPa. On Thursday the boat "
    "brought flour, oil, and a letter from his sister in Bergen, who asked him to visit in spring. "
    "On Friday he painted the railing green and finished the letter he had started in March. "
    "Summarise the week in two sentences."
)
CONTEXT = PROMPT.rsplit(" Summarise", 1)[0]
QUESTION = "What colour did he paint the railing?"
PRESETS = ["balancekv@paper", "scissorhands@paper", "subgen@theorem", "qjl@paper"]
BUDGETS = ["0.25", "0.5"]


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {str(k): _round(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def fingerprint(run) -> dict:
    """Everything a run's behaviour shows, with timings left out."""
    return _round(
        {
            "tokens": run.token_ids,
            "finish": run.finish_reason,
            "error": run.error,
            "bytes_per_step": run.kv_bytes_per_step,
            "bytes_by_kind": run.kv_bytes_breakdown,
            "shared": run.shared_bytes,
            "metrics": {k: v for k, v in run.metrics.items() if "time" not in k and not k.endswith("_s")},
            "kept": {k: v for k, v in run.extras.items() if k.startswith("kept")},
        }
    )


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", default="")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "behaviour_hash.json"))
    ap.add_argument("--new", type=int, default=12)
    args = ap.parse_args()
    os.environ.setdefault("KVLAB_THREADS", "1")  # before kvlab loads: the same sums on every run
    from kvlab.engine.loader import load_model
    from kvlab.engine.specs import GenerationSettings
    from kvlab.measure.metrics import ProbeSettings
    from kvlab.methods import names
    from kvlab.run import Comparison, compare

    lm = load_model()
    methods = [m for m in names() if m != "exact"] + PRESETS
    before = json.loads(Path(args.check).read_text()) if args.check else None
    if before is not None:  # compare like with like: the methods of the earlier file, in today's order
        known = {key.split(" ")[1] for key in before["runs"]}
        added = [m for m in methods if m not in known]
        methods = [m for m in methods if m in known]
        if added:
            print(f"not in {args.check}, left out: {', '.join(added)}", flush=True)
    gen = GenerationSettings(max_new_tokens=args.new)
    out: dict[str, dict] = {}
    for label, comparison in [
        ("query-aware", Comparison(PROMPT, ["exact", *methods], BUDGETS, settings=gen, measure=ProbeSettings())),
        ("query-agnostic", Comparison(CONTEXT, ["exact", *methods], BUDGETS, settings=gen, questions=[QUESTION])),
    ]:
        res = compare(lm, comparison)
        for r in res.runs:
            key = f"{label} {r.method} {r.budget}"
            while key in out:
                key += "'"
            out[key] = {
                "hash": digest(fingerprint(r)),
                "tokens": len(r.token_ids),
                "peak": max(r.kv_bytes_per_step or [0]),
            }
            print(key, out[key], flush=True)
    total = digest({k: v["hash"] for k, v in out.items()})
    print("all runs:", total)
    doc = {"all": total, "runs": out}
    if before is not None:
        diff = sorted(k for k in set(before["runs"]) | set(out) if before["runs"].get(k) != out.get(k))
        for k in diff:
            print("DIFFERS:", k, before["runs"].get(k), "->", out.get(k))
        print("equal" if not diff else f"{len(diff)} runs differ")
        return 1 if diff else 0
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
