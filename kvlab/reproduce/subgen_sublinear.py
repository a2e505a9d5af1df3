"""SubGen Theorem 1 / Fig. 1: clusters against n at a fixed delta, keys against values.

Algorithm 1's memory is O(d (m t + s)), with m the number of clusters of radius delta the stream of
keys needs; the theorem gives sublinear memory when m = n^(1 - Omega(1)) (Sec. 2.1). Fig. 1 says the
keys of a real model are more clusterable than its values. Both are measured on ``prompts`` prose
prompts (CPython's reference manual, each its own shuffle of the topics): Algorithm 1's own leader
clustering (``kvlab.methods.clustering.cluster_stream``, no cap on the clusters) of the first n tokens of
each sampled (layer, KV head) stream, for growing n, at a fixed radius: delta = ``rel`` x the stream's
median vector norm (the same relative radius for keys and values, which makes the two comparable; the
first 4 tokens, attention sinks with outsized keys, are left out).

m = o(n) is a statement about n going to infinity: like Theorem 1's Omega(.) (``subgen-theorem1``), no
finite run can confirm or refute it, so the claim is "not testable here"; the growth exponent (the
log-log slope of m against n; 1 is linear) is shown as evidence, with its interval over the prompts.
"Keys more clusterable than values" is tested at each radius: the paired interval over the prompts of
the values' cluster count minus the keys' at the largest n must lie above zero. The paper shows it by
t-SNE (no number), so the radius and the test are kvlab's.

Each prompt is one unit of ``Progress``: an interrupted run resumes at the next prompt.
"""

from __future__ import annotations

import math

import torch

from kvlab.core.statistics import mean_interval
from kvlab.methods.clustering import cluster_stream
from kvlab.reproduce.claims import KVLAB, PAPER, Point, Threshold, paper_claim
from kvlab.reproduce.common import CONTEXT, NOT_TESTABLE, Claim, Row, fmt
from kvlab.reproduce.decisions import direction_row, spread
from kvlab.reproduce.report import Report, report
from kvlab.reproduce.setup import ReproductionSetup

NAME = "subgen-sublinear"
TITLE = "SubGen Theorem 1 / Fig. 1: clusters against n at a fixed delta, keys against values"

CLAIMS = (
    Claim(
        "subgen",
        "Sec. 2.1",
        "with the number of clusters scaling sublinearly in stream length (m =\no(n)), it is possible to "
        "construct a DS with sublinear memory space.",
        "m = o(n): sublinear memory",
    ),
    Claim(
        "subgen",
        "Fig. 1 caption",
        "Key embeddings are more clusterable than value ones.",
        "keys more clusterable than values",
    ),
)
SUBLINEAR, KEYS_CLUSTER = "subgen:sec2.1-sublinear-clusters", "subgen:fig1-keys-more-clusterable"
DECLARED = (
    paper_claim(
        SUBLINEAR,
        CLAIMS[0],
        "the number of clusters of a fixed radius grows sublinearly in the stream length, m = o(n)",
        Point("any (the paper's analysis)", "n going to infinity", "a fixed radius delta", "the cluster count m"),
        Threshold("m = o(n)", PAPER, "an asymptotic statement: no finite n can confirm or refute it"),
        "Algorithm 1's clustering of real keys at n = 256-2048, the growth exponent as evidence",
    ),
    paper_claim(
        KEYS_CLUSTER,
        CLAIMS[1],
        "a model's keys are more clusterable than its values",
        Point("Llama-2-7B (Fig. 1)", "one prompt", "t-SNE of a layer's keys and values", "visual: no number"),
        Threshold(
            "at each radius, the paired 95% interval over prompts of (the values' clusters - the keys') at the "
            "largest n above 0",
            KVLAB,
            "the paper shows a t-SNE picture; kvlab counts Algorithm 1's clusters at the same relative radius",
        ),
        "Algorithm 1's clusters of the embedded model's keys and values at 0.75 and 1.0 x the median norm",
    ),
)

FULL = {"lengths": [256, 512, 1024, 2048], "rel": [0.75, 1.0], "layer_step": 3, "prompts": 10}
QUICK = {"lengths": [128, 256, 512], "rel": [1.0], "layer_step": 10, "prompts": 3}
SINKS = 4


def slope(ns: list[int], ms: list[float]) -> float:
    """Least-squares slope of log m against log n."""
    x = [math.log(n) for n in ns]
    y = [math.log(max(m, 1e-9)) for m in ms]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / max(1e-12, sum((a - mx) ** 2 for a in x))


def cluster_counts(x: torch.Tensor, lengths: list[int], rel: float) -> list[float]:
    """Mean number of clusters Algorithm 1 opens on the first n vectors of each stream x [B, N, d], delta =
    rel x each stream's median norm (over all N), for each n in ``lengths``."""

    delta = rel * x.norm(dim=-1).median(-1).values
    out = []
    for n in lengths:
        count = cluster_stream(x[:, :n].contiguous(), delta, n)[2]
        out.append(float(count.float().mean()))
    return out


def measure_prompt(ctx: ReproductionSetup, cfg: dict, seed: int) -> dict:
    """Cluster counts of one prompt: kind (keys, values) -> rel -> per length, and the lengths reached."""
    lengths = sorted(cfg["lengths"])
    ids = ctx.prose(lengths[-1] + SINKS, seed=seed)
    state = ctx.prefill(ids, window=1)
    layers = list(range(0, state.keys.shape[0], cfg["layer_step"]))
    n_max = min(lengths[-1], state.n_tokens - SINKS)
    lengths = [n for n in lengths if n <= n_max]
    d = state.keys.shape[-1]
    counts: dict = {}
    for kind, x in (("keys", state.keys), ("values", state.values)):
        stream = x[layers, :, SINKS : SINKS + n_max].float().reshape(-1, n_max, d)
        counts[kind] = {str(rel): cluster_counts(stream, lengths, rel) for rel in cfg["rel"]}
    return {"tokens": len(ids), "lengths": lengths, "layers": layers, "heads": state.keys.shape[1], "clusters": counts}


def run(ctx: ReproductionSetup) -> Report:
    cfg = ctx.settings(NAME, FULL, QUICK)
    prompts = ctx.each(NAME, cfg, __file__, measure_prompt, range(cfg["prompts"]))
    lengths = prompts[0]["lengths"]
    rows = []
    for rel in cfg["rel"]:
        k = [p["clusters"]["keys"][str(rel)] for p in prompts]
        v = [p["clusters"]["values"][str(rel)] for p in prompts]
        sk = mean_interval([slope(lengths, m) for m in k])
        sv = mean_interval([slope(lengths, m) for m in v])
        mean_k = [sum(m[i] for m in k) / len(k) for i in range(len(lengths))]
        pairs = ", ".join(f"{n}: {fmt(m)}" for n, m in zip(lengths, mean_k))
        fields = spread(sk)
        why = fields.pop("note", "")
        rows.append(
            Row(
                f"keys, delta = {rel} x median norm: clusters m at n = {pairs} (mean over prompts)",
                "m = o(n) (growth exponent < 1 as n grows without bound)",
                f"growth exponent {sk.text(digits=2) if sk else '-'}; m/n at n = {lengths[-1]}: "
                f"{mean_k[-1] / lengths[-1]:.3f}",
                verdict=NOT_TESTABLE,
                note="m = o(n) is asymptotic: no finite n confirms or refutes it; the exponent over n = "
                f"{lengths[0]}-{lengths[-1]} is evidence" + (f"; {why}" if why else ""),
                claim=SUBLINEAR,
                **fields,
            )
        )
        rows.append(
            Row(
                "values, same relative delta: growth exponent",
                "-",
                f"{sv.text(digits=2) if sv else '-'}; m/n at n = {lengths[-1]}: "
                f"{sum(m[-1] for m in v) / len(v) / lengths[-1]:.3f}",
                kind=CONTEXT,
                claim=SUBLINEAR,
                **{k_: v_ for k_, v_ in spread(sv).items() if k_ != "note"},
            )
        )
        rows.append(
            direction_row(
                f"keys more clusterable than values (delta = {rel} x median norm, n = {lengths[-1]}): values' "
                "clusters - keys'",
                "keys more clusterable",
                [m[-1] for m in v],
                [m[-1] for m in k],
                ("values", "keys"),
                KEYS_CLUSTER,
                lead=f"keys {fmt(mean_k[-1])} clusters vs values {fmt(sum(m[-1] for m in v) / len(v))}",
            )
        )
    p0 = prompts[0]
    setting = (
        f"{len(prompts)} prose prompts of {p0['tokens']} tokens (CPython manual), layers {p0['layers'][0] + 1}.."
        f"{p0['layers'][-1] + 1} every {cfg['layer_step']} x {p0['heads']} KV heads, first {SINKS} tokens left out; "
        "Algorithm 1's leader clustering with no cap at delta = rel x each stream's median norm; the paper: "
        "Llama2-7B, t-SNE"
    )
    counts = {
        kind: {rel: [sum(p["clusters"][kind][str(rel)][i] for p in prompts) / len(prompts) for i in range(len(lengths))]
               for rel in cfg["rel"]}
        for kind in ("keys", "values")
    }  # fmt: skip
    return report(
        ctx,
        __name__,
        setting,
        rows,
        {"settings": cfg, "lengths": lengths, "clusters": counts, "prompts": prompts},
        _figure(lengths, counts),
    )


def _figure(lengths: list[int], counts: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind, by_rel in counts.items():
        for rel, ms in by_rel.items():
            fig.add_scatter(x=lengths, y=ms, name=f"{kind}, delta = {rel} x median norm", mode="lines+markers")
    fig.add_scatter(x=lengths, y=lengths, name="m = n", mode="lines", line={"dash": "dot", "color": "grey"})
    fig.update_layout(
        height=400,
        title=TITLE + " (mean over prompts)",
        xaxis={"title": "stream length n", "type": "log"},
        yaxis={"title": "clusters m", "type": "log"},
    )
    return fig
