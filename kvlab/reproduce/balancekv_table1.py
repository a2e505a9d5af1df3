"""BalanceKV Table 1: the calibrated tasks at budget 0.25 against SnapKV, PyramidKV, StreamingLLM and uniform.

The paper runs LongBench-E on Llama-3.1-8B at a compression rate of 0.25 (Sec. 4.2: T = 2, b = 256);
its Table 1 puts BalanceKV's average (44.99) above PyramidKV, SnapKV, StreamingLLM and uniform
sampling. LongBench does not fit the embedded 135M model, so kvlab's own calibrated retrieval tasks
stand in for it (kvlab/tasks/builtin.py, docs/tasks.md: exact answers passkey and needle at 1k in 20/20
prompts, multikey in 15/20), in the query-aware protocol the paper uses, each method at budget
0.25 of the exact cache's bytes (matched on the peak: every method here is prefill-only or holds its
budget while decoding). BalanceKV runs as ``balancekv@paper`` (the paper's T = 2) and with kvlab's
defaults (T from the budget, windows of up to a quarter of it).

At 0.25 the 135M model often loses the exact answer under every method (a 5-digit key comes back
with 4 digits right). The claim is judged on accuracy, the paper's kind of metric, and only on the
tasks where exact answers at least ``EXACT_MIN`` of the prompts (a task exact fails says nothing about
compression): BalanceKV against each baseline, paired on the same prompts. It holds where BalanceKV
is above every baseline with a paired 95% interval that excludes zero, does not hold where some
baseline is above it with such an interval, and is inconclusive otherwise, in particular when every
compressed method scores 0. The answers' edit similarity to the gold answer is recorded in the
JSON as context only (it is not the paper's metric and judges nothing).
"""

from __future__ import annotations

import difflib
import time

from kvlab.core.budgets import Budget
from kvlab.core.statistics import binomial_interval, paired_difference
from kvlab.engine.specs import RunSpec
from kvlab.reproduce.common import CONTEXT, INCONCLUSIVE, Claim, Report, Row, estimate_fields
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.tasks import make_task, prompt_ids, score_result

NAME = "balancekv-table1"
TITLE = "BalanceKV Table 1: calibrated tasks at 0.25 against SnapKV, PyramidKV, StreamingLLM, uniform"

CLAIMS = (
    Claim("balancekv", "Table 1, average", "BALANCEKV\t36.97\t42.37\t23.82\t65.49\t58.46\t42.82\t44.99", "44.99"),
    Claim("balancekv", "Table 1, average", "SnapKV\t38.23\t42.61\t19.07\t64.65\t59.60\t43.28\t44.57", "44.57"),
    Claim("balancekv", "Table 1, average", "PyramidKV\t36.80\t41.54\t18.91\t64.88\t59.68\t42.38\t44.03", "44.03"),
    Claim("balancekv", "Table 1, average", "StreamingLLM\t27.86\t39.05\t20.70\t66.16\t58.37\t42.91\t42.51", "42.51"),
    Claim("balancekv", "Table 1, average", "Uniform\t37.17\t42.66\t24.31\t65.09\t58.30\t41.40\t44.82", "44.82"),
    Claim("balancekv", "Sec. 4.2", "We set $b = 256$ and $T = 2$", "b = 256, T = 2"),
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
BASELINES = ("snapkv", "pyramidkv", "streaming", "uniform")

FULL = {"tasks": ["passkey", "needle", "multikey"], "length": 1024, "seeds": 2, "budget": "0.25", "max_new_tokens": 12}
QUICK = {"tasks": ["passkey", "needle"], "length": 512, "seeds": 1, "budget": "0.25", "max_new_tokens": 10}
EXACT_MIN = 0.8  # a task informs only where exact answers this share of its prompts


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    budget = Budget.parse(cfg["budget"])
    methods = list(PAPER)
    scores: dict[str, dict[str, list[float]]] = {t: {m: [] for m in methods} for t in cfg["tasks"]}
    sims: dict[str, dict[str, list[float]]] = {t: {m: [] for m in methods} for t in cfg["tasks"]}
    peak: dict[str, list[float]] = {m: [] for m in methods}
    errors: dict[str, str] = {}
    for task_name in cfg["tasks"]:
        for seed in range(cfg["seeds"]):
            task = make_task(task_name, cfg["length"], seed, lambda t: ctx.loaded.encode(t))
            ids = prompt_ids(ctx.loaded, task)
            ctx.log(f"{NAME}: {task_name} seed {seed}, {len(ids)} tokens")
            runs = [RunSpec("exact")] + [RunSpec(m, budget) for m in methods[1:]]
            result = ctx.compare(ids, runs, cfg["max_new_tokens"])
            score_result(task, result)
            for m, r in zip(methods, result.runs):
                if r.error:
                    errors[m] = r.error
                    continue
                scores[task_name][m].append(float(r.metrics.get("task_score") or 0.0))
                sims[task_name][m].append(edit_similarity(str(task.answer), r.text))
                fr = [b / e for b, e in zip(r.kv_bytes_per_step, r.exact_kv_bytes_per_step) if e]
                peak[m].append(max(fr) if fr else float("nan"))

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    acc = {t: {m: mean(v) for m, v in by.items()} for t, by in scores.items()}
    avg = {m: mean([acc[t][m] for t in cfg["tasks"]]) for m in methods}
    sim = {t: {m: mean(v) for m, v in by.items()} for t, by in sims.items()}
    avg_sim = {m: mean([sim[t][m] for t in cfg["tasks"]]) for m in methods}
    held = {m: max(v) if v else float("nan") for m, v in peak.items()}
    informative = [t for t in cfg["tasks"] if acc[t]["exact"] >= EXACT_MIN]
    # per prompt, the tasks exact can do: the samples every comparison pairs (None where a run failed)
    per_prompt = {m: [x for t in informative for x in scores[t][m]] for m in methods}
    rows = []
    for m in methods:
        per_task = ", ".join(f"{t} {acc[t][m]:.2f}" for t in cfg["tasks"])
        matched = "" if m == "exact" else f"; peak {held[m]:.3f} of exact"
        xs = per_prompt[m]
        est = binomial_interval(int(sum(xs)), len(xs)) if xs and set(xs) <= {0.0, 1.0} else None
        rows.append(
            Row(
                m,
                f"{PAPER[m]} (LongBench avg)",
                f"accuracy {mean(xs):.2f} on {', '.join(informative) or 'no task exact can do'} ({per_task}){matched}",
                note=errors.get(m, "the reference" if m == "exact" else ""),
                **estimate_fields(est),
            )
        )
    for m in ("balancekv@paper", "balancekv"):
        rows.append(_claim_row(m, per_prompt, informative, errors))
    n = cfg["seeds"] * len(cfg["tasks"])
    rows.append(
        Row(
            "edit similarity of the answers to the gold answer (average over every task)",
            "(not the paper's metric)",
            ", ".join(f"{m} {avg_sim[m]:.2f}" for m in methods),
            kind=CONTEXT,
            note="context only: judges nothing",
        )
    )
    setting = (
        f"tasks {', '.join(cfg['tasks'])} at ~{cfg['length']} tokens, {cfg['seeds']} seed(s) each ({n} prompts), "
        f"query-aware, budget {cfg['budget']} of the exact cache's bytes (peak), {cfg['max_new_tokens']} greedy "
        f"tokens; the paper: LongBench-E, Llama-3.1-8B-Instruct, rate 0.25"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {
            "settings": cfg,
            "accuracy": acc,
            "average": avg,
            "edit_similarity": sim,
            "average_edit_similarity": avg_sim,
            "peak_fraction": held,
            "errors": errors,
        },
        list(CLAIMS),
        _figure(avg, methods),
        time.perf_counter() - t0,
    )


def _claim_row(m: str, per_prompt: dict, informative: list[str], errors: dict) -> Row:
    """BalanceKV ``m`` >= every baseline: paired on the prompts of the tasks exact can do."""
    paper = "44.99 >= 44.82, 44.57, 44.03, 42.51"
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
    if below:
        return Row(setting, paper, text, False, f"below {', '.join(below)}", n=len(per_prompt[m]))
    if len(above) == len(BASELINES):
        return Row(setting, paper, text, True, n=len(per_prompt[m]))
    return Row(
        setting,
        paper,
        text,
        verdict=INCONCLUSIVE,
        n=len(per_prompt[m]),
        note="a paired interval includes zero",
    )


def edit_similarity(gold: str, text: str) -> float:
    """difflib's ratio between ``gold`` and the generated text's first ``len(gold) + 2`` characters
    (leading spaces dropped): 1 for the exact answer, partial credit for a near miss."""
    return difflib.SequenceMatcher(None, gold, text.lstrip()[: len(gold) + 2]).ratio()


def _figure(avg: dict, methods: list[str]):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_bar(x=methods, y=[avg[m] for m in methods], name="kvlab (calibrated tasks, accuracy)")
    fig.add_bar(x=methods, y=[float(PAPER[m]) / 100 for m in methods], name="paper (LongBench avg / 100)")
    fig.update_layout(height=380, title=TITLE, yaxis={"title": "score", "range": [0, 1]}, barmode="group")
    return fig
