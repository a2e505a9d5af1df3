"""Cancel at every stage of a 4k-token comparison: click -> "cancelled" and click -> an idle CPU.

``python -m bench.cancel [--tokens 3950] [--json bench/results/cancel.json]`` drives the page's own
callbacks as Gradio does: ``Dashboard.compare`` runs in a worker thread (each ``next`` of the
generator there) while the main thread presses Cancel (``Dashboard.cancel``) once the comparison
is inside a stage, then closes the generator (Gradio's cancel):

* ``prefill``: 0.5 s after the prefill's first layer started (the 4k-token prefill takes seconds);
* ``compress``: 0.05 s after the prefill's event (the methods compress one after another);
* ``question``: right after the last compression (a ~300-token question, fed through every cache
  after a context of the remaining tokens);
* ``decode``: after decode step 2, measurements off;
* ``probes``: after decode step 2 with the measurements on (shadow attention, teacher forcing, maps).

Per stage: the stage the work was in when Cancel was pressed (checked from the events seen),
``cancelled_s`` (the click to Cancel's answer, the status line's "cancelled": it returns once the
model work ended), ``idle_s`` (the click to the first 100 ms in which the process used under 10%
of one core), ``worker_s`` (the click to the worker thread's end), and resident memory before the
comparison and after it was cancelled (``rss_before_mb``, ``rss_after_mb``). Then a small
comparison runs to the end (``next_s``): the page is free at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
from pathlib import Path

from bench.soak import rss_bytes

QUESTION = "Question: which of the statements above talk about the sky, and what colour do they give it? " * 14
STAGES = ("prefill", "compress", "question", "decode", "probes")


def quiet(*args, **kwargs) -> None:
    """A progress callback that shows nothing."""


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def wait_idle(t_click: float, window: float = 0.1, share: float = 0.1, timeout: float = 60.0) -> float:
    """Seconds from ``t_click`` to the start of the first ``window`` in which the process used < ``share`` of a core."""
    while time.perf_counter() - t_click < timeout:
        t0, c0 = time.perf_counter(), cpu_s()
        time.sleep(window)
        if (cpu_s() - c0) / (time.perf_counter() - t0) < share:
            return t0 - t_click
    return float("nan")


def long_prompt(lm, tokens: int) -> str:
    line = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    text, n = "", 0
    while n < tokens:
        text += line * 2
        n = len(lm.encode(text))
    return text


def one_stage(dash, stage: str, prompt: str, papers: list[str], baselines: list[str]) -> dict:
    """Cancel a comparison inside ``stage``; the timings and memory."""
    from kvlab.core.cancel import decoder_layers

    question = QUESTION if stage == "question" else ""
    maps = stage == "probes"
    seen: list[tuple[float, str]] = []
    started: list[float] = []  # when the first forward's first layer started
    lm = dash.lm
    hook = decoder_layers(lm.model, lm.info.n_layers)[0].register_forward_pre_hook(
        lambda *a: started.append(time.perf_counter()) if not started else None
    )

    def progress(frac, desc=""):
        seen.append((time.perf_counter(), desc))

    gen = dash.compare(
        "embedded", prompt, papers, baselines, "0.25", 32, 0, None, maps, None, 0, question, progress=progress
    )

    def work():  # Gradio's worker: one ``next`` at a time in a thread
        for _ in gen:
            pass

    gc.collect()
    rss0 = rss_bytes()
    worker = threading.Thread(target=work)
    worker.start()

    def saw(text: str) -> bool:
        return any(text in d for _, d in seen)

    n_runs = 1 + len(papers) + len(baselines)
    while worker.is_alive():
        if stage == "prefill" and started and time.perf_counter() - started[0] > 0.5:
            break
        if stage == "compress" and saw("prefill of"):
            time.sleep(0.05)
            break
        if stage == "question" and sum("compressed in" in d for _, d in seen) == n_runs:
            break
        if stage in ("decode", "probes") and saw("decode step 2 "):
            break
        time.sleep(0.005)
    at = [d for _, d in seen]
    t_click = time.perf_counter()
    status = dash.cancel()
    cancelled_s = time.perf_counter() - t_click
    while True:  # then Gradio closes the generator, retrying while a ``next`` runs
        try:
            gen.close()
            break
        except ValueError:
            time.sleep(0.05)
    idle_s = wait_idle(t_click)
    worker.join(60)
    worker_s = time.perf_counter() - t_click
    hook.remove()
    gc.collect()
    rss1 = rss_bytes()
    inside = {
        "prefill": bool(started) and not any("prefill of" in d for d in at),
        "compress": any("prefill of" in d for d in at) and sum("compressed in" in d for d in at) < n_runs,
        "question": sum("compressed in" in d for d in at) == n_runs and not any("question 1" in d for d in at),
        "decode": any("decode step" in d for d in at),
        "probes": any("decode step" in d for d in at),
    }[stage]
    return {
        "stage": stage,
        "inside_the_stage": inside,
        "last_event": at[-1] if at else "",
        "cancelled_s": round(cancelled_s, 3),
        "idle_s": round(idle_s, 3),
        "worker_s": round(worker_s, 3),
        "rss_before_mb": round(rss0 / 2**20, 1),
        "rss_after_mb": round(rss1 / 2**20, 1),
        "status": status.split("kv-progress-msg'>")[-1].removesuffix("</div>"),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3950)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--json", default="bench/results/cancel.json")
    args = ap.parse_args(argv)

    from kvlab.engine.loader import load_model
    from kvlab.ui import Dashboard, default_methods

    lm = load_model("embedded")
    dash = Dashboard(lm)
    papers, baselines = default_methods()
    prompt = long_prompt(lm, args.tokens)
    context = long_prompt(lm, args.tokens - len(lm.encode(QUESTION, chat=False)))
    small = "Explain what a KV cache is in two sentences."
    for _ in dash.compare("embedded", small, papers, baselines, "0.5", 2, 0, None, True, None, 0, "", progress=quiet):
        pass  # warm up: the allocator and every method's first call
    rows = []
    for stage in args.stages.split(","):
        text = context if stage == "question" else prompt
        row = one_stage(dash, stage, text, papers, baselines)
        t0 = time.perf_counter()
        *_, last = dash.compare(
            "embedded", small, [], ["streaming"], "0.5", 4, 0, None, False, None, 0, "", progress=quiet
        )
        row["next_s"] = round(time.perf_counter() - t0, 2)
        row["next_status"] = last[0].split("kv-progress-msg'>")[-1].removesuffix("</div>")
        print(json.dumps(row))
        rows.append(row)
    out = {
        "prompt_tokens": len(lm.encode(prompt)),
        "methods": ["exact", *papers, *baselines],
        "budget": "0.25",
        "torch_threads": __import__("torch").get_num_threads(),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "stages": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
