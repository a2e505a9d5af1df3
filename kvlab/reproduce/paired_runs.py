"""Quantizer settings compared on the same prompts: one greedy comparison per prompt, every setting a row of it.

What the quantizer reproductions (``kv-asymmetric-bits``, ``turboquant-qjl-residual``) share:

* ``task_units``, ``task_for``: pass-key and needle prompts (kvlab's own tasks, ``seeds`` of each at ``length``
  tokens), each asked inside the prompt; their answers are short, so a greedy answer is compared whole;
* ``measure``: one comparison of exact and the runs on a prompt, with the attention relative error and the
  teacher-forced KL(exact || run) along exact's tokens (``kvlab.measure.metrics.MetricsProbe``), each run's
  peak bytes, and its **agreement with exact**: 1 when its greedy tokens are exact's, token for token, else 0
  (defined on every prompt, whether exact answers right or not);
* ``paired``: two runs' values on the prompts both ran, their paired difference with its 95% interval
  (``kvlab.core.statistics.paired_difference``: bootstrap over prompts, or the exact McNemar-style interval
  for agreement, which is 0 or 1);
"""

from __future__ import annotations

from kvlab.core.statistics import PairedDifference, mean_interval, paired_difference, score_interval
from kvlab.engine.specs import RunSpec
from kvlab.measure.metrics import MetricsProbe, ProbeSettings
from kvlab.reproduce.matched import run_record
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.tasks import make_task, prompt_ids

METRICS = {
    "attn_rel_error_mean": "attention relative error",
    "kl_mean": "teacher-forced KL",
    "agree": "agreement with exact's answer",
}


def task_units(tasks: tuple[str, ...] | list[str], seeds: int) -> list[str]:
    """The prompts' names, ``task/seed``: ``seeds`` of each task, seeds 0.."""
    return [f"{name}/{seed}" for name in tasks for seed in range(seeds)]


def task_for(ctx: ReproductionSetup, unit: str, length: int):
    """The task of prompt ``unit`` (``task/seed``) at ``length`` tokens, on ``ctx``'s model."""
    name, seed = unit.rsplit("/", 1)
    return make_task(name, length, int(seed), lambda t: ctx.loaded.encode(t))


def measure(ctx: ReproductionSetup, task, labels: list[str], runs: list[RunSpec], steps: int) -> dict:
    """One comparison of ``runs`` (the first must be exact) on ``task``'s prompt: per label its bytes, errors,
    KL, agreement with exact and text."""
    ids = prompt_ids(ctx.loaded, task)
    probes = [MetricsProbe(ProbeSettings(attn_error=True, fidelity=True, maps=False))]
    result = ctx.compare(ids, runs, steps, probes)
    exact = result.runs[0]
    out: dict = {"tokens": len(ids), "runs": {}}
    for label, spec, r in zip(labels, runs, result.runs):
        ran = not r.error
        out["runs"][label] = {
            **run_record(r, spec, ctx.info),
            "agree": float(r.token_ids == exact.token_ids) if ran else None,
            "answer_right": task.score(r.text) if ran and task.answer is not None else None,
        }
    return out


def values(prompts: dict, label: str, key: str) -> list[float]:
    """``key`` of run ``label`` on each prompt that ran it."""
    out = []
    for p in prompts.values():
        r = p["runs"].get(label)
        if r is not None and r["ran"] and r.get(key) is not None:
            out.append(float(r[key]))
    return out


def pair_values(prompts: dict, a: str, b: str, key: str) -> tuple[list[float], list[float]]:
    """``key`` of runs ``a`` and ``b`` on the prompts both ran (with ``key`` measured), in the same order."""
    xs, ys = [], []
    for p in prompts.values():
        ra, rb = p["runs"].get(a), p["runs"].get(b)
        if ra and rb and ra["ran"] and rb["ran"] and ra.get(key) is not None and rb.get(key) is not None:
            xs.append(float(ra[key]))
            ys.append(float(rb[key]))
    return xs, ys


def paired(prompts: dict, a: str, b: str, key: str) -> PairedDifference | None:
    """Runs ``a`` and ``b`` on the prompts both ran (with ``key`` measured): the mean of a - b, paired."""
    xs, ys = pair_values(prompts, a, b, key)
    return paired_difference(xs, ys, names=(a, b)) if xs else None


def summary(prompts: dict, label: str, key: str):
    """The mean of ``key`` over the prompts with n and its 95% interval (exact binomial for agreement)."""
    vs = values(prompts, label, key)
    return score_interval(vs) if key in ("agree", "answer_right") else mean_interval(vs)


def text(est, digits: int = 3) -> str:
    """``mean [low, high]`` (or the mean alone, or "-")."""
    if est is None:
        return "-"
    if est.low is None:
        return f"{est.mean:.{digits}g}"
    return f"{est.mean:.{digits}g} [{est.low:.{digits}g}, {est.high:.{digits}g}]"


__all__ = ["METRICS", "measure", "pair_values", "paired", "summary", "task_for", "task_units", "text", "values"]
