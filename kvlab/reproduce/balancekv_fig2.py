"""BalanceKV Sec. 4.1 / Fig. 2: single-layer attention error vs T, BalanceKV against uniform sampling.

The paper's protocol, on the embedded model: one prefill of real prose keeps every layer's
post-RoPE keys, values and the last ``w`` queries. For each layer, the first ``sink`` and the
last ``recent`` prompt tokens are kept exactly; the middle is compressed by T rounds of
SoftmaxBalance (``kvlab.methods.balancekv``, the method's own walk settings) or replaced by a
uniform sample of the same size (``kvlab.methods.uniform``'s sampler). The query at position j
attends the kept tokens up to j (the recent tokens causally). Error: ||z_j - a_j|| / ||a_j||, a_j the
exact causal attention, averaged over query heads, the last ``w`` queries and seeds.

Uniform sampling is measured reweighted (each sampled middle token stands for mid / m tokens: log
weight added to its logit, as BalanceKV's kept tokens carry theirs) and unweighted.

Two controls separate the walk from the rest of the method: "random signs" runs the same blocks,
halving and weights with independent fair signs (no balancing: gamma = 0), so what BalanceKV gains
over it is the walk's own; "Algorithm 2" runs the paper's randomised step (p = 1/2 - y^T eta /
(2 c R^2), c = 30 log(b / delta), keys not centred) instead of the reference code's greedy one
(gamma = 4 on centred keys, kvlab's default). Each T's row counts the layers each one wins.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from kernels.tensor_ops import gather_tokens, group_queries, ungroup
from kvlab.core import semantics as sm
from kvlab.methods import get
from kvlab.methods.balancekv import BalanceKV, WalkConfig, algorithm2_config, balance_kv
from kvlab.methods.uniform import uniform_middle
from kvlab.reproduce.common import CONTROL, Claim, Report, Row, fmt
from kvlab.reproduce.setup import ReproductionSetup

NAME = "balancekv-fig2"
TITLE = "BalanceKV Fig. 2: attention relative error vs T, BalanceKV vs uniform sampling"

CLAIMS = (
    Claim(
        "balancekv",
        "Sec. 4.1",
        "We observe that for each model, layer and compression rate, the error of our method is much lower "
        "than independent uniform sampling.",
        "BalanceKV error < uniform at every layer and T",
    ),
    Claim("balancekv", "Sec. 4.1", "We retain the first 256 embeddings", "first 256 kept"),
    Claim("balancekv", "Sec. 4.1", "for the latest 256 queries", "last 256 queries"),
    Claim("balancekv", "Sec. 4.1", "$T \\in \\{1, 2, 3, 4\\}$", "T in {1, 2, 3, 4}"),
    Claim("balancekv", "Sec. 4.1", "consider the 1st, 2nd and 5th layers", "layers 1, 2, 5"),
    Claim("balancekv", "Sec. 4.1", "We repeat this with 10 different random seeds", "10 seeds"),
)
PAPER_LAYERS = (0, 1, 4)  # the paper's 1st, 2nd and 5th layers


FULL = {"n": 1536, "sink": 256, "recent": 256, "queries": 128, "rounds": [1, 2, 3, 4], "seeds": 3, "layers": 0}
QUICK = {"n": 512, "sink": 64, "recent": 64, "queries": 32, "rounds": [1, 2, 3], "seeds": 2, "layers": 5}


def causal_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, lw: Tensor | None, q_first: int, scaling: float):
    """Attention of q [Hq, w, d] (positions q_first ..) over keys/values [Hkv, K, d] at positions
    ``pos`` [Hkv, K] with log-weights ``lw`` [Hkv, K], each query seeing positions up to its own."""

    hq, w, hkv = q.shape[0], q.shape[1], k.shape[0]
    qpos = torch.arange(q_first, q_first + w)
    logits = sm.logits(q.float(), k.float(), scaling, lw)  # [Hq, w, K]
    future = (pos.unsqueeze(1) > qpos.view(1, w, 1)).repeat_interleave(hq // hkv, 0)  # [Hq, w, K]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), -1)
    return ungroup(torch.matmul(group_queries(probs, hkv), v.float()), hq)


def attention_error(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    idx: Tensor,
    logw: Tensor | None,
    q_first: int,
    scaling: float,
    exact: Tensor | None = None,
) -> Tensor:
    """Relative error per query head and query of attention over the kept tokens ``idx`` [Hkv, K]
    (log-weights ``logw`` [Hkv, K]) against exact causal attention over all n tokens (``exact``:
    that attention when already computed).

    q: [Hq, w, d] at positions q_first .. q_first + w - 1; keys/values: [Hkv, n, d]. Returns [Hq, w].
    """

    hkv, n = keys.shape[0], keys.shape[1]
    if exact is None:
        exact = causal_attention(q, keys, values, torch.arange(n).expand(hkv, n), None, q_first, scaling)
    z = causal_attention(q, gather_tokens(keys, idx), gather_tokens(values, idx), idx, logw, q_first, scaling)
    return (z - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    info = ctx.info
    ids = ctx.prose(cfg["n"])
    n, sink, recent, w = len(ids), cfg["sink"], cfg["recent"], cfg["queries"]
    state = ctx.prefill(ids, window=w)
    keys, values, queries = state.keys.float(), state.values.float(), state.queries.float()
    if cfg["layers"]:  # quick: the first layers only (they include the paper's 1st, 2nd and 5th)
        keys, values, queries = keys[: cfg["layers"]], values[: cfg["layers"]], queries[: cfg["layers"]]
    n_layers, hkv = keys.shape[:2]
    every = torch.arange(n).expand(hkv, n)
    exact = [
        causal_attention(queries[i], keys[i], values[i], every, None, n - w, state.scaling) for i in range(n_layers)
    ]
    a, e = sink, n - recent
    mid = e - a
    block = int(get("balancekv").defaults()["block_size"])
    block = max(2, min(block, mid >> 1 << 1) // 2 * 2)
    methods = ("balancekv", "random signs", "algorithm 2", "uniform (reweighted)", "uniform (unweighted)")
    # err[method][T] -> [seeds, layers]
    err: dict[str, dict[int, list[list[float]]]] = {m: {t: [] for t in cfg["rounds"]} for m in methods}
    for seed in range(cfg["seeds"]):
        comp = BalanceKV(info, None, {}, seed=seed)
        walk = comp.walk_config()
        walks = {
            "balancekv": walk,
            "random signs": WalkConfig(0.0, 0.0, walk.denom_weight, walk.center),
            "algorithm 2": algorithm2_config(block, walk.denom_weight),
        }
        gen = torch.Generator().manual_seed(1000 + seed)
        for T in cfg["rounds"]:
            ctx.log(f"{NAME}: seed {seed}, T={T}")
            picked = {
                name: balance_kv(keys[:, :, a:e], values[:, :, a:e], T, block, cfg_w, comp.generator)
                for name, cfg_w in walks.items()
            }
            m = picked["balancekv"][0].shape[-1]
            uni = uniform_middle((n_layers, hkv), n, a, recent, m, gen)
            head = torch.arange(a).expand(n_layers, hkv, a)
            tail = torch.arange(e, n).expand(n_layers, hkv, n - e)
            zeros_a, zeros_t = torch.zeros(n_layers, hkv, a), torch.zeros(n_layers, hkv, n - e)
            kept = {
                name: (torch.cat([head, ix + a, tail], -1), torch.cat([zeros_a, lw.float(), zeros_t], -1))
                for name, (ix, lw) in picked.items()
            }
            uni_lw = torch.cat([zeros_a, torch.full((n_layers, hkv, m), math.log(mid / m)), zeros_t], -1)
            errs: dict[str, list[float]] = {m_: [] for m_ in methods}  # method -> per layer
            for layer in range(n_layers):
                args = (queries[layer], keys[layer], values[layer])
                kw = {"exact": exact[layer]}
                for name, (ix, lw) in kept.items():
                    errs[name].append(
                        float(attention_error(*args, ix[layer], lw[layer], n - w, state.scaling, **kw).mean())
                    )
                errs["uniform (reweighted)"].append(
                    float(attention_error(*args, uni[layer], uni_lw[layer], n - w, state.scaling, **kw).mean())
                )
                errs["uniform (unweighted)"].append(
                    float(attention_error(*args, uni[layer], None, n - w, state.scaling, **kw).mean())
                )
            for m_ in methods:
                err[m_][T].append(errs[m_])

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):
        mu = mean(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / max(1, len(xs) - 1))

    summary: dict = {m_: {} for m_ in methods}
    for m_ in methods:
        for T in cfg["rounds"]:
            per_seed = err[m_][T]
            summary[m_][T] = {
                "per_layer_mean": [mean([s[layer] for s in per_seed]) for layer in range(n_layers)],
                "per_layer_std": [std([s[layer] for s in per_seed]) for layer in range(n_layers)],
                "all_layers_mean": mean([mean(s) for s in per_seed]),
            }
    rows: list[Row] = []
    wins = total = 0
    for T in cfg["rounds"]:
        b, rs, a2, u, uu = (summary[m_][T] for m_ in methods)
        for layer in (x for x in PAPER_LAYERS if x < n_layers):
            bl, ul = b["per_layer_mean"][layer], u["per_layer_mean"][layer]
            rows.append(
                Row(
                    f"layer {layer + 1}, T={T} (rate 2^-{T})",
                    "BalanceKV < uniform",
                    f"BalanceKV {fmt(bl)} ± {fmt(b['per_layer_std'][layer], 2)} vs uniform {fmt(ul)} "
                    f"(unweighted {fmt(uu['per_layer_mean'][layer])})",
                    bl < ul,
                )
            )
        per_layer = [bb < uu_ for bb, uu_ in zip(b["per_layer_mean"], u["per_layer_mean"])]
        wins += sum(per_layer)
        total += len(per_layer)
        rows.append(
            Row(
                f"all {n_layers} layers, T={T}",
                "BalanceKV < uniform",
                f"mean {fmt(b['all_layers_mean'])} vs {fmt(u['all_layers_mean'])}; BalanceKV lower in "
                f"{sum(per_layer)}/{len(per_layer)} layers",
                b["all_layers_mean"] < u["all_layers_mean"],
            )
        )
        per_walk = [bb < rr for bb, rr in zip(b["per_layer_mean"], rs["per_layer_mean"])]
        per_rs = [rr < uu_ for rr, uu_ in zip(rs["per_layer_mean"], u["per_layer_mean"])]
        rows.append(
            Row(
                f"T={T}: the walk against random signs (same blocks and weights)",
                "(the gain is the walk's)",
                f"walk {fmt(b['all_layers_mean'])}, random signs {fmt(rs['all_layers_mean'])} (lower than uniform "
                f"in {sum(per_rs)}/{len(per_rs)} layers); walk lower than random signs in "
                f"{sum(per_walk)}/{len(per_walk)} layers",
                b["all_layers_mean"] < rs["all_layers_mean"],
                kind=CONTROL,
            )
        )
        per_a2 = [x < uu_ for x, uu_ in zip(a2["per_layer_mean"], u["per_layer_mean"])]
        rows.append(
            Row(
                f"T={T}: Algorithm 2's randomised step",
                "BalanceKV < uniform",
                f"{fmt(a2['all_layers_mean'])} vs uniform {fmt(u['all_layers_mean'])}; lower in "
                f"{sum(per_a2)}/{len(per_a2)} layers",
                a2["all_layers_mean"] < u["all_layers_mean"],
                kind=CONTROL,
            )
        )
    fig = _figure(summary, cfg["rounds"], n_layers)
    setting = (
        f"{n}-token prose prompt, layers 1-{n_layers}, first {sink} and last {recent} tokens exact, last {w} queries, "
        f"T in {cfg['rounds']}, {cfg['seeds']} seeds, block {block}; uniform reweighted by mid/m"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {"settings": {**cfg, "n": n, "block": block}, "summary": summary, "wins": [wins, total]},
        list(CLAIMS),
        fig,
        time.perf_counter() - t0,
    )


def _figure(summary: dict, rounds: list[int], n_layers: int):
    from plotly.subplots import make_subplots

    panels = [*(x for x in PAPER_LAYERS if x < n_layers), None]
    titles = [f"layer {x + 1}" if x is not None else f"mean over {n_layers} layers" for x in panels]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=titles, shared_yaxes=True)
    colors = {
        "balancekv": "#1f77b4",
        "random signs": "#9467bd",
        "algorithm 2": "#2ca02c",
        "uniform (reweighted)": "#d62728",
        "uniform (unweighted)": "#ff7f0e",
    }
    for col, layer in enumerate(panels, 1):
        for m_, c in colors.items():
            if layer is None:
                y = [summary[m_][t]["all_layers_mean"] for t in rounds]
                err_y = None
            else:
                y = [summary[m_][t]["per_layer_mean"][layer] for t in rounds]
                err_y = {"type": "data", "array": [summary[m_][t]["per_layer_std"][layer] for t in rounds]}
            fig.add_scatter(
                x=rounds,
                y=y,
                error_y=err_y,
                name=m_,
                legendgroup=m_,
                showlegend=col == 1,
                line={"color": c},
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="T (rate 2^-T)", row=1, col=col)
    fig.update_yaxes(title_text="relative error ||z - a|| / ||a||", row=1, col=1)
    fig.update_layout(height=420, title=TITLE)
    return fig
