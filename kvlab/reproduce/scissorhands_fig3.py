"""Scissorhands Fig. 3: perplexity against the KV-cache compression ratio.

On one prose prompt (no chat template) the exact cache generates greedily; each method is then fed
the exact run's tokens (teacher forcing, ``kvlab.measure.metrics.MetricsProbe``) and its perplexity on them
is measured. Scissorhands runs at token budgets B = n / ratio per layer and KV head, with kvlab's
defaults and as ``scissorhands@paper`` (more budget for later layers, Algorithm 1 token by token over
the prompt). Scissorhands drops m = 0.5 B at once, so it holds between B/2 and B tokens: the table
gives the peak and the mean bytes held over the run as fractions of the exact cache's, and the
ratio is matched on the peak (the budget caps the peak).
"""

from __future__ import annotations

import time

from kvlab.core.budgets import Budget
from kvlab.engine.specs import RunSpec
from kvlab.measure.metrics import MetricsProbe, ProbeSettings
from kvlab.reproduce.common import Claim, Report, Row, fmt
from kvlab.reproduce.setup import ReproductionSetup

NAME = "scissorhands-fig3"
TITLE = "Scissorhands Fig. 3: perplexity against the compression ratio"

CLAIMS = (
    Claim(
        "scissorhands",
        "Fig. 3 caption",
        "In general, SCISSORHANDS incurs no accuracy drop until  $5\\times$  compression on OPT-66B.",
        "no drop until 5x (OPT-66B)",
    ),
    Claim(
        "scissorhands",
        "Sec. 5",
        "Generally, accuracy is maintained with 15% - 30% of the original KV cache size.",
        "maintained at 15-30% of the cache",
    ),
)

FULL = {"length": 640, "ratios": [2, 3, 4, 5], "max_new_tokens": 32, "methods": ["scissorhands", "scissorhands@paper"]}
QUICK = {"length": 192, "ratios": [2, 5], "max_new_tokens": 8, "methods": ["scissorhands", "scissorhands@paper"]}
WITHIN = 1.10  # "no drop": perplexity within 10% of the full cache's


def held(result) -> tuple[float, float]:
    """(peak, mean) bytes held over the run (after prefill and every step), as fractions of exact's."""
    fr = [b / e for b, e in zip(result.kv_bytes_per_step, result.exact_kv_bytes_per_step) if e]
    return (max(fr), sum(fr) / len(fr)) if fr else (float("nan"), float("nan"))


def perplexities(ctx: ReproductionSetup, ids: list[int], specs: list, max_new_tokens: int) -> list:
    """One teacher-forced comparison: exact first, then ``specs``; returns the engine's run results."""

    probe = MetricsProbe(ProbeSettings(attn_error=False, fidelity=True, maps=False))
    return ctx.compare(ids, [RunSpec("exact"), *specs], max_new_tokens, [probe]).runs


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    ids = ctx.prose(cfg["length"])
    n = len(ids)
    labels = [(m, r) for r in cfg["ratios"] for m in cfg["methods"]]
    specs = [RunSpec(m, Budget(tokens=max(1, n // r))) for m, r in labels]
    ctx.log(f"{NAME}: {n}-token prompt, {len(specs) + 1} runs")
    runs = perplexities(ctx, ids, specs, cfg["max_new_tokens"])
    exact = runs[0].metrics.get("perplexity")
    data: dict = {"exact": exact, "runs": {}}
    rows = [Row("full cache", "1x", fmt(exact, 4), None, "the reference")]
    for (m, r), res in zip(labels, runs[1:]):
        ppl = res.metrics.get("perplexity")
        peak, mean = held(res)
        data["runs"][f"{m}@{r}x"] = {
            "perplexity": ppl,
            "top1": res.metrics.get("top1_agreement"),
            "peak": peak,
            "mean": mean,
            "error": res.error,
        }
        ok = ppl is not None and exact is not None and ppl <= WITHIN * exact
        rows.append(
            Row(
                f"{m} {r}x (B = {n // r}; held peak {peak:.2f}, mean {mean:.2f} of exact)",
                "no drop until 5x (OPT-66B)" if r <= 5 else "-",
                f"{fmt(ppl, 4)} vs full {fmt(exact, 4)} (top-1 {fmt(res.metrics.get('top1_agreement'))})",
                None if res.error else ok,
                res.error or ("" if ok else f"over {WITHIN:.2f} x full"),
            )
        )
    setting = (
        f"{n}-token prose prompt (CPython manual, no chat template), {cfg['max_new_tokens']} tokens teacher-forced "
        f"along the exact greedy run; B = n / ratio tokens per layer and KV head, matched on the peak; "
        f"'no drop' = perplexity within {WITHIN - 1:.0%} of full; the paper: OPT-6B/13B/66B on C4"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {"settings": cfg, "prompt_tokens": n, **data},
        list(CLAIMS),
        _figure(data, cfg),
        time.perf_counter() - t0,
    )


def _figure(data: dict, cfg: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    for m in cfg["methods"]:
        fig.add_scatter(
            x=[f"{r}x" for r in cfg["ratios"]],
            y=[data["runs"][f"{m}@{r}x"]["perplexity"] for r in cfg["ratios"]],
            name=m,
            mode="lines+markers",
        )
    if data["exact"] is not None:
        fig.add_hline(y=data["exact"], line_dash="dot", annotation_text="full cache")
    fig.update_layout(height=380, title=TITLE, xaxis={"title": "compression (peak)"}, yaxis={"title": "perplexity"})
    return fig
