"""kvlab against NVIDIA kvpress, side by side: the same prompt tokens, the same number of configurations.

kvlab: one ``compare`` of exact + qjl, subgen-kcenter, balancekv, scissorhands at budget 0.5: one
exact prefill shared by all, each method's compression, then one lockstep decode of all five.
kvpress: exact + presses that run with SDPA attention (KNorm, KeyDiff, SnapKV, TOVA; StreamingLLM too) at
``compression_ratio`` 0.5 (the fraction removed), each its own ``kv-press-text-generation`` pipeline
with its own prefill, one after the other. Presses that need eager attention (ObservedAttention reads
the attention weights) run too, but are timed apart (``--eager-presses``) and left out of the ratios:
eager attention alone makes their prefill ~2.5x slower. kvpress has no QJL, SubGen or BalanceKV; the
stand-ins are named in the result (``bench/kvpress_worker.py``).

Both sides: the embedded SmolLM2-135M-Instruct in float32, a ~1.9k-token prompt (CPython's
reference manual, as ``bench/compare_lockstep.py`` builds it), 32 new tokens, greedy, 2 threads.
kvpress pins transformers < 5.3, so its side runs in its own virtual environment
(``bash bench/kvpress_env.sh`` makes ``.venv-kvpress``). The driver starts two worker processes,
one per environment; each loads the model and warms up once with a full run; then the two take
turns (``--repeats`` times), so both see the machine in the same state. Model loading is not timed.

Reported, two ratios of kvlab's time over kvpress's SDPA configurations:

* warm: both workers warmed up; the median of the turns' ratios and the ratio of the best times
  (noise only adds time);
* cold: kvlab as one fresh ``python -m kvlab compare`` process (model load, first-use costs and all,
  timed from the outside) against kvpress's median warm turn, which is how a command-line user meets
  kvlab.

With each side's stages: kvlab's prefill,
compression per method and decode; kvpress's prefill, the press's compression and the decode per
pipeline. Writes ``bench/results/kvpress_compare.json`` with the machine and the versions.

    bash bench/kvpress_env.sh
    python -m bench.kvpress_compare [--repeats 3] [--tokens 1900] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.scaling import machine, rounded

ROOT = Path(__file__).resolve().parent.parent
METHODS = "exact,qjl,subgen-kcenter,balancekv,scissorhands"


# ----- the kvlab worker (main environment) ---------------------------------------------------------
def kvlab_worker(args) -> None:
    import torch
    import transformers

    from bench.scaling import default_setup, staged_compare
    from kvlab.engine.specs import GenerationSettings

    engine, specs, ids = default_setup(args, args.tokens)
    meta = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "configs": [s.label for s in specs],
        "ids": ids,
    }
    print(json.dumps({"ready": meta}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        result, st = staged_compare(engine, cmd["ids"], specs, GenerationSettings(max_new_tokens=cmd["new"]), [])
        steps = st["decode_steps_s"]
        out = {
            "total_s": st["total_s"],
            "prompt_tokens": len(cmd["ids"]),
            "prefill_s": st["prefill_s"],
            "compress_s": st["compress_s"],
            "decode_s": st["total_s"] - st["prefill_s"] - sum(st["compress_s"].values()),
            "decode_step_ms_median": 1e3 * statistics.median(steps) if steps else None,
            "new_tokens": {r.label: len(r.token_ids) for r in result.runs},
            "answers": {r.label: r.text for r in result.runs},
        }
        print(json.dumps(out), flush=True)


# ----- the driver ----------------------------------------------------------------------------------
class Worker:
    """A worker process speaking JSON lines: one ``ready`` line, then one reply per request."""

    def __init__(self, name: str, cmd: list[str]):
        self.name = name
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited (code {self.proc.wait()}); see its messages above")
        return json.loads(line)

    def run(self, ids: list[int], new: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "new": new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('{"quit": true}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1900, help="prompt length target")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default=METHODS, help="kvlab's configurations")
    ap.add_argument("--budget", default="0.5", help="kvlab's budget (fraction of the exact cache's bytes)")
    ap.add_argument("--presses", default="knorm,keydiff,snapkv,tova", help="SDPA presses besides exact")
    ap.add_argument(
        "--eager-presses",
        default="observed_attention",
        help="eager-attention presses: timed apart, not in the ratios",
    )
    ap.add_argument("--no-cold", action="store_true", help="skip the cold `python -m kvlab compare` run")
    ap.add_argument("--ratio", type=float, default=0.5, help="kvpress's compression_ratio (fraction removed)")
    ap.add_argument("--repeats", type=int, default=3, help="timed turns of each side after the warm-up")
    ap.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"))
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "kvpress_compare.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kvlab_worker(args)
        return
    if not Path(args.kvpress_python).exists():
        raise SystemExit(f"{args.kvpress_python} is missing: run `bash bench/kvpress_env.sh` first")

    start = machine()
    common = ["--threads", str(args.threads)]
    log("starting the kvlab worker")
    kvlab = Worker(
        "kvlab",
        [sys.executable, "-m", "bench.kvpress_compare", "--worker", "--tokens", str(args.tokens)]
        + ["--methods", args.methods, "--budget", args.budget]
        + common,
    )
    ids = kvlab.ready.pop("ids")
    log("starting the kvpress worker")
    kvpress = Worker(
        "kvpress",
        [args.kvpress_python, str(ROOT / "bench" / "kvpress_worker.py"), "--worker"]
        + ["--presses", ",".join(p for p in (args.presses, args.eager_presses) if p), "--ratio", str(args.ratio)]
        + common,
    )
    try:
        log(f"warm-up: one full run each ({len(ids)} prompt tokens, {args.new} new)")
        kvlab.run(ids, args.new)
        kvpress.run(ids, args.new)
        turns = []
        for i in range(max(1, args.repeats)):
            a = kvlab.run(ids, args.new)
            b = kvpress.run(ids, args.new)
            turns.append((a, b))
            log(f"turn {i + 1}: kvlab {a['total_s']:.2f} s, kvpress {b['total_s']:.2f} s")
    finally:
        kvlab.close()
        kvpress.close()
    eager_labels = [
        label for label in kvpress.ready["configs"] if label.split("@")[0] in kvpress.ready["eager_attention_for"]
    ]
    for _, b in turns:  # the ratios count the SDPA configurations only
        b["eager_s"] = sum(b["configs"][label]["total_s"] for label in eager_labels)
        b["all_s"], b["total_s"] = b["total_s"], b["total_s"] - b["eager_s"]
    cold = None if args.no_cold else cold_kvlab(args, ids)

    ratios = [a["total_s"] / b["total_s"] for a, b in turns]
    mid = sorted(range(len(turns)), key=lambda i: ratios[i])[len(turns) // 2]
    med_kvlab, med_kvpress = turns[mid]
    best_kvlab = min(a["total_s"] for a, _ in turns)
    best_kvpress = min(b["total_s"] for _, b in turns)
    kvpress_stages = {
        label: {k: c[k] for k in ("total_s", "prefill_s", "compress_s", "decode_s")}
        for label, c in med_kvpress["configs"].items()
    }
    out = {
        "machine": {**start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "prompt_tokens": len(ids),
        "new_tokens": args.new,
        "threads": args.threads,
        "repeats": len(turns),
        "ratio_median_turn": round(ratios[mid], 3),
        "ratio_best_times": round(best_kvlab / best_kvpress, 3),
        "ratio_cold": round(cold["wall_s"] / med_kvpress["total_s"], 3) if cold else None,
        "cold_kvlab": cold,
        "target": {"warm": 0.30, "cold": 0.40},
        "kvpress_counts": "SDPA configurations only (exact + the --presses); eager-only presses apart",
        "kvpress_eager_only_s": {label: round(med_kvpress["configs"][label]["total_s"], 2) for label in eager_labels},
        "ratios": [round(r, 3) for r in ratios],
        "kvlab_s": [round(a["total_s"], 2) for a, _ in turns],
        "kvpress_s": [round(b["total_s"], 2) for _, b in turns],
        "kvlab": {
            "versions": kvlab.ready["versions"],
            "configs": kvlab.ready["configs"],
            "median_turn": {k: v for k, v in med_kvlab.items() if k != "answers"},
            "answers": med_kvlab["answers"],
        },
        "kvpress": {
            "versions": kvpress.ready["versions"],
            "configs": kvpress.ready["configs"],
            "stand_ins": kvpress.ready["stand_ins"],
            "eager_attention_for": kvpress.ready["eager_attention_for"],
            "question_tokens": kvpress.ready["question_tokens"],
            "median_turn": {
                "total_s": med_kvpress["total_s"],
                "all_s": med_kvpress["all_s"],
                "configs": kvpress_stages,
            },
            "answers": {label: c["answer"] for label, c in med_kvpress["configs"].items()},
        },
    }
    out = rounded(out)
    print(json.dumps(out, indent=1))
    print(table(out))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        log(f"written to {args.json}")


def cold_kvlab(args, ids: list[int]) -> dict:
    """Wall time of one fresh ``python -m kvlab compare`` process on the same prompt tokens (fed raw:
    the ids already hold the chat template), as a command-line user runs it."""
    import tempfile

    from transformers import AutoTokenizer

    from bench.kvpress_worker import model_source

    path, extra = model_source()
    text = AutoTokenizer.from_pretrained(path, **extra).decode(ids)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [sys.executable, "-m", "kvlab", "compare", "--prompt-file", f.name, "--no-chat", "--no-probes", "--quiet"]
    cmd += ["--methods", args.methods, "--budget", args.budget, "--max-new-tokens", str(args.new)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    log("cold: one fresh `python -m kvlab compare` process")
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    os.unlink(f.name)
    return {"wall_s": round(wall, 2), "command": " ".join(cmd[1:5] + ["PROMPT"] + cmd[6:])}


def table(out: dict) -> str:
    """A markdown summary: the ratio, then each side's stages in the median turn."""
    kl = out["kvlab"]["median_turn"]
    lines = [
        f"kvlab / kvpress (SDPA presses): warm {out['ratio_median_turn']} (median turn), {out['ratio_best_times']}"
        f" (best times), cold {out['ratio_cold']};"
        f" targets <= {out['target']['warm']} warm, <= {out['target']['cold']} cold",
        "",
        "| side | configuration | prefill s | compression s | decode s | total s |",
        "|---|---|---|---|---|---|",
        f"| kvlab | all 5 in one run | {kl['prefill_s']:.2f} | {sum(kl['compress_s'].values()):.2f} "
        f"| {kl['decode_s']:.2f} ({kl['decode_step_ms_median']:.0f} ms/step) | {kl['total_s']:.2f} |",
    ]
    for label, s in kl["compress_s"].items():
        lines.append(f"| kvlab | {label} | | {s:.3f} | | |")
    for label, c in out["kvpress"]["median_turn"]["configs"].items():
        lines.append(
            f"| kvpress | {label} | {c['prefill_s']:.2f} | {c['compress_s']:.3f} | {c['decode_s']:.2f} "
            f"| {c['total_s']:.2f} |"
        )
    kp = out["kvpress"]["median_turn"]["total_s"]
    lines.append(f"| kvpress | SDPA configurations, one by one | | | | {kp:.2f} |")
    if out.get("cold_kvlab"):
        lines.append(f"| kvlab | cold `python -m kvlab compare` process | | | | {out['cold_kvlab']['wall_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
