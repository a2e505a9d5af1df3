"""The Gradio page: pick a prompt, methods and budgets; see texts and bytes side by side."""

from __future__ import annotations

import html

import gradio as gr

from kvlab.budgets import BudgetError, parse_budgets
from kvlab.compressors import methods
from kvlab.engine import Engine, GenerationSettings, InputError, expand_runs
from kvlab.models import LoadedModel


def _cards(result) -> str:
    parts = []
    for r in result.runs:
        exact = r.exact_kv_bytes_per_step[0]
        parts.append(
            "<div class='kv-card'>"
            f"<h4>{html.escape(r.label)}</h4>"
            f"<p class='kv-bytes'>{r.kv_bytes / 1024:.0f} KiB of {exact / 1024:.0f} KiB "
            f"({100 * (1 - r.kv_bytes / exact):.0f}% saved) · {r.timings.tokens_per_s:.1f} tok/s</p>"
            f"<pre>{html.escape(r.text)}</pre></div>"
        )
    return "<div class='kv-cards'>" + "".join(parts) + "</div>"


def build_demo(lm: LoadedModel) -> gr.Blocks:
    engine = Engine(lm)
    choices = list(methods())

    def run(prompt, chosen, budgets, max_new, progress=gr.Progress()):
        try:
            bl = parse_budgets(budgets)
            specs = expand_runs(chosen or [], bl)
            if not (prompt or "").strip():
                raise InputError("the prompt is empty; type some text")
            gen = GenerationSettings(max_new_tokens=int(max_new))
            ids = lm.encode(prompt)
            result = None
            for ev in engine.stream(ids, specs, gen, prompt_text=prompt):
                if ev.progress >= 0:
                    progress(ev.progress, desc=ev.message)
                if ev.kind == "done":
                    result = ev.result
        except (InputError, BudgetError) as exc:
            raise gr.Error(str(exc)) from None
        rows = [
            [r.label, r.kv_bytes, r.exact_kv_bytes_per_step[0], round(r.kv_bytes / r.exact_kv_bytes_per_step[0], 4),
             round(r.timings.tokens_per_s, 1), r.text]
            for r in result.runs
        ]
        return _cards(result), rows

    with gr.Blocks(title="kvlab") as demo:
        gr.Markdown(f"# kvlab — KV-cache compression, side by side\nModel: **{html.escape(lm.info.id)}** on {lm.info.device}")
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", lines=6, value="Explain in two sentences why the sky is blue.")
            with gr.Column(scale=1):
                chosen = gr.CheckboxGroup(choices, value=["exact", "streaming"], label="Methods")
                budgets = gr.Textbox(value="0.25", label="Budgets (fractions or token counts, comma-separated)")
                max_new = gr.Slider(1, 256, value=32, step=1, label="Max new tokens")
                go = gr.Button("Run", variant="primary")
        cards = gr.HTML()
        table = gr.Dataframe(headers=["run", "kv bytes", "exact bytes", "fraction", "tok/s", "text"], wrap=True)
        go.click(run, [prompt, chosen, budgets, max_new], [cards, table], api_name="compare")
    return demo


CSS = """
.kv-cards {display:flex; flex-wrap:wrap; gap:12px}
.kv-card {flex:1 1 280px; border:1px solid #ddd; border-radius:8px; padding:10px}
.kv-card pre {white-space:pre-wrap; font-size:0.9em}
.kv-bytes {color:#555; font-size:0.85em}
"""
