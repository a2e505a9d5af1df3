"""QJL Tables 1-2: QJL at about 3 bits per number against KIVI and the exact cache, at matched bytes.

The paper's configuration of QJL, scaled to head_dim d: m = 2 d sign bits per key (2 x that on
the first 15/32 of the layers), outlier channels d / 16 per group of 32 tokens sketched by an
outlier sketch as large as the main one, values at 2 bits in groups of 32 (fp16 scale + min),
the last 128 tokens at full precision, and the query split into inlier / outlier channels
(``split_query``, as the authors' kernel does). Every knob of it is passed explicitly, so the run
is the paper's configuration whatever the defaults.

The paper sets "hyper-parameters of KIVI and QJL so that their bits per FPN become 3"; kvlab
compares them at the same **peak bytes** instead (``kvlab.reproduce.matched``): the paper's QJL's
peak over the run sets a budget, and at that budget KIVI-2, KIVI-3 and KIVI-4 (groups of 32) get
the full-precision residual that fills it best (``matched.fill_kivi``),
and QJL without outliers (same window, values and
first-layer sketch) the largest sketch m that fits. Each run's peak and mean bytes are measured
from the tensors held; the table says how far apart the peaks are (matched within 5%). On one
greedy generation of the document task: teacher-forced KL(exact || method), top-1 agreement and
perplexity along the exact run's tokens, and the attention relative error
(``kvlab.measure.metrics.MetricsProbe``); then the calibrated passkey and needle tasks, each prompt with
its own matched budget.

Bits per number = the exact cache's bits x peak bytes / the exact cache's peak bytes over the run
(the mean likewise), the full-precision residual included. The paper's "3 bits per FPN" leaves the
128-token full-precision window out; on a ~1k-token prompt that window alone is about 2 of the bits
held, so the table reports both: the bits of the whole cache (what is matched) and the bits of the
tokens outside the full-precision window, after compression. The paper never compares against KIVI
at 3 or 4 bits: those runs are reported as context, not tested as claims. Task accuracy is judged
as the paper's "comparable": the paired 95% interval of exact - QJL over the prompts lies below
``MARGIN``.
"""

from __future__ import annotations

import time

from kvlab.core.budgets import Budget
from kvlab.core.statistics import paired_difference
from kvlab.engine.specs import RunSpec
from kvlab.measure.metrics import MetricsProbe, ProbeSettings
from kvlab.reproduce.common import CONTEXT, CONTROL, INCONCLUSIVE, Claim, Report, Row, estimate_fields, fmt
from kvlab.reproduce.matched import (
    MATCH_TOLERANCE,
    fill_kivi,
    held_fraction,
    memory,
    peak_fraction,
    simulate_bytes,
    spread,
)
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.run import finish
from kvlab.tasks import make_task, prompt_ids

NAME = "qjl-3bit"
TITLE = "QJL Tables 1-2: QJL at ~3 bits per number vs KIVI-2/3/4 and QJL without outliers at matched bytes"

CLAIMS = (
    Claim(
        "qjl",
        "Sec. 5 (LongBench)",
        "we choose proper hyper-parameters of KIVI and QJL so that their bits per FPN become 3",
        "QJL and KIVI at 3 bits per number",
    ),
    Claim("qjl", "Table 2, Llama-2-7B, Lambda-OpenAI, FP16", "<td>73.90</td>", "exact 73.90"),
    Claim("qjl", "Table 2, Llama-2-7B, Lambda-OpenAI, KIVI / QJL", "<td>73.88</td>", "KIVI 73.88, QJL 73.88"),
    Claim("qjl", "Table 1, NarrativeQA F1, FP16", "<td>20.79</td>", "exact 20.79"),
    Claim("qjl", "Table 1, NarrativeQA F1, KIVI", "<td>20.96</td>", "KIVI 20.96"),
    Claim("qjl", "Table 1, NarrativeQA F1, QJL", "<td><b>21.83</b></td>", "QJL 21.83"),
    Claim(
        "qjl",
        "Table 2 caption",
        "our QJL with 3 bits per FPN performs comparably to the baseline with 16 bits per FPN",
        "QJL at 3 bits ~ exact",
    ),
)

FULL = {
    "length": 1024,
    "max_new_tokens": 32,
    "seed": 0,
    "tasks": ("passkey", "needle"),
    "task_length": 1024,
    "task_seeds": 5,
}
QUICK = {
    "length": 320,
    "max_new_tokens": 8,
    "seed": 0,
    "tasks": ("passkey", "needle"),
    "task_length": 256,
    "task_seeds": 1,
}
LABELS = ("exact", "qjl", "qjl-no-outliers", "kivi-2", "kivi-3", "kivi-4")
MARGIN = 0.2  # "comparable" accuracy: exact - QJL below this, with 95% confidence (kvlab's operationalisation)


def paper_params(head_dim: int) -> dict[str, dict]:
    """The paper's QJL (every knob given) and the matched configurations: knobs fixed here, the rest
    (QJL without outliers: m; KIVI: the residual) chosen by the planner at the matched budget."""
    qjl = {
        "m": 2 * head_dim,
        "initial_factor": 2,
        "m_out_ratio": 1.0,
        "n_outliers": max(1, head_dim // 16),
        "outlier_group": 32,
        "value_bits": 2,
        "value_group": 32,
        "residual": 128,
        "split_query": True,
    }
    no_out = {k: v for k, v in qjl.items() if k not in ("m", "m_out_ratio")} | {"n_outliers": 0}
    return {
        "qjl": qjl,
        "qjl-no-outliers": no_out,
        **{f"kivi-{b}": {"bits": b, "group": 32} for b in (2, 3, 4)},
    }


def matched_runs(info, n_prompt: int, steps: int) -> tuple[list, float]:
    """The runs of ``LABELS`` for one prompt, matched to the paper's QJL's peak; returns (runs, the budget
    fraction that peak uses).

    QJL's plan counts its window full, but the window flushes in groups of 32 and often holds less, so
    the bytes the paper's QJL will hold are simulated (``matched.simulate_bytes``) and KIVI's residual
    fills that budget (KIVI's plan is exact). QJL without outliers has the same window, so it is planned
    to the paper's QJL's *planned* fraction (``matched.peak_fraction``): both plans then leave the same
    slack, and the two QJL runs run at that budget (their plans must fit it)."""

    params = paper_params(info.head_dim)
    planned = Budget(fraction=peak_fraction(info, "qjl", params["qjl"], n_prompt, steps))
    held = simulate_bytes(info, "qjl", planned, params["qjl"], n_prompt, steps)
    budget = Budget(fraction=held_fraction(info, held, n_prompt))
    for b in (2, 3, 4):  # the residual that fills the budget best (None: KIVI-b does not fit; it is refused)
        r = fill_kivi(info, budget, n_prompt, steps, b, 32)
        params[f"kivi-{b}"] |= {} if r is None else {"residual": r}
    runs = [RunSpec("exact")]
    for x in LABELS[1:]:
        runs.append(RunSpec(x.split("-")[0], planned if x.startswith("qjl") else budget, params[x]))
    return runs, budget.as_fraction


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    info = ctx.info
    task = make_task("document", cfg["length"], cfg["seed"], lambda t: ctx.loaded.encode(t))
    ids = ctx.loaded.encode(task.prompt)
    runs, frac = matched_runs(info, len(ids), cfg["max_new_tokens"])
    ctx.log(f"{NAME}: {len(ids)}-token prompt, {cfg['max_new_tokens']} new tokens, matched budget {frac}")
    probe = MetricsProbe(ProbeSettings(attn_error=True, fidelity=True, maps=False))
    result = ctx.compare(ids, runs, cfg["max_new_tokens"], [probe])
    n = result.prompt_tokens
    coords = info.n_layers * info.n_kv_heads * n * info.head_dim * 2
    meas: dict[str, dict] = {}
    for label, r in zip(LABELS, result.runs):
        meas[label] = {
            "bits_per_number": 8 * r.kv_bytes_per_step[0] / coords,  # the prompt's cache after compression
            "bits_outside_window": _bits_outside_window(r, info, n),
            **memory(r, info),
            "kl_mean": r.metrics.get("kl_mean"),
            "top1_agreement": r.metrics.get("top1_agreement"),
            "perplexity": r.metrics.get("perplexity"),
            "attn_rel_error_mean": r.metrics.get("attn_rel_error_mean"),
            "params": r.params,
            "text": r.text,
            "error": r.error,
        }
    tasks = _task_scores(ctx, cfg)
    e, q = meas["exact"], meas["qjl"]
    compressed = LABELS[1:]
    gap = spread([meas[x]["peak_bytes"] for x in compressed])
    matched = f"matched on the peak bytes (spread {100 * gap:.1f}%)"
    rows = [
        Row(
            "bits per number: whole cache at its peak (mean), window included; outside the full-precision window",
            "3 (QJL, KIVI), the window left out; 16 exact",
            ", ".join(
                f"{x} {meas[x]['peak_bits']:.2f} ({meas[x]['mean_bits']:.2f}); {fmt(meas[x]['bits_outside_window'])}"
                for x in compressed
            )
            + f"; budget {frac}; peaks {', '.join(format(meas[x]['peak_kib'], ',.0f') for x in compressed)} KiB",
            note=f"matched on the peak bytes, spread {100 * gap:.1f}% (within {100 * MATCH_TOLERANCE:.0f}%: "
            f"{'yes' if gap <= MATCH_TOLERANCE else 'no'}); not the paper's 3 bits: the 128-token window costs "
            "the rest",
        ),
        Row(
            "QJL vs exact: teacher-forced top-1 / KL / perplexity",
            "comparable (Table 2: 73.88 vs 73.90)",
            f"top-1 {fmt(q['top1_agreement'])}, KL {fmt(q['kl_mean'])}, ppl {fmt(q['perplexity'])} "
            f"vs exact {fmt(e['perplexity'])}",
            _ok(q["top1_agreement"]) >= 0.9 and _ok(q["perplexity"], 1e9) <= 1.1 * _ok(e["perplexity"], 0),
            "kvlab's threshold: top-1 >= 0.9 and ppl within 10% (one prompt)",
            kind=CONTROL,
        ),
        Row(
            "QJL vs KIVI-2 at the same bytes: KL",
            "QJL >= KIVI (Table 1 NarrativeQA: 21.83 vs 20.96)",
            f"KL QJL {fmt(q['kl_mean'])} vs kivi-2 {fmt(meas['kivi-2']['kl_mean'])}; top-1 "
            f"{fmt(q['top1_agreement'])} vs {fmt(meas['kivi-2']['top1_agreement'])}",
            _ok(q["kl_mean"], 1e9) <= _ok(meas["kivi-2"]["kl_mean"], 1e9) if not meas["kivi-2"]["error"] else None,
            f"{matched}; at {q['peak_bits']:.1f} bits per number, not 3; one prompt"
            if not meas["kivi-2"]["error"]
            else f"kivi-2 did not run: {meas['kivi-2']['error']}",
            verdict=None if not meas["kivi-2"]["error"] else INCONCLUSIVE,
        ),
        *(
            Row(
                f"QJL vs {x.upper()} at the same bytes: KL",
                "(the paper compares no KIVI at 3 or 4 bits)",
                f"KL QJL {fmt(q['kl_mean'])} vs {x} {fmt(meas[x]['kl_mean'])}"
                if not meas[x]["error"]
                else f"{x} did not run: {meas[x]['error']}",
                kind=CONTEXT,
                note="context: not a claim of the paper",
            )
            for x in ("kivi-3", "kivi-4")
        ),
        Row(
            "QJL with vs without outlier sketch at the same bytes: KL",
            "outliers sketched apart help (Sec. 4.1)",
            f"KL with {fmt(q['kl_mean'])} (m={q['params'].get('m')}) vs without "
            f"{fmt(meas['qjl-no-outliers']['kl_mean'])} (m={meas['qjl-no-outliers']['params'].get('m')})",
            _ok(q["kl_mean"], 1e9) <= _ok(meas["qjl-no-outliers"]["kl_mean"], 1e9),
            f"{matched}; one prompt",
        ),
        Row(
            "attention relative error (mean over steps, layers)",
            "-",
            ", ".join(f"{x} {fmt(meas[x]['attn_rel_error_mean'])}" for x in compressed),
            None,
            "context",
        ),
        *(_task_row(name, tasks[name]) for name in tasks),
    ]
    qp = paper_params(info.head_dim)["qjl"]
    setting = (
        f"document task ({n}-token prompt, seed {cfg['seed']}), {cfg['max_new_tokens']} greedy tokens; "
        f"QJL m={qp['m']} (x2 on the first layers), outliers {qp['n_outliers']}/32 tokens, "
        f"2-bit values in groups of 32, residual 128, split query; every other run at its peak (budget {frac})"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {"settings": cfg, "prompt_tokens": n, "model": result.model, "budget": frac, "runs": meas, "tasks": tasks},
        list(CLAIMS),
        _figure(meas, list(LABELS)),
        time.perf_counter() - t0,
        [
            f"the exact cache holds {e['peak_bits']:.0f} bits per number "
            f"({getattr(info, 'cache_dtype', info.dtype)}); the compressed runs are matched on their peak bytes"
        ],
    )


def _task_scores(ctx: ReproductionSetup, cfg: dict) -> dict[str, dict]:
    """The calibrated tasks (docs/tasks.md) under each configuration, each prompt at its own matched budget:
    accuracy per label over the seeds."""

    out: dict[str, dict] = {}
    for name in cfg["tasks"]:
        hits = {x: 0.0 for x in LABELS}
        per: dict[str, list[float]] = {x: [] for x in LABELS}
        tokens = 0
        for seed in range(cfg["task_seeds"]):
            task = make_task(name, cfg["task_length"], seed, lambda t: ctx.loaded.encode(t))
            ids = prompt_ids(ctx.loaded, task)
            tokens = len(ids)
            ctx.log(f"{NAME}: {name} seed {seed}, {tokens} tokens")
            runs, _ = matched_runs(ctx.info, len(ids), 10)
            result = finish(ctx.compare(ids, runs, 10), task)
            for x, r in zip(LABELS, result.runs):
                hits[x] += float(r.metrics.get("task_score") or 0.0)
                per[x].append(float(r.metrics.get("task_score") or 0.0))
        seeds = cfg["task_seeds"]
        out[name] = {
            "tokens": tokens,
            "seeds": seeds,
            "accuracy": {x: h / seeds for x, h in hits.items()},
            "per_prompt": per,
        }
    return out


def _task_row(name: str, t: dict) -> Row:
    """QJL's accuracy comparable to exact's: the paired interval of exact - QJL below ``MARGIN`` holds, above
    it does not, across it is inconclusive; a task exact fails says nothing."""
    setting = f"{name} accuracy ({t['tokens']} tokens, {t['seeds']} prompts)"
    paper = "comparable to exact (LongBench, Table 1)"
    measured = ", ".join(f"{x} {t['accuracy'][x]:.2f}" for x in LABELS)
    if t["accuracy"]["exact"] < 0.5:
        return Row(setting, paper, measured, verdict=INCONCLUSIVE, note="exact itself fails: the task says nothing")
    d = paired_difference(t["per_prompt"]["exact"], t["per_prompt"]["qjl"], names=("exact", "qjl"))
    assert d is not None
    est = d.difference
    measured += f"; exact - qjl {est.text()}"
    extra = estimate_fields(est)
    if est.high is not None and est.high < MARGIN:
        return Row(setting, paper, measured, True, f"the interval lies below {MARGIN}", **extra)
    if est.low is not None and est.low > MARGIN:
        return Row(setting, paper, measured, False, f"the interval lies above {MARGIN}", **extra)
    return Row(
        setting, paper, measured, verdict=INCONCLUSIVE, note=f"the interval reaches {MARGIN} (or n < 2)", **extra
    )


def _bits_outside_window(r, info, n: int) -> float | None:
    """Bits per number of the prompt's tokens outside the full-precision window, after compression (None:
    no window tensors, or the whole prompt in it)."""
    kinds = r.kv_bytes_breakdown or {}
    if "residual_keys" not in kinds:
        return None
    per_token = info.n_layers * info.n_kv_heads * info.head_dim * info.dtype_bytes  # one token's K (or V)
    wk, wv = kinds.get("residual_keys", 0) / per_token, kinds.get("residual_values", 0) / per_token
    numbers = (2 * n - wk - wv) * info.n_layers * info.n_kv_heads * info.head_dim
    held = r.kv_bytes_per_step[0] - kinds.get("residual_keys", 0) - kinds.get("residual_values", 0)
    return 8 * held / numbers if numbers > 0 else None


def _ok(x, default: float = 0.0) -> float:
    return default if x is None else float(x)


def _figure(meas: dict, labels: list[str]):
    from plotly.subplots import make_subplots

    metrics = [
        ("peak_bits", "bits per number (peak)"),
        ("kl_mean", "KL(exact || method)"),
        ("perplexity", "perplexity"),
    ]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in metrics])
    for col, (key, _) in enumerate(metrics, 1):
        fig.add_bar(x=labels, y=[meas[x][key] for x in labels], showlegend=False, row=1, col=col)
    fig.update_layout(height=380, title=TITLE)
    return fig
