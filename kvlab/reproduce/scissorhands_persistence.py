"""Scissorhands Sec. 3.2 / Fig. 2: the persistence ratio per layer, on attention from the real model.

The paper's definitions, applied to one prefill of real prose of l tokens (every query kept):

* token x_i is pivotal for position t if the query at t gives it attention above alpha = 1/t (the
  "average score", Sec. 3.1: the query at 1-based position t attends t tokens);
* S_{a->b} is the union of the pivotal sets of positions a..b;
* with t = l / 2: persistence ratio = |S_{t+1->l} ∩ S_{0->t}| / |S_{t+1->l}|, both restricted to
  the first half's tokens x_1..x_t; the paper also reports |S_{0->t}| / t.

Measured per query head (grouped-query attention: each query head's own attention) and averaged
over the heads of a layer. ``|S_{0->t}| / t`` is also the chance level: a later pivotal set drawn at
random from x_1..x_t would overlap S_{0->t} in that fraction. At alpha = 1/t on this model most
early tokens are pivotal at some point (the chance level is near 0.9), so a ratio over 95% says
little by itself; the table also gives the margin over chance, normalised as
(ratio - chance) / (1 - chance) (0: chance, 1: perfect persistence), and repeats the test with
stricter thresholds alpha = c/t (c = 4, 16), where the pivotal sets are small and chance is low.
"""

from __future__ import annotations

import time

import torch

from kvlab.core.attention_ops import causal_window_probs
from kvlab.reproduce.common import CONTROL, Claim, Report, Row
from kvlab.reproduce.setup import ReproductionSetup

NAME = "scissorhands-persistence"
TITLE = "Scissorhands Fig. 2: persistence ratio of pivotal tokens per layer"

CLAIMS = (
    Claim(
        "scissorhands",
        "Fig. 2 caption",
        "The persistence ratio is over 95% in most layers, with decreases at the later layers.",
        "> 95% in most layers",
    ),
    Claim("scissorhands", "Sec. 3.2", "we set  $t = \\frac{l}{2}$", "t = l / 2"),
    Claim("scissorhands", "Sec. 3.2", "we set  $\\alpha = \\frac{1}{t}$", "alpha = 1/t"),
    Claim(
        "scissorhands",
        "Sec. 3.2",
        "the size of  $S_{0 \\rightarrow t}$  is considerably smaller than half of the sentence length",
        "|S_{0->t}| well below t",
    ),
)

FULL = {"length": 1024}
QUICK = {"length": 192}


STRICT = (4.0, 16.0)  # stricter thresholds alpha = c / t for the control rows


def persistence(probs: torch.Tensor, c: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: [H, l, l] causal attention (query position x key position) of one layer.

    Returns per head (persistence ratio [H], |S_{0->t}| / t [H]) with t = l // 2 and alpha = c/(j+1)
    for the query at 0-based position j (the paper: c = 1).
    """
    h, l, _ = probs.shape
    t = l // 2
    alpha = c / torch.arange(1, l + 1, dtype=probs.dtype, device=probs.device).view(1, l, 1)
    pivotal = probs[..., :t] > alpha  # [H, l, t]: only the first half's tokens matter
    early = pivotal[:, :t].any(1)  # S_{0->t}
    late = pivotal[:, t:].any(1)  # S_{t+1->l} within x_1..x_t
    ratio = (late & early).sum(-1).float() / late.sum(-1).clamp_min(1).float()
    return ratio, early.sum(-1).float() / t


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    ids = ctx.prose(cfg["length"])
    l = len(ids)  # noqa: E741 - the paper's name
    state = ctx.prefill(ids, window=l)
    n_layers = state.keys.shape[0]
    ratios, sizes = [], []
    strict: dict[float, tuple[list[float], list[float]]] = {c: ([], []) for c in STRICT}
    for layer in range(n_layers):
        probs = causal_window_probs(state.queries[layer : layer + 1], state.keys[layer : layer + 1], state.scaling)[0]
        r, s = persistence(probs)
        ratios.append(r.mean().item())
        sizes.append(s.mean().item())
        for c in STRICT:
            rc, sc = persistence(probs, c)
            strict[c][0].append(rc.mean().item())
            strict[c][1].append(sc.mean().item())
    over95 = sum(r > 0.95 for r in ratios)
    margin = [r - s for r, s in zip(ratios, sizes)]

    def normalised(rs: list[float], ss: list[float]) -> float:
        """Mean over layers of (ratio - chance) / (1 - chance)."""
        return sum((r - s) / max(1e-9, 1 - s) for r, s in zip(rs, ss)) / len(rs)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    rows = [
        Row(
            "persistence ratio, layers over 95%",
            "over 95% in most layers",
            f"{over95}/{n_layers} layers; mean {sum(ratios) / n_layers:.3f}, min {min(ratios):.3f} "
            f"(layer {ratios.index(min(ratios)) + 1})",
            over95 > n_layers / 2,
        ),
        Row(
            "|S_0->t| / t (also the chance level of the ratio)",
            "considerably smaller than 1",
            f"mean {sum(sizes) / n_layers:.3f}, max {max(sizes):.3f}",
            max(sizes) < 0.75,
            "not the trivial case" if max(sizes) < 0.75 else "",
        ),
        Row(
            "ratio above chance in every layer",
            "(implied: persistence is not chance)",
            f"margin over chance: mean {sum(margin) / n_layers:.3f}, min {min(margin):.3f}",
            min(margin) > 0,
            kind=CONTROL,
        ),
        Row(
            "margin over chance, normalised: (ratio - chance) / (1 - chance)",
            "(implied: well above chance)",
            f"ratio {mean(ratios):.3f} vs chance {mean(sizes):.3f}: normalised margin {normalised(ratios, sizes):.2f}",
            normalised(ratios, sizes) >= 0.5,
            "at least half of the way from chance to perfect" if normalised(ratios, sizes) >= 0.5 else "",
            kind=CONTROL,
        ),
        *(
            Row(
                f"control: stricter alpha = {c:g}/t (non-trivial pivotal sets)",
                "-",
                f"ratio {mean(strict[c][0]):.3f}, chance {mean(strict[c][1]):.3f}, margin "
                f"{mean(strict[c][0]) - mean(strict[c][1]):.3f} (normalised {normalised(*strict[c]):.2f})",
                None,
                "not the paper's threshold; shows persistence where chance is low",
            )
            for c in STRICT
        ),
        Row(
            "later layers lower",
            "decreases at the later layers",
            f"first half of layers {sum(ratios[: n_layers // 2]) / (n_layers // 2):.3f}, "
            f"second half {sum(ratios[n_layers // 2 :]) / (n_layers - n_layers // 2):.3f}",
            sum(ratios[n_layers // 2 :]) / (n_layers - n_layers // 2) < sum(ratios[: n_layers // 2]) / (n_layers // 2),
        ),
    ]
    setting = f"{l}-token prose prefill (CPython manual, no chat template), t = l/2 = {l // 2}, alpha = 1/position"
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {
            "settings": cfg,
            "tokens": l,
            "persistence_ratio": ratios,
            "early_set_fraction": sizes,
            "normalised_margin": normalised(ratios, sizes),
            "strict": {str(c): {"persistence_ratio": r, "early_set_fraction": s} for c, (r, s) in strict.items()},
        },
        list(CLAIMS),
        _figure(ratios, sizes),
        time.perf_counter() - t0,
    )


def _figure(ratios: list[float], sizes: list[float]):
    import plotly.graph_objects as go

    layers = list(range(1, len(ratios) + 1))
    fig = go.Figure()
    fig.add_scatter(x=layers, y=ratios, name="persistence ratio", mode="lines+markers")
    fig.add_scatter(x=layers, y=sizes, name="|S_0->t| / t (chance level)", mode="lines+markers")
    fig.add_hline(y=0.95, line_dash="dot", annotation_text="95% (paper)")
    fig.update_layout(
        height=400, title=TITLE, xaxis={"title": "layer"}, yaxis={"title": "fraction", "range": [0, 1.02]}
    )
    return fig
