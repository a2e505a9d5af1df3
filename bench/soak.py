"""Soak: many requests in a row through the functions the page calls, watching memory and temp files.

``python -m bench.soak [--requests 50] [--json PATH]`` loads the embedded model once, then sends
requests in a fixed cycle of five, as visitors would: a comparison with the measurements on (then
its export and the export loaded back), a refused setup, a crafted import, a comparison of other
methods, and a comparison at two budgets. After each request it collects garbage and reads the
process's resident memory (``VmRSS``); it prints the RSS after the first five requests and after
the last, and how many export folders are left in the temp folder (exports older than
``KVLAB_EXPORT_TTL_S`` are removed by the next export; the soak sets it to 2 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

PROMPT = "Summarize: the cat sat on the mat because the mat was warm and the sun was out. " * 3
BAD_IMPORT = '{"model": {}, "prompt": "<script>x</script>", "runs": [{"method": NaN}]}'


def rss_bytes() -> int:
    """Resident memory of this process, from /proc/self/status (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def export_dirs() -> int:
    from kvlab.ui.export import PREFIX

    return sum(1 for _ in Path(tempfile.gettempdir()).glob(PREFIX + "*"))


def _inputs(papers=(), baselines=("streaming",), budgets="0.5", new=6, maps=True) -> tuple:
    return ("embedded", PROMPT, list(papers), list(baselines), budgets, new, 0, None, maps, None, 0, "")


def request(dash, i: int, scratch: Path, new: int = 6) -> str:
    """The i-th request of the cycle (comparisons of ``new`` tokens); returns what happened ("ok", "refused")."""
    import gradio as gr

    from kvlab.ui import PageInputs

    kind = i % 5
    try:
        if kind == 0:
            *_, last = dash.compare(*_inputs(baselines=["streaming", "h2o"], new=new))
            files = dash.export(last[2])
            dash.load_json(next(f for f in files if f.endswith(".json")), "mean", None)
        elif kind == 1:
            dash.request(PageInputs(*_inputs(budgets="1.5")))
        elif kind == 2:
            bad = scratch / f"bad-{i}.json"
            bad.write_text(BAD_IMPORT)
            dash.load_json(str(bad), "mean", None)
        elif kind == 3:
            list(dash.compare(*_inputs(papers=["qjl"], baselines=["snapkv"], new=new)))
        else:
            list(dash.compare(*_inputs(budgets="0.5, 0.25", new=new)))
    except (gr.Error, ValueError):
        return "refused"
    return "ok"


def soak(lm, requests: int = 50, ttl_s: float = 2.0, on_request=None, new_tokens: int = 6) -> dict:
    """Run ``requests`` requests; returns RSS after each (bytes), export folders left, and the outcomes."""
    from kvlab.ui import Dashboard

    os.environ["KVLAB_EXPORT_TTL_S"] = str(ttl_s)
    dash = Dashboard(lm)
    rss, outcomes, t0 = [], [], time.perf_counter()
    old_tmp = tempfile.tempdir
    with tempfile.TemporaryDirectory() as tmp:
        tempfile.tempdir = tmp  # exports go here: the count is ours alone
        try:
            for i in range(requests):
                outcomes.append(request(dash, i, Path(tmp), new_tokens))
                gc.collect()
                rss.append(rss_bytes())
                if on_request:
                    on_request(i, rss[-1], outcomes[-1])
                if i % 5 == 4:
                    time.sleep(ttl_s / 2)  # let earlier exports age past the TTL
            left = export_dirs()
        finally:
            tempfile.tempdir = old_tmp
    return {
        "requests": requests,
        "seconds": round(time.perf_counter() - t0, 1),
        "rss_after_5": rss[min(4, len(rss) - 1)],
        "rss_after_last": rss[-1],
        "rss": rss,
        "export_dirs_left": left,
        "outcomes": outcomes,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import torch

    from kvlab.engine.loader import load_model

    torch.set_num_threads(int(os.environ.get("KVLAB_THREADS", "2")))
    lm = load_model("embedded")
    mib = 1024**2
    out = soak(
        lm, args.requests, on_request=lambda i, r, o: print(f"request {i + 1:3d}: {o:8s} RSS {r / mib:7.1f} MiB")
    )
    growth = out["rss_after_last"] / out["rss_after_5"] - 1
    print(
        f"RSS after 5: {out['rss_after_5'] / mib:.1f} MiB · after {args.requests}: "
        f"{out['rss_after_last'] / mib:.1f} MiB ({100 * growth:+.1f}%) · export folders left: "
        f"{out['export_dirs_left']} · {out['seconds']} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
