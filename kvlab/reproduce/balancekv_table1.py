"""BalanceKV Table 1: accuracy at equal budget against SnapKV, PyramidKV, StreamingLLM and uniform sampling.

The paper runs LongBench-E on Llama-3.1-8B-Instruct with every method at a compression rate of
0.25 (Sec. 4.2: b = 256, T = 2); "Our method achieves the highest average scores among all benchmark
approaches" (44.99 against 44.82, 44.57, 44.03, 42.51). Its Synthetic column (retrieval) is the
exception: there BalanceKV (58.46) is below SnapKV (59.60) and PyramidKV (59.68).

LongBench does not fit the embedded 135M model, so kvlab's retrieval tasks stand in for it: pass key
and needle at 1k tokens, the tasks and length at which exact answers 20 of 20 prompts
(``bench/results/calibrate-passkey.json``, ``calibrate-needle.json``), with the depth of the key
cycling over 0.1, 0.3, 0.5, 0.7, 0.9 as in the calibration. The protocol is the paper's
query-aware one (the whole prompt compressed), every method at the same budget (a fraction of the
exact cache's bytes, matched on the peak: every method here is prefill-only or holds its budget
while decoding), scored by accuracy (exact match of the first number), the paper's kind of metric.
BalanceKV runs as ``balancekv@paper`` (the paper's T = 2, b = 256) and, as kvlab's own control,
with kvlab's defaults.

The rates: the paper's 0.25, at which the 135M model loses the answer under every compressed
method (a 5-digit key comes back with 4 digits right), and ``rates`` above it at which the methods
can answer, so that the comparison is informative. At each rate the claim holds where BalanceKV is
above every baseline with a paired 95% interval (over the same prompts) that excludes zero, does not
hold where some baseline is above it so, and is inconclusive otherwise, in particular where every
compressed method scores 0. Only the tasks on which exact answers at least ``EXACT_MIN`` of the
prompts are judged (a task exact fails says nothing about compression).

Each prompt is one unit of ``Progress``: an interrupted run resumes at the next prompt.
"""

from __future__ import annotations

import difflib
import time
from dataclasses import replace

from kvlab.core.budgets import Budget
from kvlab.core.statistics import binomial_interval, paired_difference
from kvlab.engine.specs import RunSpec
from kvlab.reproduce.common import CLAIM, CONTEXT, CONTROL, INCONCLUSIVE, Claim, Progress, Report, Row, estimate_fields
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.tasks import make_task, prompt_ids, score_result

NAME = "balancekv-table1"
TITLE = "BalanceKV Table 1: accuracy at equal budget against SnapKV, PyramidKV, StreamingLLM, uniform"

CLAIMS = (
    Claim("balancekv", "Table 1, average", "BALANCEKV\t36.97\t42.37\t23.82\t65.49\t58.46\t42.82\t44.99", "44.99"),
    Claim("balancekv", "Table 1, average", "SnapKV\t38.23\t42.61\t19.07\t64.65\t59.60\t43.28\t44.57", "44.57"),
    Claim("balancekv", "Table 1, average", "PyramidKV\t36.80\t41.54\t18.91\t64.88\t59.68\t42.38\t44.03", "44.03"),
    Claim("balancekv", "Table 1, average", "StreamingLLM\t27.86\t39.05\t20.70\t66.16\t58.37\t42.91\t42.51", "42.51"),
    Claim("balancekv", "Table 1, average", "Uniform\t37.17\t42.66\t24.31\t65.09\t58.30\t41.40\t44.82", "44.82"),
    Claim("balancekv", "Sec. 4.2", "We set $b = 256$ and $T = 2$", "b = 256, T = 2"),
    Claim(
        "balancekv",
        "Sec. 4.2",
        "Our method achieves the highest average scores among all benchmark approaches",
        "BalanceKV highest on average",
    ),
)
PAPER = {
    "exact": "48.63",
    "balancekv@paper": "44.99",
    "balancekv": "44.99",
    "snapkv": "44.57",
    "pyramidkv": "44.03",
    "streaming": "42.51",
    "uniform": "44.82",
}
SYNTHETIC = {"balancekv": "58.46", "snapkv": "59.60", "pyramidkv": "59.68", "streaming": "58.37", "uniform": "58.30"}
BASELINES = ("snapkv", "pyramidkv", "streaming", "uniform")
BALANCEKV = {"balancekv@paper": CLAIM, "balancekv": CONTROL}  # the paper's configuration; kvlab's defaults
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # the key's depth, cycled over the seeds as in the calibration
PAPER_RATE = "0.25"

FULL = {"tasks": ["passkey", "needle"], "length": 1024, "seeds": 15, "rates": ["0.25", "0.75"], "max_new_tokens": 8}
QUICK = {"tasks": ["passkey"], "length": 512, "seeds": 2, "rates": ["0.25", "0.75"], "max_new_tokens": 8}
EXACT_MIN = 0.8  # a task informs only where exact answers this share of its prompts


def runs_of(cfg: dict) -> list[tuple[str, str, RunSpec]]:
    """(method, rate, run) of every compressed run: each method of ``PAPER`` at each rate."""
    return [(m, r, RunSpec(m, Budget.parse(r))) for r in cfg["rates"] for m in PAPER if m != "exact"]


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    compressed = runs_of(cfg)
    methods = [m for m in PAPER if m != "exact"]
    progress = Progress.of(ctx, NAME, cfg, __file__)
    prompts: list[dict] = []
    for task_name in cfg["tasks"]:
        for seed in range(cfg["seeds"]):
            unit = f"{task_name}-{seed}"
            got = progress.get(unit)
            if got is None:
                depth = DEPTHS[seed % len(DEPTHS)]
                task = make_task(task_name, cfg["length"], seed, lambda t: ctx.loaded.encode(t), depth)
                ids = prompt_ids(ctx.loaded, task)
                ctx.log(
                    f"{NAME}: {task_name} seed {seed} (depth {depth}), {len(ids)} tokens, {len(compressed) + 1} runs"
                )
                result = ctx.compare(ids, [RunSpec("exact"), *(s for _, _, s in compressed)], cfg["max_new_tokens"])
                score_result(task, result)
                got = {"task": task_name, "seed": seed, "depth": depth, "tokens": len(ids), "runs": {}}
                for (m, r), res in zip([("exact", "1"), *((m, r) for m, r, _ in compressed)], result.runs):
                    fr = [b / e for b, e in zip(res.kv_bytes_per_step, res.exact_kv_bytes_per_step) if e]
                    got["runs"][m if m == "exact" else f"{m}@{r}"] = {
                        "score": float(res.metrics.get("task_score") or 0.0),
                        "edit_similarity": edit_similarity(str(task.answer), res.text),
                        "peak": max(fr) if fr else None,
                        "text": res.text,
                        "error": res.error,
                    }
                progress.put(unit, got)
            prompts.append(got)
    progress.clear()

    def scores(label: str, task: str) -> list[float]:
        return [p["runs"][label]["score"] for p in prompts if p["task"] == task]

    exact_acc = {t: _mean(scores("exact", t)) for t in cfg["tasks"]}
    informative = [t for t in cfg["tasks"] if exact_acc[t] >= EXACT_MIN]
    on = ", ".join(informative) or "no task exact can do"
    xs = [x for t in informative for x in scores("exact", t)]
    rows = [
        Row(
            "exact",
            f"{PAPER['exact']} (LongBench avg)",
            f"accuracy {_mean(xs):.2f} on {on} (" + ", ".join(f"{t} {exact_acc[t]:.2f}" for t in cfg["tasks"]) + ")",
            note="the reference",
            **estimate_fields(_binomial(xs)),
        )
    ]
    data_rates: dict = {}
    for rate in cfg["rates"]:
        # per prompt, the tasks exact can do: the samples every comparison pairs
        per_prompt = {m: [x for t in informative for x in scores(f"{m}@{rate}", t)] for m in methods}
        errors = {
            m: p["runs"][f"{m}@{rate}"]["error"] for p in prompts for m in methods if p["runs"][f"{m}@{rate}"]["error"]
        }
        peaks = {
            m: max((p["runs"][f"{m}@{rate}"]["peak"] or 0.0 for p in prompts), default=float("nan")) for m in methods
        }
        for m in methods:
            per_task = ", ".join(f"{t} {_mean(scores(f'{m}@{rate}', t)):.2f}" for t in cfg["tasks"])
            rows.append(
                Row(
                    f"{m} at rate {rate} (peak {peaks[m]:.3f} of exact)",
                    f"{PAPER[m]} (LongBench avg, rate 0.25)",
                    f"accuracy {_mean(per_prompt[m]):.2f} on {on} ({per_task})",
                    kind=CONTEXT,
                    note=errors.get(m, ""),
                    **estimate_fields(_binomial(per_prompt[m])),
                )
            )
        rows += [_claim_row(m, per_prompt, informative, errors, kind, rate) for m, kind in BALANCEKV.items()]
        data_rates[rate] = {
            "accuracy": {m: _mean(v) for m, v in per_prompt.items()},
            "per_prompt": per_prompt,
            "peak_fraction": peaks,
            "edit_similarity": {
                m: _mean([p["runs"][f"{m}@{rate}"]["edit_similarity"] for p in prompts]) for m in methods
            },
            "errors": errors,
        }
    n = len(prompts)
    setting = (
        f"tasks {', '.join(cfg['tasks'])} at ~{cfg['length']} tokens, {cfg['seeds']} seed(s) each ({n} prompts, "
        f"depths {', '.join(map(str, DEPTHS))} in turn), query-aware, rates {', '.join(cfg['rates'])} of the exact "
        f"cache's bytes (peak), {cfg['max_new_tokens']} greedy tokens, accuracy paired over the prompts; the paper: "
        f"LongBench-E, Llama-3.1-8B-Instruct, rate {PAPER_RATE}"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {
            "settings": cfg,
            "exact_accuracy": exact_acc,
            "informative": informative,
            "rates": data_rates,
            "prompts": prompts,
        },
        list(CLAIMS),
        _figure(data_rates, methods, cfg["rates"]),
        time.perf_counter() - t0,
    )


def _claim_row(
    m: str, per_prompt: dict, informative: list[str], errors: dict, kind: str = CLAIM, rate: str = PAPER_RATE
) -> Row:
    """BalanceKV ``m`` above every baseline at ``rate``: paired on the prompts of the tasks exact can do; a
    ``kind`` row (the paper's claim, or kvlab's control for kvlab's own configuration)."""
    row = _verdict_row(m, per_prompt, informative, errors)
    row.setting = f"rate {rate}: {row.setting}"
    if rate != PAPER_RATE:
        row.note = (row.note + "; " if row.note else "") + f"the paper's rate is {PAPER_RATE}"
    return replace(row, kind=kind)


def _verdict_row(m: str, per_prompt: dict, informative: list[str], errors: dict) -> Row:
    paper = "44.99 > 44.82, 44.57, 44.03, 42.51 (average; Synthetic: 58.46 < 59.60, 59.68)"
    setting = f"{m} above every baseline (accuracy, paired on the same prompts)"
    if m in errors or any(b in errors for b in BASELINES):
        return Row(setting, paper, "a run failed", verdict=INCONCLUSIVE, note=errors.get(m, "a baseline failed"))
    if not informative:
        return Row(setting, paper, "-", verdict=INCONCLUSIVE, note="exact answers no task here: nothing to compare")
    compressed = [m, *BASELINES]
    if all(x == 0.0 for c in compressed for x in per_prompt[c]):
        return Row(
            setting,
            paper,
            "every compressed method scores 0",
            verdict=INCONCLUSIVE,
            n=len(per_prompt[m]),
            note="inconclusive at this scale: every compressed method scores 0 on every prompt",
        )
    diffs = {b: paired_difference(per_prompt[m], per_prompt[b], names=(m, b)) for b in BASELINES}
    text = "; ".join(f"vs {b}: {d.difference.text()} ({d.verdict})" for b, d in diffs.items() if d is not None)
    below = [b for b, d in diffs.items() if d is not None and d.verdict == f"{b} higher"]
    above = [b for b, d in diffs.items() if d is not None and d.verdict == f"{m} higher"]
    # the row's interval: that of the difference to the strongest baseline (the comparison that binds)
    nearest = min((d for d in diffs.values() if d is not None), key=lambda d: d.difference.mean, default=None)
    spread = estimate_fields(nearest.difference if nearest is not None else None)
    if below:
        return Row(setting, paper, text, False, f"below {', '.join(below)}", **spread)
    if len(above) == len(BASELINES):
        return Row(setting, paper, text, True, **spread)
    return Row(setting, paper, text, verdict=INCONCLUSIVE, note="a paired interval includes zero", **spread)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _binomial(xs: list[float]):
    return binomial_interval(int(sum(xs)), len(xs)) if xs and set(xs) <= {0.0, 1.0} else None


def edit_similarity(gold: str, text: str) -> float:
    """difflib's ratio between ``gold`` and the generated text's first ``len(gold) + 2`` characters
    (leading spaces dropped): 1 for the exact answer, partial credit for a near miss (kept in the JSON as
    context; it is not the paper's metric and judges nothing)."""
    return difflib.SequenceMatcher(None, gold, text.lstrip()[: len(gold) + 2]).ratio()


def _figure(data_rates: dict, methods: list[str], rates: list[str]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for rate in rates:
        acc = data_rates[rate]["accuracy"]
        fig.add_bar(x=methods, y=[acc[m] for m in methods], name=f"kvlab, rate {rate} (accuracy)")
    fig.add_bar(x=methods, y=[float(PAPER[m]) / 100 for m in methods], name="paper, rate 0.25 (LongBench avg / 100)")
    fig.update_layout(height=380, title=TITLE, yaxis={"title": "score", "range": [0, 1]}, barmode="group")
    return fig
