"""Budgets on sliding-window models: every method's peak bytes against what its budget allows.

Tiny random-weight models (4 layers, hidden 128, 4 query / 2 KV heads, float32 cache) with a 64-token
window: Mistral (every layer local) and Cohere 2 (three local layers, then one global); Llama 4 (three
layers of chunked attention in 64-token blocks, then one global) and DeepSeek-V2 (multi-head latent
attention: 4 KV heads whose keys hold 48 numbers and values 32; no window) with `--families`. A 520-token
prompt of CPython's reference manual, 12 decode steps, every listed method at 0.25 and 0.5. For each
run: the peak over the steps of bytes held / bytes its budget allows (``health.budget_limits``, the
share of the exact cache's bytes at that step; the exact cache of a local layer is its window), the
lowest such ratio, the health flags, or the refusal.

    python -m bench.windowed_budgets [--methods all] [--families mistral,cohere2,llama4,deepseek-v2] [--out FILE]

Target: every ratio within [0.85, 1.05] at its peak, no flag, no refusal a plain evictor would not make.
A run under 0.85 whose bytes at budget 0.99 are the same is marked ``full``: the method already holds
every token its layers can see (a composition at fixed bits, say) and cannot use more.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers as tf

from bench import tiny_models
from kvlab.cli import method_names
from kvlab.core.budgets import Budget
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import from_model, load_model
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure import health
from kvlab.methods import get

WINDOW, PROMPT, NEW = 64, 520, 12
CHOICES = ("mistral", "cohere2", "llama4", "deepseek-v2")


def model(family: str) -> torch.nn.Module:
    """The tiny ``family`` model with a ``WINDOW``-token window: ``tiny_models``' architectures, and Cohere 2
    (three local layers, then one global), which the tests' matrix does not hold."""
    if family != "cohere2":
        return tiny_models.build(family, window=WINDOW)
    config = tf.Cohere2Config(
        **tiny_models.COMMON,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        pad_token_id=0,
    )
    return tiny_models.instantiate(tf.Cohere2ForCausalLM, config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="all")
    ap.add_argument("--families", default="mistral,cohere2")
    ap.add_argument("--budgets", default="0.25,0.5")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    unknown = sorted(set(args.families.split(",")) - set(CHOICES))
    if unknown:
        ap.error(f"unknown families {', '.join(unknown)}; choose from {', '.join(CHOICES)}")
    from pydoc_data.topics import topics

    base = load_model("embedded", device="cpu")
    text = "\n\n".join(topics[k] for k in ("assert", "assignment", "atom-identifiers", "attribute-access"))
    ids = [int(i) for i in base.tokenizer(text)["input_ids"][:PROMPT]]
    methods = [m for m in method_names(args.methods) if m != "exact"]
    out = {}
    for family in args.families.split(","):
        lm = from_model(model(family), base.tokenizer, family, check=False)
        budgets = args.budgets.split(",")
        specs = [RunSpec(m, Budget.parse(b)) for m in methods for b in [*budgets, "0.99"]]
        t0 = time.perf_counter()
        res = Engine(lm).compare(ids, specs, GenerationSettings(max_new_tokens=NEW))
        print(f"{family}: {len(specs)} runs in {time.perf_counter() - t0:.0f} s")
        by_label = {r.label: r for r in res.runs}
        for r in res.runs:
            if r.budget == "0.99":
                continue
            if r.error:
                row = {"error": r.error.splitlines()[0][:160]}
            else:
                limits = health.budget_limits(r, PROMPT, get(r.method).streaming)
                ratios = [h / a for h, a in zip(r.kv_bytes_per_step, limits)]
                roomy = by_label[f"{r.method}@0.99"]
                full = not roomy.error and max(roomy.kv_bytes_per_step) <= max(r.kv_bytes_per_step) * 1.001
                row = {"peak": round(max(ratios), 3), "low": round(min(ratios), 3), "health": r.health, "full": full}
            ok = (
                "error" not in row
                and (0.85 <= row["peak"] or row["full"])
                and row["peak"] <= 1.05
                and not row["health"]
            )
            print(f"  {'ok ' if ok else 'BAD'} {r.label:28s} {row}")
            out[f"{family}/{r.label}"] = row
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
