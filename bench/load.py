"""A comparison's time quiet and beside one competing CPU-heavy process, against transformers' own forward.

``python -m bench.load --models embedded,gemma3-270m --lengths 1k,4k --json bench/results/load.json``

For each model and length: ``kvlab compare --task niah_single_2 --query-agnostic --methods
exact,snapkv --budget 0.25`` (the comparison of docs/tasks.md) in a fresh process, and in another
fresh process transformers' own forward over the same prompt's ids (best of two), each once with
the machine as it is ("quiet") and once beside a competing process. The competitor is a torch
process running matrix products on every core with torch's defaults, as a second sweep or
another program would (``--competitor spin``: a pure-Python loop on one core instead).

``--tree DIR`` times another checkout of kvlab (the code before a change, from ``git worktree
add``); its ``--model`` then takes the converted folder (``--model-dir NAME=PATH``) where that
checkout does not know the name. The load average before each run is recorded beside it; the
machine's other work is not controlled, so runs of one table are the figures to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ["--task", "niah_single_2", "--query-agnostic", "--methods", "exact,snapkv", "--budget", "0.25"]

COMPETITORS = {
    "torch": "import torch\nx = torch.randn(1024, 1024)\nwhile True:\n    x = torch.tanh(x @ x)",
    "spin": "while True:\n    pass",
}

HF_FORWARD = """
import json, sys, time, torch
from kvlab.engine.loader import load_model
from kvlab.tasks import make_task
from kvlab.tasks.base import split_ids
lm = load_model(sys.argv[1], check=False)
t = make_task("niah_single_2", int(sys.argv[2]), 0, lm.encode, 0.5)
ids, _ = split_ids(lm, t.context, [t.question], [t.answer_prefix])
x = torch.tensor([ids])
best = float("inf")
with torch.inference_mode():
    for _ in range(2):
        t0 = time.perf_counter()
        lm.model(input_ids=x, logits_to_keep=1)
        best = min(best, time.perf_counter() - t0)
print(json.dumps({"hf_forward_s": best, "threads": torch.get_num_threads()}))
"""


@contextmanager
def competitor(kind: str | None):
    """A competing process for the duration of the block (None: none)."""
    if kind is None:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", COMPETITORS[kind]], env=_clean_env())
    time.sleep(3)  # let it reach full speed
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def _clean_env() -> dict[str, str]:
    """The environment without kvlab's and OpenMP's thread settings (each process starts with the defaults)."""
    drop = ("KVLAB_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def compare(tree: Path, model: str, length: str, env: dict[str, str]) -> dict:
    """One ``kvlab compare`` in a fresh process: its timings (seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "kvlab", "compare", "--model", model, "--length", length, *TASK]
        cmd += ["--json", str(out)]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        data = json.loads(out.read_text())
    t, runs = data["timings"], data["runs"]
    steps = max(len(r["token_ids"]) - 1 for r in runs)
    decode = max(r["timings"].get("decode_s", 0.0) for r in runs)
    return {
        "prompt_tokens": data.get("context_tokens"),
        "prefill_s": t.get("prefill_s"),
        "question_s": t.get("question_s"),
        "decode_step_s": decode / steps if steps else None,
        "compare_s": t.get("compare_s"),
        "process_s": wall,
    }


def hf_forward(tree: Path, model: str, length: str, env: dict[str, str]) -> dict:
    from kvlab.tasks import parse_length

    cmd = [sys.executable, "-c", HF_FORWARD, model, str(parse_length(length))]
    done = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="embedded,gemma3-270m")
    p.add_argument("--lengths", default="1k,4k")
    p.add_argument("--tree", default=str(ROOT), help="the kvlab checkout to time")
    p.add_argument("--model-dir", action="append", default=[], help="NAME=PATH: a model's folder for --tree")
    p.add_argument("--competitor", choices=sorted(COMPETITORS), default="torch")
    p.add_argument("--label", default="", help="a name for this tree's runs (before, after, ...)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the timed processes")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    tree = Path(args.tree).resolve()
    folders = dict(x.split("=", 1) for x in args.model_dir)
    env = _clean_env() | dict(x.split("=", 1) for x in args.env) | {"PYTHONPATH": str(tree)}
    rows = []
    for model in args.models.split(","):
        for length in args.lengths.split(","):
            for kind in (None, args.competitor):
                with competitor(kind):
                    load = os.getloadavg()[0]
                    row = {"model": model, "length": length, "load": "quiet" if kind is None else kind}
                    row |= {"label": args.label, "loadavg_before": round(load, 2)}
                    row |= compare(tree, folders.get(model, model), length, env)
                    row |= hf_forward(tree, folders.get(model, model), length, env)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
