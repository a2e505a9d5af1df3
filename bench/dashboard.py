"""Benchmark: the dashboard's default comparison, through the same callback the page runs.

Default comparison: exact + the papers' methods at one budget (0.25) on the ~1k-token document
preset, 32 new tokens, on the embedded model. Reports the time until the first results appear on
the page (cards with bytes, after prefill + compression) and until the comparison completes,
with the measurements (attention error, KL, maps) on and off. Numbers, not pass/fail.

``--render``: the time to build every figure of a long, wide result instead. A needle task of
~4,000 tokens, exact + 12 methods at budget 0.25, 8 new tokens, every measurement on (maps of the
last 8 queries over every prompt position) is run once through ``kvlab.run.compare`` and saved
(``--result PATH``, reused when it exists); then each figure builder of the page is timed on it
(best of 3).

    python -m bench.dashboard [--threads 2] [--new 32] [--no-measure] [--json out.json]
    python -m bench.dashboard --render [--tokens 4000] [--result /tmp/render_4k.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def run_once(dash, prompt: str, papers: list[str], budget: str, new: int, measure: bool) -> dict:
    """One comparison through the page's callback (a preset's prompt is scored as its task)."""
    t0 = time.perf_counter()
    first = None
    yields = 0
    status, data = "", None
    for out in dash.compare(
        "embedded", prompt, papers, [], budget, new, 0, None, measure, None, 0, "", progress=lambda *a, **k: None
    ):
        yields += 1
        status = out[0]
        if isinstance(out[2], dict):
            data = out[2]
        if first is None and "kv-card" in str(out[1]):
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {
        "measure": measure,
        "first_results_s": round(first or total, 2),
        "complete_s": round(total, 2),
        "yields": yields,
        "status": status.split("kv-progress-msg'>")[-1].removesuffix("</div>"),
        "prefill_s": round((data or {}).get("timings", {}).get("prefill_s", 0.0), 2),
        "compress_s": {r["method"]: round(r["timings"]["compress_s"], 2) for r in (data or {}).get("runs", [])},
    }


RENDER_METHODS = (
    "qjl", "subgen", "subgen-kcenter", "balancekv", "scissorhands", "h2o",
    "snapkv", "pyramidkv", "uniform", "streaming", "kivi", "balancekv-stream",
)  # fmt: skip


def render_result(lm, tokens: int, path: str | None):
    """The long, wide result the render timing draws: loaded from ``path`` when it exists, else run and saved."""
    from kvlab.core.results import CompareResult
    from kvlab.engine.specs import GenerationSettings
    from kvlab.measure.metrics import ProbeSettings
    from kvlab.run import Comparison, compare
    from kvlab.tasks import make_task

    if path and os.path.exists(path):
        return CompareResult.load(path), 0.0
    task = make_task("needle", tokens, 0, lm.encode, depth=0.4)
    comparison = Comparison(
        task,
        ["exact", *RENDER_METHODS],
        ["0.25"],
        settings=GenerationSettings(max_new_tokens=8),
        measure=ProbeSettings(),
    )
    t0 = time.perf_counter()
    result = compare(lm, comparison)
    run_s = time.perf_counter() - t0
    if path:
        result.save(path)
    return result, run_s


def time_figures(result, lm, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds of each figure the page draws from ``result`` (and the page's whole render)."""
    from kvlab.report import comparison_figures as plots
    from kvlab.ui.cards import cards_html, kept_strip_html
    from kvlab.ui.dashboard import Dashboard

    strip = plots.compressed_runs(result)[0].label
    builders = {
        "gauges": lambda: plots.gauges(result),
        "bytes_per_step": lambda: plots.bytes_per_step(result),
        "error_per_step": lambda: plots.error_per_step(result, "mean"),
        "error_per_layer": lambda: plots.error_per_layer(result),
        "kl_and_agreement": lambda: plots.kl_and_agreement(result),
        "attention_heatmaps": lambda: plots.attention_heatmaps(result),
        "quality_vs_memory": lambda: plots.quality_vs_memory(result),
        "cards": lambda: cards_html(result, lm),
        "kept_strip": lambda: kept_strip_html(result, strip, lm),
    }
    out = {}
    for name, build in builders.items():
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            build()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(best, 4)
    out["figures_total"] = round(sum(v for k, v in out.items() if k not in ("cards", "kept_strip")), 4)
    data = result.to_json()
    t0 = time.perf_counter()
    Dashboard(lm).render(data, "mean", strip)
    out["page_render"] = round(time.perf_counter() - t0, 4)
    t0 = time.perf_counter()
    out["heatmap_json_bytes"] = len(plots.attention_heatmaps(result).to_json())
    out["heatmap_to_json_s"] = round(time.perf_counter() - t0, 4)
    return out


def render_main(args) -> int:
    from kvlab.engine.loader import load_model
    from kvlab.report.comparison_figures import compressed_runs, kept_of

    lm = load_model("embedded")
    result, run_s = render_result(lm, args.tokens, args.result)
    spans = {r.label: _spans(kept_of(r)) for r in compressed_runs(result)}
    timings = time_figures(result, lm)
    info = {
        "threads": args.threads,
        "prompt_tokens": result.prompt_tokens,
        "runs": len(result.runs),
        "compare_s": round(run_s, 1),
        "evicted_spans": spans,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "seconds": timings,
    }
    print(
        f"render of a {result.prompt_tokens}-token, {len(result.runs)}-run result with maps "
        f"({sum(spans.values())} evicted spans over the runs), load average {info['loadavg_1m']} on {info['cpus']} CPUs"
    )
    for name, sec in timings.items():
        print(f"  {name:20s} {sec}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


def _spans(kept: list[int] | None) -> int:
    """How many runs of consecutive evicted positions a kept list leaves (what one shape per span would draw)."""
    if not kept:
        return 0
    kept = sorted(set(kept))
    gaps = sum(1 for a, b in zip(kept, kept[1:]) if b > a + 1)
    return gaps + (kept[0] > 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("KVLAB_THREADS", 2)))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--no-measure", action="store_true", help="only the run without measurements")
    ap.add_argument("--json")
    ap.add_argument("--render", action="store_true", help="time the figures of a long, wide result instead")
    ap.add_argument("--tokens", type=int, default=4000, help="prompt tokens of the --render result")
    ap.add_argument("--result", help="--render: the result JSON to reuse (written when it does not exist)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if args.render:
        return render_main(args)
    from kvlab.engine.loader import load_model
    from kvlab.ui import DEFAULT_PRESET, Dashboard, default_methods, presets

    t0 = time.perf_counter()
    lm = load_model("embedded")
    load_s = time.perf_counter() - t0
    dash = Dashboard(lm)
    texts, dash.tasks = presets(lm)
    prompt = texts[DEFAULT_PRESET]
    papers, _ = default_methods()
    n_prompt = len(lm.encode(prompt))
    rows = []
    for measure in [False] if args.no_measure else [False, True]:
        rows.append(run_once(dash, prompt, papers, args.budget, args.new, measure))
    info = {
        "threads": args.threads,
        "prompt_tokens": n_prompt,
        "methods": ["exact", *papers],
        "budget": args.budget,
        "new_tokens": args.new,
        "load_s": round(load_s, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "runs": rows,
    }
    print(
        f"default comparison: exact + {', '.join(papers)} @ {args.budget}, {n_prompt} prompt tokens, "
        f"{args.new} new tokens, {args.threads} threads, load average {info['loadavg_1m']} on {info['cpus']} CPUs"
    )
    for r in rows:
        print(
            f"  measurements {'on ' if r['measure'] else 'off'}: first results {r['first_results_s']:6.1f} s · "
            f"complete {r['complete_s']:6.1f} s · prefill {r['prefill_s']} s · {r['status']}"
        )
        print(f"    compression s: {r['compress_s']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
