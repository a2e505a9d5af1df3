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

The claim is judged on KL, the measure nearest the perplexity it was made with: per quantizer, "holds" where
the V-heavy (or equal) split's KL is above the K-heavy split's with a paired 95% interval above zero, "does not
hold" where it is below, "inconclusive" otherwise. The attention error and the agreement are given beside it.
"""

from __future__ import annotations

import time

from kvlab.core.budgets import Budget
from kvlab.engine.specs import RunSpec
from kvlab.reproduce.common import CONTEXT, Claim, Progress, Report, Row, estimate_fields
from kvlab.reproduce.matched import spread
from kvlab.reproduce.paired_runs import METRICS, lower_is_better, measure, paired, summary, task_prompts, text, values
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


def run(ctx: ReproductionSetup) -> Report:
    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    progress = Progress.of(ctx, NAME, cfg, __file__)
    labels, specs = runs(cfg["families"])
    prompts: dict[str, dict] = {}
    for unit, task in task_prompts(ctx, cfg["tasks"], cfg["length"], cfg["seeds"]):
        if progress.get(unit) is None:
            ctx.log(f"{NAME}: {unit}")
            progress.put(unit, measure(ctx, task, labels, specs, cfg["new_tokens"]))
        prompts[unit] = progress.get(unit)
    rows = _rows(prompts, cfg["families"])
    n = len(prompts)
    tokens = sorted({p["tokens"] for p in prompts.values()})
    setting = (
        f"{n} prompts ({', '.join(cfg['tasks'])}, {tokens[0]}-{tokens[-1]} tokens, the question inside), "
        f"{cfg['new_tokens']} greedy tokens; every token quantized; splits of one quantizer at the same bytes"
    )
    report = Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {"settings": cfg, "labels": labels, "prompts": prompts},
        list(CLAIMS),
        _figure(prompts, cfg["families"]),
        time.perf_counter() - t0,
        [
            "bits per number = 16 x the run's peak bytes / the exact cache's peak bytes; the splits of a "
            "quantizer hold the same bytes (the spread of their peaks is in each first row)"
        ],
    )
    progress.clear()
    return report


def _rows(prompts: dict, families) -> list[Row]:
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
                )
            )
        k = names["K"]
        for other in [s for s in ("V", "equal") if s in names]:
            o = names[other]
            for key, what in METRICS.items():
                diff = paired(prompts, o, k, key)
                shown = "-" if diff is None else f"{diff.difference.text(digits=3)}"
                setting = f"{family}: {what}, {o.split(':')[1]} - {k.split(':')[1]} (paired)"
                if key == "kl_mean":
                    verdict = lower_is_better(diff, key)
                    side = "the V-heavy split's" if other == "V" else "the equal split's"
                    note = {
                        "holds": f"{side} KL above the K-heavy's",
                        "does not hold": f"{side} KL below the K-heavy's",
                    }
                    rows.append(
                        Row(
                            setting,
                            CLAIMS[0].value,
                            shown,
                            verdict=verdict,
                            note=note.get(verdict, "the paired interval includes zero"),
                            **estimate_fields(None if diff is None else diff.difference),
                        )
                    )
                else:
                    rows.append(
                        Row(
                            setting,
                            "-",
                            shown + ("" if diff is None else f": {diff.verdict}"),
                            kind=CONTEXT,
                            **estimate_fields(None if diff is None else diff.difference),
                        )
                    )
    return rows


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _figure(prompts: dict, families):
    from plotly.subplots import make_subplots

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
    fig.update_layout(barmode="group", height=420, title=TITLE)
    return fig


__all__ = ["FAMILIES", "FULL", "QUICK", "label", "runs"]
