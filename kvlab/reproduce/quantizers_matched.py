"""TurboQuant, QJL, KIVI, PolarQuant and FP8 at matched bytes; TurboQuant's "quality neutral at 3.5 bits".

TurboQuant's abstract (Zandieh, Daliri, Hadian, Mirrokni, arXiv:2504.19874) reports "absolute quality
neutrality with 3.5 bits per channel and marginal quality degradation with 2.5 bits per channel" for KV-cache
quantization (LongBench and needle-in-a-haystack on 8B models, every token quantized). Here, on the embedded
model, the five quantizers run side by side at two operating points, each matched on the peak bytes the runs
really hold (measured from their tensors; matched when within 5% of each other):

* **A: TurboQuant's 3.5 bits.** ``turboquant`` at the paper's setting (``bits=3.5``: half the channels at 4
  bits, keys prod, values mse; ``residual=0``: every token quantized, generated ones too) sets the budget by
  its planned peak (``matched.peak_fraction``); ``qjl``, ``kivi`` and ``polarquant`` are planned by their own
  planners to that budget (bits, sketch size, full-precision window); ``fp8`` cannot hold it (e4m3 is half of
  the 16-bit cache) and is refused, which the table says. TurboQuant at 2.5 bits (``bits=2.5``, ``residual=0``)
  runs beside them at its own, smaller bytes.
* **B: FP8's bytes.** Budget 0.5, the serving engines' e4m3 cache with per-head scales and no window; every
  other quantizer is planned to it.

Matched: every run of a point is planned so that its peak meets TurboQuant's (A) or FP8's (B): PolarQuant,
which keeps generated tokens in 16 bits, gets the budget whose allowance at the last step is theirs; KIVI the
full-precision residual (and group, 32 or 16) that fills the budget best at the bits its planner picks; QJL,
whose plan counts its window full though it flushes in groups, a budget raised by the share its plan leaves
unused (measured per point and prompt length on random tensors). The table gives each run's peak bits per
number and how far apart the peaks are on each prompt (matched when within 5%).

Each prompt is one greedy comparison (the same prefill for every run): ``documents`` document-task prompts
with every run of both points, the attention relative error and the teacher-forced KL(exact || method)
along exact's tokens (``kvlab.measure.metrics.MetricsProbe``); and the calibrated tasks exact answers at this
length (pass key and needle at 1k tokens: 20 of 20 each in ``bench/results/calibrate-*.json``), ``seeds``
prompts per task, with point A and TurboQuant at 2.5 bits, scored. Means carry n and a 95% interval over
prompts (bootstrap; exact binomial for accuracy); comparisons are paired over the same prompts.

The claims are judged on the tasks, as ``qjl-3bit`` judges QJL's, on each embedded model (the task prompts
run on each of ``ReproductionSetup.models``; the documents on the first): "neutral" (3.5 bits) and "marginal
degradation" (2.5 bits) hold where the paired 95% interval of exact - TurboQuant's accuracy (exact McNemar)
lies below ``MARGIN``, do not hold where it lies above, and are inconclusive where it reaches it; only the
tasks a model's exact cache answers (``EXACT_MIN`` of their prompts) count. The paper's LongBench and 8B
models are not available offline, so the tasks are the calibrated ones the embedded models can do: a claim
made on 8B models and tested on 135M-270M ones is evidence about the method at that scale, not a verdict on
the paper.
"""

from __future__ import annotations

from kvlab.core.budgets import Budget, BudgetRefused, exact_bytes
from kvlab.core.statistics import mean_interval, paired_difference, score_interval
from kvlab.engine.specs import RunSpec
from kvlab.measure.metrics import MetricsProbe, ProbeSettings
from kvlab.methods.budget_search import planned
from kvlab.methods.kivi import kivi_worst_ratio
from kvlab.methods.registry import get
from kvlab.reproduce.claims import KVLAB, Point, Threshold, paper_claim
from kvlab.reproduce.common import CONTEXT, NOT_TESTABLE, Claim, Row, estimate_fields
from kvlab.reproduce.decisions import within_row
from kvlab.reproduce.matched import (
    MATCH_TOLERANCE,
    fill_kivi,
    held_fraction,
    peak_fraction,
    run_record,
    simulate_bytes,
    spread,
)
from kvlab.reproduce.report import Report, report
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.run import finish
from kvlab.tasks import make_task, prompt_ids

NAME = "quantizers-matched"
TITLE = "TurboQuant, QJL, KIVI, PolarQuant and FP8 at matched bytes; TurboQuant's quality neutrality at 3.5 bits"

CLAIMS = (
    Claim(
        "turboquant",
        "Abstract",
        "absolute quality neutrality with 3.5 bits per channel",
        "quality neutral at 3.5 bits per channel",
    ),
    Claim(
        "turboquant",
        "Abstract",
        "marginal quality degradation with 2.5 bits per channel",
        "marginal degradation at 2.5 bits per channel",
    ),
)

FULL = {
    "doc_length": 512,
    "documents": 4,
    "doc_new_tokens": 10,
    "length": 1024,
    "tasks": ("passkey", "needle"),
    "seeds": 10,
    "task_new_tokens": 10,
    "b": True,
}
QUICK = {
    "doc_length": 256,
    "documents": 1,
    "doc_new_tokens": 6,
    "length": 256,
    "tasks": ("passkey",),
    "seeds": 10,
    "task_new_tokens": 8,
    "b": True,
}
QUANTIZERS = ("turboquant", "qjl", "kivi", "polarquant", "fp8")
PAPER_35 = {"bits": 3.5, "residual": 0}  # the paper's 3.5-bit KV setting: every token quantized
PAPER_25 = {"bits": 2.5, "residual": 0}
FP8_BUDGET = 0.5
KIVI_GROUPS = (32, 16)  # KIVI's group sizes tried when filling a budget (the paper's 32 first)
POINTS = {"A": "TurboQuant's 3.5 bits", "B": f"FP8's bytes (budget {FP8_BUDGET})"}
MARGIN = 0.2  # "neutral" / "marginal": exact - TurboQuant's accuracy below this, with 95% confidence (kvlab's)
EXACT_MIN = 0.8  # a task informs only where exact answers this share of its prompts
QJL_FILL: dict = {}  # QJL's measured fill factors per (model, fraction, steps, prompt length), reused across prompts
NEUTRAL, MARGINAL = "turboquant:abstract-neutral-at-3.5-bits", "turboquant:abstract-marginal-at-2.5-bits"


def _tq_point(bits: str) -> Point:
    """TurboQuant's KV-cache operating point at ``bits`` per channel."""
    return Point(
        "Llama-3.1-8B-Instruct, Ministral-7B-Instruct",
        "LongBench, needle in a haystack (4k-104k)",
        f"{bits} bits per channel, every token quantized",
        "task scores",
    )


WITHIN = Threshold(
    f"exact's accuracy minus TurboQuant's, paired over the task prompts (exact McNemar interval): wholly below "
    f"{MARGIN}",
    KVLAB,
    "'neutral' (no difference) cannot be shown by a finite sample; kvlab reads both 'neutral' and 'marginal' as no "
    f"loss of {MARGIN} or more, the smallest margin 20 prompts can show",
)
TQ_KVLAB = (
    "turboquant at {} bits, residual 0, on pass key and needle at 1k tokens, each embedded model: evidence at that "
    "scale"
)
DECLARED = (
    paper_claim(NEUTRAL, CLAIMS[0], "at 3.5 bits per channel TurboQuant is quality neutral",
                _tq_point("3.5"), WITHIN, TQ_KVLAB.format("3.5")),
    paper_claim(MARGINAL, CLAIMS[1], "at 2.5 bits per channel TurboQuant degrades quality marginally",
                _tq_point("2.5"), WITHIN, TQ_KVLAB.format("2.5")),
)  # fmt: skip


def labels(with_b: bool = True) -> list[str]:
    """The runs of a prompt, in order: exact, the five at A, TurboQuant at 2.5 bits (and the five at B)."""
    a = ["exact", *(f"{m}@A" for m in QUANTIZERS), "turboquant-2.5"]
    return a + [f"{m}@B" for m in QUANTIZERS] if with_b else a


def _matched(info, method: str, fraction: float, n: int, steps: int, qjl_fill: dict) -> RunSpec:
    """``method`` planned so that its peak meets a streaming run's at budget ``fraction`` (``fraction`` x the exact
    cache of n + steps tokens): a prefill-only method gets the budget whose allowance at the last step is the
    same; KIVI the residual (and group, 32 or 16) that fills it best at the bits its planner picks
    (``matched.fill_kivi``); QJL a budget raised by what its plan leaves unused (its window is counted full but
    flushes in groups), measured per point and prompt length on random tensors (``matched.simulate_bytes``)."""
    budget = Budget(fraction=fraction)
    if not get(method).streaming:
        e0, e1 = exact_bytes(info, n), exact_bytes(info, n + steps)
        return RunSpec(method, Budget(fraction=min(1.0, (fraction * e1 - (e1 - e0)) / e0)))
    if method == "kivi":
        comp = get("kivi")(info, budget)
        comp.decode_steps = steps
        try:
            bits = planned(comp, n)["bits"]
        except BudgetRefused:  # the engine refuses it too, and the table says so
            return RunSpec("kivi", budget)
        best: tuple[float, dict] = (0.0, {})
        for group in KIVI_GROUPS:  # a smaller group moves the peak in smaller steps
            residual = fill_kivi(info, budget, n, steps, bits, group)
            if residual is not None:
                ratio = kivi_worst_ratio(info, budget, n, bits, group, residual, steps)
                best = max(best, (ratio, {"bits": bits, "group": group, "residual": residual}), key=lambda x: x[0])
        return RunSpec("kivi", budget, best[1])
    if method == "qjl":  # one correction of the budget by the fill its plan really reaches, per prompt length
        key = (str(info.id), round(fraction, 4), steps, n)
        if key not in qjl_fill:
            held = simulate_bytes(info, "qjl", budget, {}, n, steps)
            qjl_fill[key] = max(1.0, fraction / held_fraction(info, held, n))
        return RunSpec("qjl", Budget(fraction=min(1.0, round(fraction * qjl_fill[key], 4))))
    return RunSpec(method, budget)


def matched_runs(info, n_prompt: int, steps: int, with_b: bool, qjl_fill: dict) -> tuple[list[RunSpec], dict]:
    """The runs of ``labels(with_b)`` for one prompt of ``n_prompt`` tokens decoded ``steps`` steps, and each
    point's budget fraction (``qjl_fill``: QJL's measured fill factors, reused across prompts of one length)."""
    a = peak_fraction(info, "turboquant", PAPER_35, n_prompt, steps)
    low = peak_fraction(info, "turboquant", PAPER_25, n_prompt, steps)
    runs = [RunSpec("exact"), RunSpec("turboquant", Budget(fraction=a), PAPER_35)]
    runs += [_matched(info, m, a, n_prompt, steps, qjl_fill) for m in QUANTIZERS[1:]]
    runs.append(RunSpec("turboquant", Budget(fraction=low), PAPER_25))
    if with_b:
        runs += [_matched(info, m, FP8_BUDGET, n_prompt, steps, qjl_fill) for m in QUANTIZERS]
    return runs, {"A": a, "2.5": low, "B": FP8_BUDGET}


def measure_prompt(
    ctx: ReproductionSetup, ids: list[int], steps: int, task=None, qjl_fill: dict | None = None, b: bool = True
) -> dict:
    """One comparison on ``ids``: per label the peak bytes and bits, the score; on a document (no ``task``) point
    A, TurboQuant at 2.5 bits and (``b``) point B, with the attention error and teacher-forced KL; on a task
    prompt point A and TurboQuant at 2.5 bits, scored."""
    document = task is None
    with_b = document and b
    runs, budgets = matched_runs(ctx.info, len(ids), steps, with_b, {} if qjl_fill is None else qjl_fill)
    probes = [MetricsProbe(ProbeSettings(attn_error=True, fidelity=True, maps=False))] if document else []
    result = finish(ctx.compare(ids, runs, steps, probes), task)
    out: dict = {"tokens": len(ids), "budgets": budgets, "runs": {}}
    for label, spec, r in zip(labels(with_b), runs, result.runs):
        out["runs"][label] = {
            **run_record(r, spec, ctx.info),
            "task_score": r.metrics.get("task_score") if not r.error else None,
        }
    return out


def measure_unit(ctx: ReproductionSetup, cfg: dict, unit: tuple[str, int]) -> dict:
    """One prompt (``unit``: ``document`` or a task, and its seed): ``measure_prompt`` on it."""
    name, seed = unit
    encode = lambda t: ctx.loaded.encode(t)  # noqa: E731
    if name == "document":
        ids = ctx.loaded.encode(make_task("document", cfg["doc_length"], seed, encode).prompt)
        return measure_prompt(ctx, ids, cfg["doc_new_tokens"], qjl_fill=QJL_FILL, b=cfg["b"])
    task = make_task(name, cfg["length"], seed, encode)
    return measure_prompt(ctx, prompt_ids(ctx.loaded, task), cfg["task_new_tokens"], task, QJL_FILL)


def measure_model(ctx: ReproductionSetup, cfg: dict, documents: bool = True) -> dict[str, dict]:
    """Every prompt of ``cfg`` on ``ctx``'s model (the task prompts only, unless ``documents``): unit -> result,
    each one unit of ``Progress``."""
    units = [("document", s) for s in range(cfg["documents"] if documents else 0)]
    units += [(t, s) for t in cfg["tasks"] for s in range(cfg["seeds"])]
    got = ctx.each(NAME, cfg, __file__, measure_unit, units)
    return {f"{t}/{s}": g for (t, s), g in zip(units, got)}


def run(ctx: ReproductionSetup) -> Report:
    cfg = ctx.settings(NAME, FULL, QUICK)
    by_model = ctx.on_each_model(measure_model, cfg)
    prompts = by_model[ctx.label]
    rows = _rows(prompts, cfg)
    for label, mine in by_model.items():
        rows += claim_rows(mine, cfg, label)
    first = prompts["document/0"]
    setting = (
        f"{cfg['documents']} document prompt(s) ({first['tokens']} tokens, {cfg['doc_new_tokens']} greedy tokens) on "
        f"{ctx.label}, and {', '.join(cfg['tasks'])} x {cfg['seeds']} prompts of ~{cfg['length']} tokens "
        f"({cfg['task_new_tokens']} tokens) on {', '.join(by_model)}; A: every quantizer at TurboQuant 3.5 bits' peak "
        f"(budget ~{first['budgets']['A']:.3f}), "
        + (f"B: at budget {FP8_BUDGET}; " if cfg["b"] else "")
        + "TurboQuant 2.5 bits at its own peak"
    )
    notes = [
        "bits per number = 16 x the run's peak bytes / the exact cache's peak bytes over the same points; "
        "turboquant@A and turboquant-2.5 hold every token coded (residual 0), the others choose their own knobs"
    ]
    data = {"settings": cfg, "labels": labels(), "prompts": prompts,
            "models": {m: p for m, p in by_model.items() if m != ctx.label}}  # fmt: skip
    return report(ctx, __name__, setting, rows, data, _figure(prompts), notes)


def claim_rows(prompts: dict, cfg: dict, model: str = "") -> list[Row]:
    """TurboQuant at 3.5 and at 2.5 bits against exact on one model's task prompts (the tasks its exact cache
    answers): ``within_row``, one per claim."""
    able = []
    for name in cfg["tasks"]:
        units = [u for u in prompts if u.startswith(f"{name}/")]
        exact = _values(prompts, "exact", "task_score", units)
        if exact and sum(exact) / len(exact) >= EXACT_MIN:
            able += units
    out = []
    for label, bits, claim, paper in (
        ("turboquant@A", "3.5", NEUTRAL, "quality neutral (absolute)"),
        ("turboquant-2.5", "2.5", MARGINAL, "marginal degradation"),
    ):
        setting = f"TurboQuant {bits} bits vs exact: task accuracy ({len(able)} prompts of the tasks exact answers)"
        exact, mine = _values(prompts, "exact", "task_score", able), _values(prompts, label, "task_score", able)
        if not able:
            out.append(Row(setting, paper, "-", verdict=NOT_TESTABLE, claim=claim, model=model,
                           note="exact answers no task here: nothing to compare"))  # fmt: skip
        elif len(exact) != len(mine):
            out.append(Row(setting, paper, "-", kind=CONTEXT, claim=claim, model=model,
                           note="the runs did not all complete"))  # fmt: skip
        else:
            lead = f"exact {_mean(exact):.2f}, TurboQuant {_mean(mine):.2f}"
            out.append(within_row(setting, paper, exact, mine, ("exact", "turboquant"), MARGIN, claim, model=model,
                                  lead=lead))  # fmt: skip
    return out


def _values(prompts: dict, label: str, key: str, units: list[str] | None = None) -> list[float]:
    """``key`` of run ``label`` on each prompt that ran it (and measured the key)."""
    out = []
    for unit, p in prompts.items():
        r = p["runs"].get(label)
        if r is None or (units is not None and unit not in units):
            continue
        if r["ran"] and r.get(key) is not None:
            out.append(float(r[key]))
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _text(est, digits: int = 3) -> str:
    if est is None:
        return "-"
    if est.low is None:
        return f"{est.mean:.{digits}g}"
    return f"{est.mean:.{digits}g} [{est.low:.{digits}g}, {est.high:.{digits}g}]"


def _rows(prompts: dict, cfg: dict) -> list[Row]:
    rows: list[Row] = []
    docs = [u for u in prompts if u.startswith("document/")]
    tasks = [u for u in prompts if u not in docs]
    for point, title in POINTS.items():
        group = [f"{m}@{point}" for m in QUANTIZERS]
        ran = [x for x in group if _values(prompts, x, "peak_bits")]
        if not ran:  # point B not run (a setting for tests)
            continue
        refused = [x for x in group if x not in ran]
        gaps = []
        for p in prompts.values():
            peaks = [p["runs"][x]["peak_bytes"] for x in ran if x in p["runs"] and p["runs"][x]["ran"]]
            if len(peaks) > 1:
                gaps.append(spread(peaks))
        worst = max(gaps, default=0.0)
        lead = f"turboquant@{point}" if f"turboquant@{point}" in ran else ran[0]
        off = {}  # each run's largest gap from the point's reference peak, where it passes the tolerance
        for x in ran:
            dev = [
                p["runs"][x]["peak_bytes"] / p["runs"][lead]["peak_bytes"] - 1
                for p in prompts.values()
                if x in p["runs"] and p["runs"][x]["ran"] and p["runs"][lead]["ran"]
            ]
            far = max(dev, key=abs, default=0.0)
            if abs(far) > MATCH_TOLERANCE:
                off[x.split("@")[0]] = far
        bits = ", ".join(f"{x.split('@')[0]} {_mean(_values(prompts, x, 'peak_bits')):.2f}" for x in ran)
        why = "; ".join(
            f"{x.split('@')[0]} refused: {next(p['runs'][x]['error'] for p in prompts.values() if x in p['runs'])}"
            for x in refused
        )
        units = len(prompts) if point == "A" else len(docs)
        rows.append(
            Row(
                f"{point}: {title}: bits per number at the peak (mean over {units} prompts)",
                "matched bytes",
                bits + (f"; {why}" if why else ""),
                kind=CONTEXT,
                note=f"the peaks within {100 * worst:.1f}% of each other on every prompt "
                f"({'matched' if worst <= MATCH_TOLERANCE else f'not within {100 * MATCH_TOLERANCE:.0f}%'})"
                + "".join(f"; {m} up to {100 * v:+.0f}% from {lead.split('@')[0]}'s" for m, v in off.items()),
            )
        )
        for key, name in (("attn_rel_error_mean", "attention relative error"), ("kl_mean", "teacher-forced KL")):
            ests = {x.split("@")[0]: mean_interval(_values(prompts, x, key)) for x in ran}
            rows.append(
                Row(
                    f"{point}: {name}, mean over steps and layers (documents)",
                    "-",
                    "; ".join(f"{m} {_text(e)}" for m, e in ests.items()),
                    kind=CONTEXT,
                    n=len(docs),
                )
            )
        for x in ran:
            if x == f"turboquant@{point}":
                continue
            diff = paired_difference(
                _values(prompts, f"turboquant@{point}", "kl_mean"), _values(prompts, x, "kl_mean"),
                names=("turboquant", x.split("@")[0]),
            )  # fmt: skip
            if diff is not None:
                rows.append(
                    Row(
                        f"{point}: KL, TurboQuant - {x.split('@')[0]} (paired over documents)",
                        "-",
                        f"{diff.difference.text(digits=3)}: {diff.verdict}",
                        kind=CONTEXT,
                        **estimate_fields(diff.difference),
                    )
                )
        if point == "A":
            accs = {x.split("@")[0]: score_interval(_values(prompts, x, "task_score", tasks)) for x in ran}
            exact_acc = score_interval(_values(prompts, "exact", "task_score", tasks))
            rows.append(
                Row(
                    f"A: task accuracy ({', '.join(cfg['tasks'])}, {len(tasks)} prompts)",
                    "-",
                    f"exact {_text(exact_acc, 2)}; " + "; ".join(f"{m} {_text(e, 2)}" for m, e in accs.items()),
                    kind=CONTEXT,
                )
            )
    kl = mean_interval(_values(prompts, "turboquant-2.5", "kl_mean"))
    err = mean_interval(_values(prompts, "turboquant-2.5", "attn_rel_error_mean"))
    rows.append(
        Row(
            "TurboQuant 2.5 bits (its own bytes): attention error, KL (documents)",
            "-",
            f"{_mean(_values(prompts, 'turboquant-2.5', 'peak_bits')):.2f} bits per number; attention error "
            f"{_text(err)}; KL {_text(kl)}",
            kind=CONTEXT,
            n=len(docs),
        )
    )
    return rows


def _figure(prompts: dict):
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("teacher-forced KL against bits per number", "attention error"))
    colors = {"turboquant": "#d62728", "qjl": "#1f77b4", "kivi": "#2ca02c", "polarquant": "#9467bd", "fp8": "#8c564b"}
    for col, key in enumerate(("kl_mean", "attn_rel_error_mean"), 1):
        for m, c in colors.items():
            xs, ys = [], []
            for x in (f"{m}@A", *(["turboquant-2.5"] if m == "turboquant" else []), f"{m}@B"):
                bits, vals = _values(prompts, x, "peak_bits"), _values(prompts, x, key)
                if bits and vals:
                    xs.append(sum(bits) / len(bits))
                    ys.append(sum(vals) / len(vals))
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=m, line={"color": c}, showlegend=col == 1,
                            row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="bits per number at the peak")
    fig.update_yaxes(type="log")
    fig.update_layout(height=420, title=TITLE)
    return fig


__all__ = ["FULL", "QUICK", "labels", "matched_runs", "measure_prompt"]
