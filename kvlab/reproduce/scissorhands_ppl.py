"""Scissorhands Table 3: perplexity at 2x / 3x / 5x compression against a local window of the same size.

On one prose prompt (no chat template), the exact cache generates greedily; every method is then
fed the exact run's tokens (teacher forcing, ``kvlab.measure.metrics.MetricsProbe``) and its perplexity on
them is measured. Scissorhands keeps B = prompt / ratio tokens per layer and KV head, evicting as it
decodes; the local window keeps the last B tokens only (``streaming`` with no sink tokens). A
second baseline, StreamingLLM with 4 sink tokens, shows what the missing sinks cost the window.
"""

from __future__ import annotations

import time

from kvlab.core.budgets import Budget
from kvlab.engine.specs import RunSpec
from kvlab.measure.metrics import MetricsProbe, ProbeSettings
from kvlab.reproduce.common import Claim, Report, Row, fmt
from kvlab.reproduce.setup import ReproductionSetup

NAME = "scissorhands-ppl"
TITLE = "Scissorhands Table 3: perplexity vs a local window of the same size"

CLAIMS = (
    Claim("scissorhands", "Table 3, OPT-13B, C4 [1024-2048]", "9.3005", "full 9.3005"),
    Claim("scissorhands", "Table 3, OPT-13B + Local Window, C4 [1024-2048]", "15.5883", "local window 15.5883"),
    Claim("scissorhands", "Table 3, OPT-13B + Scissorhands, C4 [1024-2048]", "9.3009", "Scissorhands 9.3009"),
    Claim("scissorhands", "Table 3, OPT-13B + Local Window, C4 [256-512]", "81.8297", "local window 81.8297"),
    Claim(
        "scissorhands",
        "Sec. 5",
        "SCISSORHANDS’s performance is comparable against the full cache model, while Local Window incurs a "
        "significant quality loss",
        "Scissorhands ~ full; local window much worse",
    ),
)

FULL = {"length": 768, "ratios": [2, 3, 5], "max_new_tokens": 32}
QUICK = {"length": 192, "ratios": [2, 5], "max_new_tokens": 8}


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    ids = ctx.prose(cfg["length"])
    n = len(ids)
    runs, labels = [RunSpec("exact")], [("exact", None)]
    for ratio in cfg["ratios"]:
        b = Budget(tokens=max(1, n // ratio))
        runs += [RunSpec("scissorhands", b), RunSpec("streaming", b, {"n_sink": 0})]
        labels += [("scissorhands", ratio), ("local window", ratio)]
    last = Budget(tokens=max(1, n // cfg["ratios"][-1]))
    runs.append(RunSpec("streaming", last, {"n_sink": 4}))
    labels.append(("streaming (4 sinks)", cfg["ratios"][-1]))
    ctx.log(f"{NAME}: {n}-token prompt, {len(runs)} runs, {cfg['max_new_tokens']} tokens")
    probe = MetricsProbe(ProbeSettings(attn_error=False, fidelity=True, maps=False))
    result = ctx.compare(ids, runs, cfg["max_new_tokens"], [probe])
    ppl = {f"{m}@{r}x" if r else m: res.metrics.get("perplexity") for (m, r), res in zip(labels, result.runs)}
    top1 = {f"{m}@{r}x" if r else m: res.metrics.get("top1_agreement") for (m, r), res in zip(labels, result.runs)}
    exact = ppl["exact"]
    rows = [Row("full cache", "9.3005 (OPT-13B, C4 1024-2048)", f"{fmt(exact, 4)}", None, "the reference")]
    for ratio in cfg["ratios"]:
        sh, lw = ppl[f"scissorhands@{ratio}x"], ppl[f"local window@{ratio}x"]
        rows.append(
            Row(
                f"{ratio}x (B = {n // ratio} of {n} tokens): Scissorhands vs local window",
                "9.3009 vs 15.5883" if ratio == cfg["ratios"][0] else "Scissorhands < local window",
                f"{fmt(sh, 4)} (top-1 {fmt(top1[f'scissorhands@{ratio}x'])}) vs {fmt(lw, 4)} "
                f"(top-1 {fmt(top1[f'local window@{ratio}x'])})",
                sh is not None and lw is not None and sh < lw,
            )
        )
    r_last = cfg["ratios"][-1]
    sh_last = ppl[f"scissorhands@{r_last}x"]
    rows.append(
        Row(
            f"Scissorhands at {r_last}x close to full (within 10%)",
            "no drop until 5x (OPT-66B)",
            f"{fmt(sh_last, 4)} vs {fmt(exact, 4)}",
            sh_last is not None and exact is not None and sh_last <= 1.1 * exact,
        )
    )
    rows.append(
        Row(
            f"{r_last}x: StreamingLLM (4 sinks + window)",
            "-",
            f"{fmt(ppl[f'streaming (4 sinks)@{r_last}x'], 4)}",
            None,
            "context: the window with sink tokens",
        )
    )
    setting = (
        f"{n}-token prose prompt (CPython manual, no chat template), {cfg['max_new_tokens']} tokens teacher-forced "
        f"along the exact greedy run; token budgets B = n / ratio; the paper: OPT-13B on C4"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {"settings": cfg, "prompt_tokens": n, "perplexity": ppl, "top1_agreement": top1},
        list(CLAIMS),
        _figure(ppl, cfg["ratios"], exact),
        time.perf_counter() - t0,
    )


def _figure(ppl: dict, ratios: list[int], exact):
    import plotly.graph_objects as go

    fig = go.Figure()
    for m in ("scissorhands", "local window"):
        fig.add_scatter(x=[f"{r}x" for r in ratios], y=[ppl[f"{m}@{r}x"] for r in ratios], name=m, mode="lines+markers")
    if exact is not None:
        fig.add_hline(y=exact, line_dash="dot", annotation_text="full cache")
    fig.update_layout(
        height=380, title=TITLE, xaxis={"title": "compression"}, yaxis={"title": "perplexity", "type": "log"}
    )
    return fig
