"""vLLM's case against QJL: TurboQuant-prod (a 1-bit QJL sketch of the residual) against TurboQuant-mse (that
bit spent on the mse codes), at matched bytes, 2 to 4 bits.

The two sides:

* **TurboQuant** (Zandieh, Daliri, Hadian, Mirrokni, arXiv:2504.19874, Theorem 2): b - 1 bits of the mse
  quantizer plus a 1-bit QJL sketch of the residual make the inner product unbiased, E <y, x_hat> = <y, x>,
  where the mse quantizer alone is biased (it shrinks inner products: by 2 / pi at one bit);
* **vLLM** (its TurboQuant config, 2026): "QJL is intentionally omitted: community consensus (5+ independent
  groups) found it hurts attention quality by amplifying variance through softmax". Its presets spend every
  bit on the mse codes.

Measured with kvlab's ``turboquant`` on the embedded model, keys through prod or mse at b = 2, 3, 4 bits per
number, values through mse at b bits either way, every token coded. prod stores one float16 more per key (the
residual's norm): the mse run is given prod's peak bytes as its budget, and the planner spends the difference
on a few recent tokens in 16 bits (``residual``), so the two hold the same bytes (within 2%, checked from the
runs' tensors on every prompt). Per prompt (pass key and needle, the question inside):

* **the variance of the logits**: the last 8 prompt queries of every layer and query head against every key of
  the prompt, each estimator's scaled logit (what enters the softmax) minus the exact one; per prompt the
  variance of that error over the keys, averaged over layers, heads and queries (each estimator on its own
  prompt cache, every token coded); beside it the slope of estimate on exact (1: no shrinkage);
* **the attention output error** over the decode steps and **teacher-forced KL**(exact || run) along exact's
  tokens (``kvlab.measure.metrics``);
* **agreement with exact's answer** (the run's greedy tokens equal exact's).

prod and mse are compared paired over the prompts, on each embedded model (``ReproductionSetup.models``).
vLLM's sentence is judged where vLLM states it, its presets' key widths, 3 and 4 bits (``turboquant_3bit_nc``,
``k3v4_nc``, ``4bit_nc``), in two ids: the variance (prod's logit error variance above mse's) and attention
quality (prod's attention output error above mse's). Each holds where the paired 95% interval of prod - mse
lies above zero (``decisions.direction_row``), does not hold where it lies below, and is inconclusive
otherwise. KL and the agreement with exact's answer, and every measure at 2 bits (no vLLM preset), are context
under the same ids; the slope rows (TurboQuant's side) are context too: prod's unbiasedness is verified by
``turboquant-bounds``.

``rows_of(data)`` decides the rows from the stored measurements alone, so a stored run can be re-decided
without measuring again (``kvlab reproduce --rejudge``).
"""

from __future__ import annotations

import torch

from kernels.tensor_ops import group_queries
from kvlab.core.budgets import Budget
from kvlab.core.statistics import mean_interval
from kvlab.engine.specs import RunSpec
from kvlab.methods.budget_search import planned
from kvlab.methods.turboquant import TurboQuant
from kvlab.reproduce.claims import KVLAB, Point, Threshold, paper_claim
from kvlab.reproduce.common import CLAIM, CONTEXT, Claim, Row
from kvlab.reproduce.decisions import direction_row
from kvlab.reproduce.matched import peak_fraction, spread
from kvlab.reproduce.paired_runs import METRICS, measure, pair_values, summary, task_for, task_units, text, values
from kvlab.reproduce.report import Report, report
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.tasks import prompt_ids

NAME = "turboquant-qjl-residual"
TITLE = "vLLM against QJL: TurboQuant-prod (QJL residual) vs TurboQuant-mse at matched bytes, 2-4 bits"

CLAIMS = (
    Claim(
        "vllm",
        "vLLM TurboQuantConfig docstring (2026)",
        "QJL is intentionally omitted: community consensus (5+ independent groups) found it hurts attention "
        "quality by amplifying variance through softmax.",
        "at the same bytes the QJL residual hurts attention quality, by a larger variance of the logits",
    ),
    Claim(
        "turboquant",
        "Theorem 2",
        "resulting in an unbiased inner product quantizer",
        "TurboQuant-prod's inner products are unbiased (mse's shrink)",
    ),
)

BITS = (2, 3, 4)
STATED = (3, 4)  # vLLM's presets' key widths: the points its sentence is about
MATCH = 0.02  # matched bytes: the two peaks within 2% of each other
WINDOW = 8  # prompt queries scored for the logit variance
VARIANCE, QUALITY = "vllm:qjl-amplifies-logit-variance", "vllm:qjl-hurts-attention-quality"


def _point(metric: str) -> Point:
    """vLLM's operating point: its presets' key widths, with ``metric`` (the sentence names no measurement)."""
    return Point(
        "the models vLLM serves (not named)",
        "not stated",
        "TurboQuant keys at 3 and 4 bits (turboquant_3bit_nc, turboquant_k3v4_nc, turboquant_4bit_nc), QJL omitted",
        metric,
    )


_DIRECTION = (
    "prod - mse at the same bytes (within 2%), paired over the prompts: the 95% interval above 0 holds, below 0 does "
    "not hold"
)
_WHY = "vLLM's sentence gives no metric, number or margin; kvlab tests its direction"
_WHERE = (
    "kvlab's turboquant, keys prod or mse at 3 and 4 bits, values mse, every token coded, mse given prod's peak "
    "bytes; 24 pass-key and needle prompts of ~500 tokens, each embedded model; 2 bits is context"
)
DECLARED = (
    paper_claim(
        VARIANCE,
        CLAIMS[0],
        "at the same bytes the QJL residual (prod) gives the logits a larger error variance than mse",
        _point("the variance (no measurement named)"),
        Threshold(f"the logit error variance, {_DIRECTION}", KVLAB, _WHY),
        _WHERE,
    ),
    paper_claim(
        QUALITY,
        CLAIMS[0],
        "at the same bytes the QJL residual (prod) hurts attention quality against mse",
        _point("attention quality (no measurement named)"),
        Threshold(f"the attention relative error, {_DIRECTION}", KVLAB, _WHY),
        _WHERE + "; KL and the agreement with exact are context",
    ),
)

FULL = {"tasks": ("passkey", "needle"), "length": 512, "seeds": 12, "new_tokens": 10, "bits": BITS}
QUICK = {"tasks": ("passkey", "needle"), "length": 256, "seeds": 1, "new_tokens": 6, "bits": BITS}
NOTES = [
    "logit variance: the variance over the prompt's keys of (estimated - exact) scaled logit, last 8 prompt queries, "
    "mean over layers, query heads and queries; each estimator on its own prompt cache with every token coded"
]


def prod_params(bits: int) -> dict:
    return {"bits": float(bits), "keys": "prod", "residual": 0}


def mse_params(bits: int) -> dict:
    return {"bits": float(bits), "keys": "mse"}  # the residual from prod's bytes


def runs(info, n_prompt: int, steps: int, bits_list) -> tuple[list[str], list[RunSpec], dict]:
    """exact, then prod and mse at each width (mse planned to prod's peak); and each width's budget."""
    labels, specs, budgets = ["exact"], [RunSpec("exact")], {}
    for b in bits_list:
        f = peak_fraction(info, "turboquant", prod_params(b), n_prompt, steps)
        budgets[b] = f
        labels += [f"prod-{b}", f"mse-{b}"]
        specs += [
            RunSpec("turboquant", Budget(fraction=f), prod_params(b)),
            RunSpec("turboquant", Budget(fraction=f), mse_params(b)),
        ]
    return labels, specs, budgets


def logit_errors(ctx: ReproductionSetup, ids: list[int], bits: int) -> dict:
    """Each estimator (prod, mse at ``bits``, every prompt token coded) against the exact logits of the last
    ``WINDOW`` prompt queries: per estimator the error's variance over keys (mean over layers, heads and
    queries), its mean square, and the slope of estimate on exact."""
    state = ctx.prefill(ids, WINDOW)
    n = state.n_tokens
    out = {}
    for keys in ("prod", "mse"):
        comp = TurboQuant(ctx.info, Budget(fraction=0.99), {"bits": float(bits), "keys": keys, "residual": 0}, seed=0)
        planned(comp, n)
        with torch.inference_mode():
            comp.compress(state)
            var, sq, cross, norm = [], [], 0.0, 0.0
            for layer, st in enumerate(comp.layers):
                if not st.n_coded:
                    continue
                hkv = st.res_k.shape[0]
                qg = group_queries(state.queries[layer].float() * comp.sem[layer].scaling, hkv)  # [Hkv, g W, d]
                est = comp.code_logits(layer, qg, st)
                k = state.keys[layer, :, st.n_seen - st.n_held : st.n_seen - st.n_held + st.n_coded].float()
                exact = torch.matmul(qg, k.transpose(-1, -2))
                err = est - exact
                var.append(float(err.var(-1).mean()))
                sq.append(float(err.pow(2).mean()))
                cross += float((est * exact).sum())
                norm += float(exact.pow(2).sum())
        out[keys] = {"var": sum(var) / len(var), "mse": sum(sq) / len(sq), "slope": cross / norm}
    return out


def measure_unit(ctx: ReproductionSetup, cfg: dict, unit: str) -> dict:
    """One prompt (``unit``: task/seed): exact, prod and mse at each width in one comparison, and the logit errors."""
    task = task_for(ctx, unit, cfg["length"])
    ids = prompt_ids(ctx.loaded, task)
    labels, specs, budgets = runs(ctx.info, len(ids), cfg["new_tokens"], cfg["bits"])
    got = measure(ctx, task, labels, specs, cfg["new_tokens"])
    got["budgets"] = budgets
    got["logits"] = {str(b): logit_errors(ctx, ids, b) for b in cfg["bits"]}
    for b in cfg["bits"]:
        for keys in ("prod", "mse"):
            got["runs"][f"{keys}-{b}"]["logit_var"] = got["logits"][str(b)][keys]["var"]
    return got


def measure_model(ctx: ReproductionSetup, cfg: dict, first: bool = True) -> dict[str, dict]:
    """Every prompt of ``cfg`` on ``ctx``'s model: unit -> result, each kept on disk as it finishes."""
    units = task_units(cfg["tasks"], cfg["seeds"])
    return dict(zip(units, ctx.each(NAME, cfg, __file__, measure_unit, units)))


def run(ctx: ReproductionSetup) -> Report:
    cfg = ctx.settings(NAME, FULL, QUICK)
    data = {"settings": cfg, "models": ctx.on_each_model(measure_model, cfg)}
    return report(ctx, __name__, setting_of(data), rows_of(data), data, figure(data), NOTES)


def setting_of(data: dict) -> str:
    cfg, by_model = data["settings"], data["models"]
    tokens = sorted({p["tokens"] for prompts in by_model.values() for p in prompts.values()})
    n = sorted({len(prompts) for prompts in by_model.values()})
    return (
        f"{'/'.join(map(str, n))} prompts per model on {', '.join(by_model)} ({', '.join(cfg['tasks'])}, "
        f"{tokens[0]}-{tokens[-1]} tokens, the question inside), {cfg['new_tokens']} greedy tokens; keys prod or "
        f"mse, values mse, at {', '.join(map(str, cfg['bits']))} bits; mse given prod's peak bytes"
    )


def rows_of(data: dict) -> list[Row]:
    """The rows of every model's prompts in ``data`` (``{"settings", "models": {model: {unit: prompt}}}``)."""
    return [r for model, prompts in data["models"].items() for r in _rows(prompts, data["settings"]["bits"], model)]


def _slopes(prompts: dict, b: int, keys: str) -> list[float]:
    return [p["logits"][str(b)][keys]["slope"] for p in prompts.values() if "logits" in p]


def _rows(prompts: dict, bits_list, model: str) -> list[Row]:
    rows: list[Row] = []
    n = len(prompts)
    for b in bits_list:
        prod, mse = f"prod-{b}", f"mse-{b}"
        gaps = [spread([p["runs"][x]["peak_bytes"] for x in (prod, mse)]) for p in prompts.values()
                if p["runs"][prod]["ran"] and p["runs"][mse]["ran"]]  # fmt: skip
        worst = max(gaps, default=float("nan"))
        window = sorted({p["runs"][mse]["params"].get("residual") for p in prompts.values() if p["runs"][mse]["ran"]})
        rows.append(
            Row(
                f"{b} bits: bits per number at the peak (prod, mse)",
                "matched bytes",
                ", ".join(f"{x.split('-')[0]} {_mean(values(prompts, x, 'peak_bits')):.3f}" for x in (prod, mse)),
                kind=CONTEXT,
                note=f"peaks within {100 * worst:.2f}% on every prompt "
                f"({'matched' if worst <= MATCH else f'not within {100 * MATCH:.0f}%'}); mse's 16-bit window "
                f"{window[0]}-{window[-1]} tokens"
                if window
                else "",
                model=model,
            )
        )
        slopes = {k: mean_interval(_slopes(prompts, b, k)) for k in ("prod", "mse")}
        rows.append(
            Row(
                f"{b} bits: slope of estimated on exact logits (TurboQuant's side)",
                CLAIMS[1].value,
                f"prod {text(slopes['prod'])}; mse {text(slopes['mse'])}",
                kind=CONTEXT,
                n=n,
                note="1 = no shrinkage; unbiasedness itself is verified by turboquant-bounds",
                model=model,
            )
        )
        matched = worst <= MATCH
        for key, what in (("logit_var", "logit error variance"), *METRICS.items()):
            claim = VARIANCE if key == "logit_var" else QUALITY
            at_point = b in STATED and key in ("logit_var", "attn_rel_error_mean") and matched
            xs, ys = pair_values(prompts, prod, mse, key)
            if not xs:
                continue
            ests = {x: summary(prompts, x, key) for x in (prod, mse)}
            lead = f"prod {text(ests[prod])}, mse {text(ests[mse])}"
            worse = (xs, ys, ("prod", "mse")) if key != "agree" else (ys, xs, ("mse", "prod"))  # prod worse: above
            rows.append(
                direction_row(
                    f"{b} bits: {what}, {worse[2][0]} - {worse[2][1]} (paired)",
                    CLAIMS[0].value if at_point else "-",
                    worse[0],
                    worse[1],
                    worse[2],
                    claim,
                    CLAIM if at_point else CONTEXT,
                    model,
                    note="" if at_point else _why_context(b, key, matched),
                    lead=lead,
                )
            )
    return rows


def _why_context(b: int, key: str, matched: bool) -> str:
    if not matched:
        return f"context: the peaks are not within {100 * MATCH:.0f}%"
    if b not in STATED:
        return "context: no vLLM preset codes keys at 2 bits"
    return "context: vLLM's sentence names attention quality and variance"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def figure(data: dict):
    """prod and mse per width on each measure (the first model of ``data``)."""
    from plotly.subplots import make_subplots

    model, prompts = next(iter(data["models"].items()))
    bits_list = data["settings"]["bits"]
    keys = {"logit_var": "logit error variance", **METRICS}
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=list(keys.values()))
    for col, key in enumerate(keys, 1):
        for which, color in (("prod", "#d62728"), ("mse", "#1f77b4")):
            ys, lo, hi = [], [], []
            for b in bits_list:
                est = summary(prompts, f"{which}-{b}", key)
                ys.append(float("nan") if est is None else est.mean)
                lo.append(0.0 if est is None or est.low is None else est.mean - est.low)
                hi.append(0.0 if est is None or est.high is None else est.high - est.mean)
            err = {"type": "data", "array": hi, "arrayminus": lo}
            fig.add_scatter(x=list(bits_list), y=ys, mode="lines+markers", name=which, line={"color": color},
                            error_y=err, showlegend=col == 1, row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="bits per number")
    fig.update_layout(height=420, title=f"{TITLE} ({model})")
    return fig


__all__ = ["BITS", "DECLARED", "FULL", "QUICK", "figure", "logit_errors", "rows_of", "runs", "setting_of"]
