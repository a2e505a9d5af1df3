"""Scissorhands Table 3: perplexity of held-out text, against the full cache and a local window of the same size.

The paper's Table 3 (OPT-13B, C4 split by length) puts Scissorhands within 0.01% of the full cache
(9.3009 against 9.3005 at 1024-2048 tokens) while a window of recent tokens only degrades (15.5883;
81.8297 at 256-512): "comparable against the full cache model, while Local Window incurs a
significant quality loss". The compression ratio of the table is not given.

Here, as in ``scissorhands-fig3``: documents of CPython's reference manual (``pydoc_data.topics``),
the exact prefill of each one's first ``prefix`` tokens compressed, then its next ``continuation``
tokens teacher-forced and scored through each cache (``scissorhands_fig3.score_reference``). At each
ratio Scissorhands keeps B = prefix / ratio tokens per layer and KV head, evicting as it goes, and
the local window keeps the last B tokens (``streaming`` with no sink token); StreamingLLM with 4 sink
tokens is shown beside them as context. The comparisons are paired over the documents (the mean of
the per-document NLL differences, i.e. the log of the perplexity ratio, with a bootstrap interval):

* Scissorhands below the local window at each ratio: holds when the interval of window / Scissorhands
  lies above 1, does not hold when it lies below 1, inconclusive otherwise.
* Scissorhands comparable to full: the ratio is not stated, so it is judged at the mildest ratio
  measured (the first), as ``scissorhands-fig3`` judges "maintained" (the interval of Scissorhands /
  full below ``NO_DROP``); the other ratios are context.

Each document is one unit of ``Progress``: an interrupted run resumes at the next document.
"""

from __future__ import annotations

import time

from kvlab.core.budgets import Budget
from kvlab.engine.specs import RunSpec
from kvlab.reproduce.common import CONTEXT, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim, Report, Row, fmt
from kvlab.reproduce.scissorhands_fig3 import NO_DROP, against, error_bars, maintained, measure, spread_of
from kvlab.reproduce.setup import ReproductionSetup

NAME = "scissorhands-ppl"
TITLE = "Scissorhands Table 3: perplexity of held-out text vs full and a local window of the same size"

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

FULL = {"documents": 12, "prefix": 512, "continuation": 128, "ratios": [2, 3, 5]}
QUICK = {"documents": 3, "prefix": 160, "continuation": 24, "ratios": [2, 5]}
LOCAL = {"n_sink": 0}  # the paper's local window: recent tokens only
SINKS = {"n_sink": 4}  # StreamingLLM, context


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    p, ratios = cfg["prefix"], cfg["ratios"]
    labels, specs = ["exact"], [RunSpec("exact")]
    for r in ratios:
        b = Budget(tokens=max(1, p // r))
        labels += [f"scissorhands@{r}x", f"local window@{r}x"]
        specs += [RunSpec("scissorhands", b), RunSpec("streaming", b, LOCAL)]
    labels.append(f"streaming (4 sinks)@{ratios[-1]}x")
    specs.append(RunSpec("streaming", Budget(tokens=max(1, p // ratios[-1])), SINKS))
    data = measure(ctx, NAME, cfg, labels, specs, __file__)
    runs = data["runs"]
    full = {label: against(runs, label) for label in labels[1:]}
    window = {r: against(runs, f"local window@{r}x", f"scissorhands@{r}x") for r in ratios}
    exact_ppl = next((c["reference_ppl"] for c in full.values() if c["reference_ppl"] is not None), None)
    rows = [
        Row(
            "full cache",
            "9.3005 (OPT-13B, C4 1024-2048)",
            f"perplexity {fmt(exact_ppl, 4)}",
            None,
            "the reference",
            n=len(data["documents"]),
        )
    ]
    for i, r in enumerate(ratios):
        sh, lw, c = full[f"scissorhands@{r}x"], full[f"local window@{r}x"], window[r]
        rows.append(
            Row(
                f"{r}x (B = {p // r}): local window / Scissorhands perplexity",
                "15.5883 / 9.3009 (ratio not stated)" if i == 0 else "above 1",
                f"{fmt(c['ratio'])} ({fmt(lw['ppl'], 4)} vs {fmt(sh['ppl'], 4)})",
                note=_window_note(c),
                verdict=_window_verdict(c),
                **spread_of(c),
            )
        )
    for i, r in enumerate(ratios):
        c = full[f"scissorhands@{r}x"]
        measured = f"{fmt(c['ratio'])} ({fmt(c['ppl'], 4)} vs {fmt(exact_ppl, 4)})"
        setting = f"{r}x (B = {p // r}): Scissorhands / full perplexity"
        if i == 0:
            verdict, why = maintained(c) if c["n"] else (INCONCLUSIVE, "every run failed")
            note = f"the mildest ratio measured; {why}"
            rows.append(
                Row(setting, "9.3009 / 9.3005 (ratio not stated)", measured, note=note, verdict=verdict, **spread_of(c))
            )
        else:
            rows.append(
                Row(setting, "-", measured, kind=CONTEXT, note="the trend (Table 3 states no ratio)", **spread_of(c))
            )
    s = full[f"streaming (4 sinks)@{ratios[-1]}x"]
    rows.append(
        Row(
            f"{ratios[-1]}x: StreamingLLM (4 sinks + window) / full perplexity",
            "-",
            f"{fmt(s['ratio'])} ({fmt(s['ppl'], 4)})",
            kind=CONTEXT,
            note="context: the window with sink tokens",
            **spread_of(s),
        )
    )
    setting = (
        f"{len(data['documents'])} documents of CPython's reference manual (pydoc_data.topics), each: the exact "
        f"prefill of its first {p} tokens compressed, then its next {cfg['continuation']} tokens teacher-forced "
        f"and scored; B = {p} / ratio tokens per layer and KV head for Scissorhands and the local window alike; "
        f"paired 95% intervals over the documents, 'comparable' = Scissorhands / full below {NO_DROP}; the paper: "
        f"OPT-13B on C4, ratio not stated"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {
            "settings": cfg,
            "exact_perplexity": exact_ppl,
            "against_full": full,
            "window_vs_scissorhands": window,
            **data,
        },
        list(CLAIMS),
        _figure(full, ratios),
        time.perf_counter() - t0,
    )


def _window_verdict(c: dict) -> str:
    """Scissorhands below the local window: the interval of window / Scissorhands above 1 holds."""
    iv = c["interval"]
    if iv is None:
        return INCONCLUSIVE
    return HOLDS if iv[0] > 1 else DOES_NOT_HOLD if iv[1] < 1 else INCONCLUSIVE


def _window_note(c: dict) -> str:
    iv = c["interval"]
    if iv is None:
        return "no interval (fewer than two documents)"
    if iv[0] > 1:
        return "the local window is worse on these documents"
    return "Scissorhands is worse than the window" if iv[1] < 1 else "the interval includes 1"


def _figure(full: dict, ratios: list[int]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for m in ("scissorhands", "local window"):
        cs = [full[f"{m}@{r}x"] for r in ratios]
        fig.add_scatter(
            x=[f"{r}x" for r in ratios],
            y=[c["ratio"] for c in cs],
            error_y=error_bars(cs),
            name=m,
            mode="lines+markers",
        )
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="full cache")
    fig.update_layout(
        height=380,
        title=TITLE,
        xaxis={"title": "compression"},
        yaxis={"title": "perplexity / full (95% interval)", "type": "log"},
    )
    return fig
