"""How cost grows with the prompt: each stage's time and the peak memory at 1k, 2k, 4k and 8k tokens.

The default comparison (exact + qjl, subgen-kcenter, balancekv, scissorhands at budget 0.5, 32 new
tokens, 2 CPU threads) on CPython's reference manual cut to each size, with the measurement probes
off and on (``MetricsProbe``: shadow-cache attention error, teacher-forced fidelity, attention maps).
The largest size is the embedded model's 8,192 positions less the new tokens.

Each (size, probes) point runs in a fresh process, so its peak resident memory (``VmHWM``) is its
own: the process loads the model, warms up on a 300-token prompt, then times one comparison
(``--repeats`` for more; the fastest is kept). Recorded per point: the prefill, each method's
compression, every decode step (a lockstep step of all rows; the first one apart, as it includes the
probes' set-up), the probes' finish after the last step, the text metrics, the comparison's total, and the memory.

A stage *grows faster than the prefill* between two sizes when its time ratio exceeds the prefill's
by more than ``--tolerance`` (default 15%); stages too small to time reliably at the larger size
(under ``--min-s``) are not judged. Prints a markdown table and the flagged stages; writes JSON.

    python -m bench.scaling [--sizes 1k,2k,4k,8k] [--json bench/results/scaling.json]
    python -m bench.scaling --sizes 256 --new 4      # a quick end-to-end check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

METHODS = "exact,qjl,subgen-kcenter,balancekv,scissorhands"


# ----- shared with bench/kvpress_compare.py --------------------------------------------------------
def machine() -> dict:
    """The machine a result comes from: CPU model, cores, memory, load."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor is enough
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = info.get("flags", "").split()
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": info.get("model name", "unknown"),
        "cpu_id": " ".join(f"{k} {info[k]}" for k in ("vendor_id", "cpu family", "model", "stepping") if k in info),
        "cpu_mhz": info.get("cpu MHz"),
        "virtualized": "hypervisor" in flags,
        "simd": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags],
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def proc_status_mb(key: str) -> float | None:
    """A /proc/self/status memory line (VmRSS, VmHWM) in MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def staged_compare(engine, ids, specs, gen, probes: list) -> tuple[object, dict]:
    """One ``Engine.stream`` comparison, timed per stage from its events: (result, stages).

    stages: total_s, prefill_s, compress_s {label: s}, first_step_s (from the last compression to
    the end of the first lockstep step: the probes' ``on_prefill``, the first tokens and that step),
    decode_steps_s [each later lockstep step] and finish_s (after the last step: the probes' ``finish``)."""
    t0 = time.perf_counter()
    last = t0
    first_step_s, steps, finish_s, result = 0.0, [], 0.0, None
    seen_step = False
    for ev in engine.stream(ids, specs, gen, probes=probes):
        now = time.perf_counter()
        if ev.kind == "step":
            if seen_step:
                steps.append(now - last)
            else:
                first_step_s, seen_step = now - last, True
            last = now
        elif ev.kind in ("prefill", "compress"):
            last = now
        elif ev.kind == "done":
            result = ev.result
            finish_s = now - last
    stages = {
        "total_s": time.perf_counter() - t0,
        "prefill_s": result.timings["prefill_s"],
        "compress_s": {r.label: r.timings.compress_s for r in result.runs},
        "first_step_s": first_step_s,
        "decode_steps_s": steps,
        "finish_s": finish_s,
    }
    return result, stages


def default_setup(args, tokens: int):
    """The engine on the embedded model, the runs of ``args.methods`` at ``args.budget`` (exact once),
    and a prompt of about ``tokens`` tokens of CPython's reference manual."""
    import torch

    from bench.compare_lockstep import long_prompt
    from kvlab.core.budgets import Budget
    from kvlab.engine.comparison import Engine
    from kvlab.engine.loader import load_model
    from kvlab.engine.specs import RunSpec

    torch.set_num_threads(args.threads)
    engine = Engine(load_model("embedded"))
    budget = Budget.parse(args.budget)
    specs = [RunSpec(m, None if m == "exact" else budget) for m in args.methods.split(",")]
    return engine, specs, long_prompt(engine.lm, tokens)


# ----- one point, in its own process ----------------------------------------------------------------
def child(args) -> None:
    from kvlab.engine.specs import GenerationSettings
    from kvlab.measure.metrics import MetricsProbe, add_text_metrics

    engine, specs, ids = default_setup(args, args.child)
    gen = GenerationSettings(max_new_tokens=args.new)
    probes = lambda: [MetricsProbe()] if args.probes == "on" else []  # noqa: E731

    engine.compare(ids[:300], specs, GenerationSettings(max_new_tokens=3), probes=probes())  # warm-up
    rss_before = proc_status_mb("VmRSS")
    best = None
    for _ in range(max(1, args.repeats)):
        result, stages = staged_compare(engine, ids, specs, gen, probes())
        t0 = time.perf_counter()
        add_text_metrics(result)
        stages["text_metrics_s"] = time.perf_counter() - t0
        if best is None or stages["total_s"] < best[1]["total_s"]:
            best = (result, stages)
    result, stages = best
    out = {
        "prompt_tokens": len(ids),
        "probes": args.probes,
        "stages": stages,
        "new_tokens": {r.label: len(r.token_ids) for r in result.runs},
        "rss_before_run_mb": rss_before,
        "peak_rss_mb": proc_status_mb("VmHWM"),
    }
    print("RESULT " + json.dumps(out), flush=True)


# ----- the driver ----------------------------------------------------------------------------------
def parse_size(s: str, limit: int) -> int:
    s = s.strip().lower()
    n = int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)
    return min(n, limit)


def run_point(args, size: int, probes: str) -> dict:
    cmd = [sys.executable, "-m", "bench.scaling", "--child", str(size), "--probes", probes]
    cmd += ["--methods", args.methods, "--budget", args.budget, "--new", str(args.new)]
    cmd += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    t0 = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"target_tokens": size, "probes": probes, "error": f"no result within {args.timeout} s"}
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"target_tokens": size, "probes": probes, "error": f"exit {p.returncode}: " + " | ".join(tail)}
    out = json.loads(line.removeprefix("RESULT "))
    out["target_tokens"] = size
    out["load_average_at_start"] = load
    out["process_s"] = round(time.perf_counter() - t0, 1)
    return out


def stage_series(point: dict) -> dict[str, float]:
    """The stages compared across sizes: prefill, each compression, the median decode step, and so on."""
    st = point["stages"]
    steps = st["decode_steps_s"]
    series = {"prefill": st["prefill_s"]}
    series.update({f"compress {k}": v for k, v in st["compress_s"].items()})
    series["decode step (median)"] = statistics.median(steps) if steps else 0.0
    series["first step (with probe set-up)"] = st["first_step_s"]
    series["probe finish"] = st["finish_s"]
    series["text metrics"] = st["text_metrics_s"]
    series["total"] = st["total_s"]
    return series


def growth(points: list[dict], tolerance: float, min_s: float) -> list[dict]:
    """Each stage's growth between successive sizes against the prefill's; ``faster`` when it outgrows it."""
    rows = []
    for a, b in zip(points, points[1:]):
        sa, sb = stage_series(a), stage_series(b)
        n_ratio = b["prompt_tokens"] / a["prompt_tokens"]
        p_ratio = sb["prefill"] / sa["prefill"]
        steps_b = len(b["stages"]["decode_steps_s"]) or 1
        for name in sa:
            if name == "prefill" or sa[name] <= 0 or sb[name] <= 0:
                continue
            ratio = sb[name] / sa[name]
            judged_s = sb[name] * (steps_b if name.startswith("decode") else 1)  # a step is judged by all of them
            exponent = math.log(ratio) / math.log(n_ratio)
            rows.append(
                {
                    "stage": name,
                    "from_tokens": a["prompt_tokens"],
                    "to_tokens": b["prompt_tokens"],
                    "ratio": round(ratio, 2),
                    "prefill_ratio": round(p_ratio, 2),
                    "exponent": round(exponent, 2),
                    "prefill_exponent": round(math.log(p_ratio) / math.log(n_ratio), 2),
                    "judged": judged_s >= min_s,
                    "faster_than_prefill": judged_s >= min_s and ratio > p_ratio * (1 + tolerance),
                }
            )
    return rows


def markdown(points: list[dict]) -> str:
    labels = []
    for p in points:
        for k in p.get("stages", {}).get("compress_s", {}):
            if k not in labels and k != "exact":
                labels.append(k)
    head = ["tokens", "probes", "prefill s"] + [f"{k} s" for k in labels]
    head += ["first step s", "decode ms/step", "finish s", "total s", "peak RSS MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        if "error" in p:
            lines.append(f"| {p['target_tokens']} | {p['probes']} | {p['error']} |" + " |" * (len(head) - 3))
            continue
        st = p["stages"]
        steps = st["decode_steps_s"]
        cells = [str(p["prompt_tokens"]), p["probes"], f"{st['prefill_s']:.2f}"]
        cells += [f"{st['compress_s'].get(k, 0.0):.3f}" for k in labels]
        cells += [
            f"{st['first_step_s']:.2f}",
            f"{1e3 * statistics.median(steps):.0f}" if steps else "-",
            f"{st['finish_s'] + st['text_metrics_s']:.2f}",
            f"{st['total_s']:.2f}",
            f"{p['peak_rss_mb']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounded(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, list):
        return [rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


def summary(args, start: dict, points: list[dict], complete: bool) -> dict:
    """The result: machine, settings, every point, and each stage's growth against the prefill's."""
    import torch
    import transformers

    ok = [p for p in points if "error" not in p]
    flagged = {}
    for probes in sorted({p["probes"] for p in ok}):
        series = sorted((p for p in ok if p["probes"] == probes), key=lambda p: p["prompt_tokens"])
        flagged[probes] = growth(series, args.tolerance, args.min_s)
    return {
        "machine": {**start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "methods": args.methods.split(","),
        "budget": args.budget,
        "new_tokens": args.new,
        "threads": args.threads,
        "repeats": args.repeats,
        "complete": complete,
        "points": rounded(points),
        "growth": flagged,
        "faster_than_prefill": sorted(
            {f"{r['stage']} (probes {k})" for k, rows in flagged.items() for r in rows if r["faster_than_prefill"]}
        ),
    }


def write(path: str, out: dict) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1k,2k,4k,8k", help="prompt tokens (8k: the model's positions less --new)")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--budget", default="0.5")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed comparisons per point (the fastest is kept)")
    ap.add_argument("--probes", default="off,on")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--min-s", type=float, default=0.05, help="stages shorter than this are not judged")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    ap.add_argument("--json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return

    positions = 8192  # the embedded model's context; the prompt leaves room for the new tokens
    sizes = [parse_size(s, positions - args.new) for s in args.sizes.split(",") if s.strip()]
    start = machine()
    points = []
    for size in sizes:
        for probes in [p for p in args.probes.split(",") if p]:
            pt = run_point(args, size, probes)
            points.append(pt)
            state = pt.get("error") or f"{pt['stages']['total_s']:.1f} s, peak {pt['peak_rss_mb']:.0f} MB"
            print(f"{size} tokens, probes {probes}: {state}", file=sys.stderr, flush=True)
            if args.json:  # what is done so far, in case a later point does not finish
                write(args.json, summary(args, start, points, complete=False))
    out = summary(args, start, points, complete=True)
    table = markdown(points)
    print(table)
    print()
    for k, rows in sorted(out["growth"].items()):
        for r in rows:
            if r["faster_than_prefill"]:
                print(
                    f"probes {k}: {r['stage']} grows {r['ratio']}x from {r['from_tokens']} to {r['to_tokens']} tokens"
                    f" (exponent {r['exponent']}), the prefill {r['prefill_ratio']}x ({r['prefill_exponent']})"
                )
    if not out["faster_than_prefill"]:
        print("no stage grows faster than the prefill")
    if args.json:
        write(args.json, out)
        print(f"written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
