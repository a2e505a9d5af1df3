"""SubGen Theorem 1 / Fig. 1: memory sublinear in n at a fixed delta, and keys more clusterable than values.

Algorithm 1's memory is O(d (m t + s)), with m the number of clusters of radius delta the stream of
keys needs; the theorem gives sublinear memory when m = n^(1 - Omega(1)) (Sec. 2.1). Fig. 1 says the
keys of a real model are more clusterable than its values. Both are measured here on one prefill of
real prose: Algorithm 1's own leader clustering (``kvlab.methods.clustering.cluster_stream``, no cap on the clusters)
of the first n tokens of each sampled (layer, KV head) stream, for growing n, at a fixed radius:
delta = ``rel`` x the stream's median vector norm (the same relative radius for keys and values,
which makes the two comparable; the first 4 tokens, attention sinks with outsized keys, are left
out). The growth exponent is the log-log slope of m against n (1: linear, the theorem needs < 1).
"""

from __future__ import annotations

import math
import time

import torch

from kvlab.methods.clustering import cluster_stream
from kvlab.reproduce.common import Claim, Report, Row, fmt
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

FULL = {"lengths": [256, 512, 1024, 2048], "rel": [0.75, 1.0], "layer_step": 3}
QUICK = {"lengths": [128, 256, 512], "rel": [1.0], "layer_step": 10}
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


def run(ctx: ReproductionSetup) -> Report:
    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    lengths = sorted(cfg["lengths"])
    ids = ctx.prose(lengths[-1] + SINKS)
    state = ctx.prefill(ids, window=1)
    layers = list(range(0, state.keys.shape[0], cfg["layer_step"]))
    n_max = min(lengths[-1], state.n_tokens - SINKS)
    lengths = [n for n in lengths if n <= n_max]
    d = state.keys.shape[-1]
    streams = {
        kind: x[layers, :, SINKS : SINKS + n_max].float().reshape(-1, n_max, d)
        for kind, x in (("keys", state.keys), ("values", state.values))
    }
    counts: dict[str, dict[float, list[float]]] = {kind: {} for kind in streams}  # kind -> rel -> per length
    for rel in cfg["rel"]:
        for kind, x in streams.items():
            ctx.log(f"{NAME}: {kind}, delta = {rel} x median norm")
            counts[kind][rel] = cluster_counts(x, lengths, rel)
    rows = []
    for rel in cfg["rel"]:
        k, v = counts["keys"][rel], counts["values"][rel]
        sk, sv = slope(lengths, k), slope(lengths, v)
        pairs = ", ".join(f"{n}: {fmt(m)}" for n, m in zip(lengths, k))
        rows.append(
            Row(
                f"keys, delta = {rel} x median norm: clusters m at n = {pairs}",
                "m = o(n) (growth exponent < 1)",
                f"exponent {sk:.2f}; m/n at n = {lengths[-1]}: {k[-1] / lengths[-1]:.3f}",
                sk < 0.9,
                "sublinear" if sk < 0.9 else "about linear: the keys of this prose are not sublinearly clusterable",
            )
        )
        rows.append(
            Row(
                f"values, same relative delta: m at n = {lengths[-1]}",
                "-",
                f"{fmt(v[-1])} (m/n {v[-1] / lengths[-1]:.3f}); exponent {sv:.2f}",
                None,
                "context",
            )
        )
        rows.append(
            Row(
                f"keys more clusterable than values (delta = {rel} x median norm, n = {lengths[-1]})",
                "keys more clusterable",
                f"keys {fmt(k[-1])} clusters vs values {fmt(v[-1])}",
                k[-1] < v[-1],
            )
        )
    setting = (
        f"{len(ids)}-token prose prefill (CPython manual), layers {layers[0] + 1}..{layers[-1] + 1} every "
        f"{cfg['layer_step']} x {state.keys.shape[1]} KV heads, first {SINKS} tokens left out; Algorithm 1's "
        f"leader clustering with no cap at delta = rel x each stream's median norm; the paper: Llama2-7B, t-SNE"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {"settings": cfg, "lengths": lengths, "layers": layers, "clusters": counts},
        list(CLAIMS),
        _figure(lengths, counts),
        time.perf_counter() - t0,
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
        title=TITLE,
        xaxis={"title": "stream length n", "type": "log"},
        yaxis={"title": "clusters m", "type": "log"},
    )
    return fig
