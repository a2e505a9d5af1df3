"""Keys need more bits than values: K-heavy, equal and V-heavy splits of the same bytes.

The practitioners' rule behind vLLM's ``turboquant_k8v4`` and ``turboquant_k3v4_nc`` presets and llama.cpp users'
``-ctk q8_0 -ctv q4_0``: at a given cache size, spend more bits on the keys than on the values. vLLM's
TurboQuant config lists its presets with their perplexity ("turboquant_k8v4: FP8 keys + 4-bit values, 2.6x,
+1.17% PPL"; "turboquant_k3v4_nc: 3-bit MSE keys + 4-bit values + NC, ~3.5x, +10.63%"); the rule rests on such
perplexity anecdotes, not on splits compared at equal bytes. Here each quantizer runs its splits at exactly
the same bytes (the splits of one total differ in which side holds which codes, not in size; the peaks are
checked from the runs' tensors):

* ``kivi`` (keys per channel, values per token, groups of 32, fp16 scale and minimum): 4/2, 3/3 and 2/4 bits;
* ``turboquant`` with mse keys (a random rotation, Lloyd-Max codes, no QJL): 4/2, 3/3 and 2/4 bits;
* ``ggml`` with llama.cpp's Hadamard rotation: q8_0 keys and q4_0 values against q4_0 keys and q8_0 values
  (no equal split holds these bytes);
* ``vllm-turboquant`` (Hadamard, Lloyd-Max keys with norm correction, uniform values, 2 + 2 edge layers in 16
  bits): 4-bit keys and 3-bit values against 3-bit keys and 4-bit values (62 bytes a token and head either way
  at head size 64).

Every token is quantized (``residual=0``; KIVI keeps its last partial group of fewer than 32 tokens in 16 bits,
the same for every split). Each prompt (pass key and needle, asked inside the prompt) is one greedy comparison
of exact and every split, measuring the attention relative error over the decode steps, the teacher-forced
KL(exact || split) along exact's tokens, and the agreement with exact's answer (the split's greedy tokens equal
exact's). Splits are compared paired over the same prompts (``kvlab.core.statistics``).

The claim is judged where its source states it: 8-bit keys and 4-bit values (vLLM's ``turboquant_k8v4``, FP8
keys and 4-bit values; llama.cpp's ``-ctk q8_0 -ctv q4_0``), which is the ``ggml-rot`` pair here, against the
same bytes the other way round (q4_0 keys, q8_0 values); on KL, the measure nearest the perplexity the presets
are listed with; on each embedded model (``ReproductionSetup.models``). It holds where the V-heavy split's KL is
above the K-heavy split's with the paired 95% interval above zero (``decisions.direction_row``), does not hold
where it lies below, and is inconclusive otherwise. The other quantizers' splits (4/2 against 2/4 bits, no
source states them), every comparison with an equal split, the attention error and the agreement are context
under the same id.

``rows_of(data)`` decides the rows from the stored measurements alone, so a stored run can be re-decided
without measuring again (``kvlab reproduce --rejudge``).
"""

from __future__ import annotations

from kvlab.core.budgets import Budget
from kvlab.engine.specs import RunSpec
from kvlab.reproduce.claims import KVLAB, Point, Threshold, paper_claim
from kvlab.reproduce.common import CLAIM, CONTEXT, Claim, Row
from kvlab.reproduce.decisions import direction_row
from kvlab.reproduce.matched import spread
from kvlab.reproduce.paired_runs import METRICS, measure, pair_values, summary, task_for, task_units, text, values
from kvlab.reproduce.report import Report, report
from kvlab.reproduce.setup import ReproductionSetup

NAME = "kv-asymmetric-bits"
TITLE = "Keys need more bits than values: K-heavy, equal and V-heavy splits at the same bytes"

CLAIMS = (
    Claim(
        "vllm",
        "vLLM TurboQuant config (presets); llama.cpp practice (-ctk q8_0 -ctv q4_0)",
        "turboquant_k8v4:   FP8 keys + 4-bit values, 2.6x, +1.17% PPL",
        "keys need more bits than values: at the same bytes a K-heavy split loses less",
    ),
)
KEYS_MORE = "engines:keys-need-more-bits-than-values"
STATED = "ggml-rot"  # the family whose K-heavy split is the sources' own: 8-bit keys, 4-bit values
DECLARED = (
    paper_claim(
        KEYS_MORE,
        CLAIMS[0],
        "at the same bytes, 8-bit keys with 4-bit values lose less than 4-bit keys with 8-bit values",
        Point(
            "the engines' users' models (vLLM's presets: Qwen3, Llama 3 class)",
            "not stated",
            "8-bit keys, 4-bit values (vLLM turboquant_k8v4; llama.cpp -ctk q8_0 -ctv q4_0)",
            "perplexity",
        ),
        Threshold(
            "the V-heavy split's teacher-forced KL minus the K-heavy split's, paired over the prompts: the 95% "
            "interval above 0 holds, below 0 does not hold",
            KVLAB,
            "the sources give the presets' perplexity, no comparison at equal bytes and no margin; kvlab tests the "
            "direction, on KL (the measure nearest perplexity)",
        ),
        "llama.cpp's blocks with its rotation (ggml, q8_0/q4_0 against q4_0/q8_0, the same bytes), 24 pass-key and "
        "needle prompts of ~500 tokens, each embedded model; the other quantizers' splits are context",
    ),
)

# family -> (method, fixed params, {split: (key bits, value bits)}): each family's splits hold the same bytes
FAMILIES: dict[str, tuple[str, dict, dict[str, tuple[int, int]]]] = {
    "kivi": ("kivi", {"residual": 0}, {"K": (4, 2), "equal": (3, 3), "V": (2, 4)}),
    "turboquant-mse": ("turboquant", {"keys": "mse", "residual": 0}, {"K": (4, 2), "equal": (3, 3), "V": (2, 4)}),
    "ggml-rot": ("ggml", {"rotate": True, "residual": 0}, {"K": (8, 4), "V": (4, 8)}),
    "vllm": ("vllm-turboquant", {"norm_correction": True, "residual": 0}, {"K": (4, 3), "V": (3, 4)}),
}
CAP = 0.99  # a budget under 1 (every knob is given, so the plan is the split itself)

FULL = {"tasks": ("passkey", "needle"), "length": 512, "seeds": 12, "new_tokens": 10, "families": tuple(FAMILIES)}
QUICK = {"tasks": ("passkey", "needle"), "length": 256, "seeds": 1, "new_tokens": 6, "families": tuple(FAMILIES)}
NOTES = [
    "bits per number = 16 x the run's peak bytes / the exact cache's peak bytes; the splits of a quantizer hold "
    "the same bytes (the spread of their peaks is in each first row)"
]


def label(family: str, split: str) -> str:
    kb, vb = FAMILIES[family][2][split]
    return f"{family}:k{kb}v{vb}"


def runs(families) -> tuple[list[str], list[RunSpec]]:
    """The labels and runs of one prompt: exact, then every family's splits."""
    labels, specs = ["exact"], [RunSpec("exact")]
    for family in families:
        method, params, splits = FAMILIES[family]
        for split, (kb, vb) in splits.items():
            labels.append(label(family, split))
            specs.append(RunSpec(method, Budget(fraction=CAP), {**params, "kbits": kb, "vbits": vb}))
    return labels, specs


def measure_unit(ctx: ReproductionSetup, cfg: dict, unit: str) -> dict:
    """One prompt (``unit``: task/seed): exact and every split in one comparison."""
    labels, specs = runs(cfg["families"])
    return measure(ctx, task_for(ctx, unit, cfg["length"]), labels, specs, cfg["new_tokens"])


def measure_model(ctx: ReproductionSetup, cfg: dict, first: bool = True) -> dict[str, dict]:
    """Every prompt of ``cfg`` on ``ctx``'s model: unit -> result, each kept on disk as it finishes."""
    units = task_units(cfg["tasks"], cfg["seeds"])
    return dict(zip(units, ctx.each(NAME, cfg, __file__, measure_unit, units)))


def run(ctx: ReproductionSetup) -> Report:
    cfg = ctx.settings(NAME, FULL, QUICK)
    data = {"settings": cfg, "labels": runs(cfg["families"])[0], "models": ctx.on_each_model(measure_model, cfg)}
    return report(ctx, __name__, setting_of(data), rows_of(data), data, figure(data), NOTES)


def setting_of(data: dict) -> str:
    cfg, by_model = data["settings"], data["models"]
    every = [p for prompts in by_model.values() for p in prompts.values()]
    tokens = sorted({p["tokens"] for p in every})
    n = sorted({len(prompts) for prompts in by_model.values()})
    return (
        f"{'/'.join(map(str, n))} prompts per model on {', '.join(by_model)} ({', '.join(cfg['tasks'])}, "
        f"{tokens[0]}-{tokens[-1]} tokens, the question inside), {cfg['new_tokens']} greedy tokens; every token "
        "quantized; splits of one quantizer at the same bytes"
    )


def rows_of(data: dict) -> list[Row]:
    """The rows of every model's prompts in ``data`` (``{"settings", "models": {model: {unit: prompt}}}``)."""
    return [r for model, prompts in data["models"].items() for r in _rows(prompts, data["settings"]["families"], model)]


def _rows(prompts: dict, families, model: str) -> list[Row]:
    rows: list[Row] = []
    n = len(prompts)
    for family in families:
        splits = FAMILIES[family][2]
        names = {s: label(family, s) for s in splits}
        ran = [x for x in names.values() if values(prompts, x, "peak_bits")]
        gaps = []
        for p in prompts.values():
            peaks = [p["runs"][x]["peak_bytes"] for x in ran if p["runs"][x]["ran"]]
            if len(peaks) > 1:
                gaps.append(spread(peaks))
        bits = ", ".join(f"{x.split(':')[1]} {_mean(values(prompts, x, 'peak_bits')):.3f}" for x in ran)
        refused = [x for x in names.values() if x not in ran]
        rows.append(
            Row(
                f"{family}: bits per number at the peak",
                "same bytes",
                bits + ("; refused: " + ", ".join(refused) if refused else ""),
                kind=CONTEXT,
                note=f"peaks within {100 * max(gaps, default=0.0):.2f}% of each other on every prompt",
                claim=KEYS_MORE,
                model=model,
            )
        )
        for key, what in METRICS.items():
            ests = {x: summary(prompts, x, key) for x in ran}
            rows.append(
                Row(
                    f"{family}: {what} (mean over prompts)",
                    "-",
                    "; ".join(f"{x.split(':')[1]} {text(e)}" for x, e in ests.items()),
                    kind=CONTEXT,
                    n=n,
                    claim=KEYS_MORE,
                    model=model,
                )
            )
        k = names["K"]
        for other in [s for s in ("V", "equal") if s in names]:
            o = names[other]
            for key, what in METRICS.items():
                a, b = pair_values(prompts, o, k, key)
                if not a:
                    continue
                at_point = key == "kl_mean" and family == STATED and other == "V"
                ab = (o, k) if key != "agree" else (k, o)  # worse: a higher KL or error, a lower agreement
                first, second = (a, b) if key != "agree" else (b, a)
                note = "" if at_point else _why_context(family, other, key)
                rows.append(
                    direction_row(
                        f"{family}: {what}, {ab[0].split(':')[1]} - {ab[1].split(':')[1]} (paired)",
                        CLAIMS[0].value if at_point else "-",
                        first,
                        second,
                        (ab[0].split(":")[1], ab[1].split(":")[1]),
                        KEYS_MORE,
                        CLAIM if at_point else CONTEXT,
                        model,
                        note=note,
                    )
                )
    return rows


def _why_context(family: str, other: str, key: str) -> str:
    if key != "kl_mean":
        return "context: the claim is judged on KL"
    if family != STATED:
        return "context: no source states this split"
    return "context: the sources compare no equal split"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def figure(data: dict):
    """Each split's mean KL, attention error and agreement per quantizer (the first model of ``data``)."""
    from plotly.subplots import make_subplots

    model, prompts = next(iter(data["models"].items()))
    families = data["settings"]["families"]
    keys = list(METRICS)
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=[METRICS[k] for k in keys])
    colors = {"K": "#1f77b4", "equal": "#7f7f7f", "V": "#d62728"}
    for col, key in enumerate(keys, 1):
        for split, color in colors.items():
            xs, ys, lo, hi = [], [], [], []
            for family in families:
                if split not in FAMILIES[family][2]:
                    continue
                est = summary(prompts, label(family, split), key)
                if est is None:
                    continue
                xs.append(family)
                ys.append(est.mean)
                lo.append(est.mean - (est.low if est.low is not None else est.mean))
                hi.append((est.high if est.high is not None else est.mean) - est.mean)
            err = {"type": "data", "array": hi, "arrayminus": lo}
            name = f"{split}-heavy" if split != "equal" else "equal"
            fig.add_bar(x=xs, y=ys, name=name, marker_color=color, error_y=err, showlegend=col == 1, row=1, col=col)
    fig.update_layout(barmode="group", height=420, title=f"{TITLE} ({model})")
    return fig


__all__ = ["DECLARED", "FAMILIES", "FULL", "QUICK", "figure", "label", "rows_of", "runs", "setting_of"]
