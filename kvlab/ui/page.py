"""The page: the model box, setup, progress and cards, then one tab per view (memory, errors, attention,
what each head keeps, quality vs memory, export / import, leaderboard, claims, needle grid, about). Every
event has an ``api_name``; model work (loading a model, a comparison) runs one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import gradio as gr

from kvlab.core.model import LoadedModel
from kvlab.engine.loader import spec_of
from kvlab.report import retention_map
from kvlab.ui.about import about_markdown
from kvlab.ui.cards import cards_html, kept_strip_html, progress_html, source_html
from kvlab.ui.claims_tab import claims_tab
from kvlab.ui.config import CSS, GROUP_TITLES, Limits
from kvlab.ui.dashboard import Dashboard, PageInputs
from kvlab.ui.export import export_ttl_s
from kvlab.ui.gpu_lease import gpu
from kvlab.ui.grid_tab import grid_tab
from kvlab.ui.leaderboard_tab import leaderboard_tab
from kvlab.ui.methods import default_methods, method_groups, param_rows
from kvlab.ui.model_choice import box_info, model_line, offered
from kvlab.ui.prompt_presets import DEFAULT_PRESET, presets
from kvlab.ui.retention_view import prompt_positions_html, steps_note


@dataclass
class Setup:
    """The setup panel's components; those of ``PageInputs`` carry its field names."""

    model: gr.Dropdown  # a spec: offered ones, or (free choice) any folder or hub id typed in
    prompt: gr.Textbox
    papers: gr.CheckboxGroup
    baselines: gr.CheckboxGroup
    budgets: gr.Textbox
    max_new: gr.Slider
    seed: gr.Number
    param_table: gr.Dataframe
    record_maps: gr.Checkbox
    map_layer: gr.Number
    map_head: gr.Number
    preset: gr.Dropdown
    run_btn: gr.Button
    plan: gr.Markdown  # the run count and memory estimate, before Run
    cancel_btn: gr.Button  # stops the running comparison
    question: gr.Textbox  # asked after compressing the prompt (query-agnostic); empty: query-aware
    recent: gr.CheckboxGroup  # the recent methods' group
    quantizers: gr.CheckboxGroup  # the quantizers' group
    load_btn: gr.Button  # loads the model box's model (with progress) and runs its self-check
    model_line: gr.HTML  # what is loaded and the self-check's verdict, or why a model was refused
    model_state: gr.State  # the session's loaded model (what the box goes back to when a load is refused)

    def inputs(self) -> list:
        """The inputs of a comparison, named and ordered by ``PageInputs`` (``Dashboard.compare``'s order)."""
        return [getattr(self, f.name) for f in fields(PageInputs)]


@dataclass
class Views:
    """What shows a result: progress, cards, the stored result and every tab's figures and pickers."""

    status: gr.HTML
    cards: gr.HTML
    state: gr.State  # the result's JSON: every view is rendered from it, never recomputed
    gauges: gr.Plot
    bytes_fig: gr.Plot
    layer_pick: gr.Dropdown
    err_step: gr.Plot
    err_layer: gr.Plot
    kl_fig: gr.Plot
    shown: gr.CheckboxGroup
    heat: gr.Plot
    strip_pick: gr.Dropdown
    strip: gr.HTML
    qvm: gr.Plot
    export_btn: gr.Button
    files: gr.File
    upload: gr.File
    source: gr.HTML  # the model, protocol and settings every number of the result comes from
    ret_plot: gr.Plot  # what each head keeps: one retention map per run
    ret_prompt: gr.HTML  # the prompt, token by token, with positions
    ret_step: gr.Slider  # the decode step the maps show
    ret_steps: gr.HTML  # which steps hold snapshots

    def rendered(self) -> list:
        """The outputs of ``Dashboard.render``, in its order."""
        v = self
        return [
            v.cards, v.state, v.gauges, v.bytes_fig, v.err_step, v.err_layer, v.kl_fig, v.heat, v.qvm, v.strip,
            v.layer_pick, v.strip_pick, v.source, v.ret_plot, v.ret_prompt, v.ret_step, v.ret_steps,
        ]  # fmt: skip


def build_demo(lm: LoadedModel, limits: Limits | None = None, dash: Dashboard | None = None) -> gr.Blocks:
    """The page. Launch with ``launch_kwargs()`` (theme, css) and ``queue_kwargs``. ``dash``: the callbacks'
    holder, when the caller made it (to preload models); else a new one on ``lm``."""
    dash = dash or Dashboard(lm, limits)
    preset_texts, dash.tasks = presets(lm)
    ttl = export_ttl_s()
    with gr.Blocks(title="kvlab — KV-cache compression side by side", delete_cache=(ttl, ttl)) as demo:
        gr.HTML(
            "<div class='kv-header'><h1>kvlab</h1><p>KV-cache compression methods side by side on a real "
            "model: texts, bytes, attention error, attention maps.</p></div>"
        )
        setup = _setup(lm, dash.limits, preset_texts)
        views = _views()
        _wire(demo, dash, setup, views, preset_texts)
    return demo


def _optional_group(groups: dict[str, list], group: str, elem_id: str) -> gr.CheckboxGroup:
    """A method group nothing in is ticked by default, shown only when the registry has members in it."""
    return gr.CheckboxGroup(
        groups.get(group, []), value=[], label=GROUP_TITLES[group], elem_id=elem_id, visible=bool(groups.get(group))
    )


def _setup(lm: LoadedModel, lim: Limits, preset_texts: dict[str, str]) -> Setup:
    """The setup panel: the model box on top; preset, prompt and question on the left; methods, budgets and
    settings on the right."""
    groups = method_groups()
    papers0, baselines0 = default_methods()
    model, load_btn, line, model_state = model_box(lm, lim)
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            preset = gr.Dropdown(
                list(preset_texts),
                value=DEFAULT_PRESET,
                label="Preset",
                info="document question, pass-key, line retrieval or free chat",
                elem_id="kv-preset",
            )
            prompt = gr.Textbox(
                value=preset_texts[DEFAULT_PRESET], label="Prompt", lines=9, max_lines=16, elem_id="kv-prompt"
            )
            question = gr.Textbox(
                value="",
                label="Question, asked after compression",
                lines=1,
                max_lines=4,
                elem_id="kv-question",
                info="optional: the prompt above is then a context, compressed without the question "
                "(query-agnostic); empty: the question is inside the compressed prompt (query-aware)",
            )
        with gr.Column(scale=2):
            papers = gr.CheckboxGroup(
                groups.get("paper", []), value=papers0, label=GROUP_TITLES["paper"], elem_id="kv-papers"
            )
            baselines = gr.CheckboxGroup(
                groups.get("baseline", []),
                value=baselines0,
                label=GROUP_TITLES["baseline"] + " (exact always runs)",
                elem_id="kv-baselines",
            )
            recent = _optional_group(groups, "recent", "kv-recent")
            quantizers = _optional_group(groups, "quantizer", "kv-quantizers")
            with gr.Row():
                budgets = gr.Textbox(
                    value="0.25",
                    label="Budgets",
                    elem_id="kv-budgets",
                    info="fractions of the exact bytes or token counts: 0.5, 0.25, 512t",
                )
                max_new = gr.Slider(
                    1,
                    lim.max_new_tokens,
                    value=min(32, lim.max_new_tokens),
                    step=1,
                    label="Max new tokens",
                    elem_id="kv-max-new",
                )
            with gr.Row():
                seed = gr.Number(value=0, precision=0, label="Seed", minimum=0)
                record_maps = gr.Checkbox(
                    value=True,
                    label="Measure attention error, KL & maps",
                    info="the costly measurements (a shadow exact cache)",
                    elem_id="kv-maps",
                )
            with gr.Row():
                heads = lm.info.n_heads
                map_layer = gr.Number(
                    value=lm.info.n_layers // 2,
                    precision=0,
                    minimum=0,
                    maximum=lm.info.n_layers - 1,
                    label="Attention-map layer",
                )
                map_head = gr.Number(
                    value=0, precision=0, minimum=0, maximum=heads - 1, label="Attention-map query head"
                )
            with gr.Row():
                run_btn = gr.Button("Run comparison", variant="primary", elem_id="kv-run", scale=3)
                cancel_btn = gr.Button("Cancel", variant="stop", elem_id="kv-cancel", scale=1, min_width=80)
            plan = gr.Markdown("", elem_id="kv-plan")
    with gr.Accordion("Advanced parameters per method (papers' defaults; edit the value column)", open=False):
        param_table = gr.Dataframe(
            value=param_rows(),
            headers=["method", "parameter", "value", "default", "meaning"],
            type="array",
            interactive=True,
            wrap=True,
            max_height=320,
            static_columns=[0, 1, 3, 4],
        )
    return Setup(
        model, prompt, papers, baselines, budgets, max_new, seed, param_table, record_maps, map_layer, map_head, preset,
        run_btn, plan, cancel_btn, question, recent, quantizers, load_btn, line, model_state,
    )  # fmt: skip


def model_box(lm: LoadedModel, lim: Limits) -> tuple[gr.Dropdown, gr.Button, gr.HTML, gr.State]:
    """The model box with its Load button, the line that says what is loaded, and the session's model.

    Free choice: this machine's models listed, any folder or hub id accepted; else the fixed list."""
    start = spec_of(lm)
    choices = offered(start, lim)
    with gr.Row(equal_height=False, elem_id="kv-model-row"):
        model = gr.Dropdown(
            choices,
            value=start,
            label="Model",
            info=box_info(lim),
            allow_custom_value=lim.allow_model_choice,
            interactive=lim.allow_model_choice or len(choices) > 1,
            filterable=True,
            elem_id="kv-model",
            scale=5,
        )
        load_btn = gr.Button(
            "Load model",
            elem_id="kv-load-model",
            scale=1,
            min_width=120,
            visible=lim.allow_model_choice or len(choices) > 1,
        )
    line = gr.HTML(model_line(lm), elem_id="kv-model-line")
    return model, load_btn, line, gr.State(start)


def _views() -> Views:
    """Progress and cards, then one tab per view: memory, errors, attention, quality vs memory, files, about."""
    status = gr.HTML(progress_html(0.0, "ready"), elem_id="kv-status")
    source = gr.HTML(source_html(None), elem_id="kv-source")
    cards = gr.HTML(cards_html(None, None), elem_id="kv-cards")
    state = gr.State(None)
    with gr.Tabs():
        with gr.Tab("Memory", id="memory"):
            gauges = gr.Plot(label="Cache size", elem_id="kv-gauges")
            bytes_fig = gr.Plot(label="Bytes per step", elem_id="kv-bytes")
        with gr.Tab("Errors", id="errors"):
            layer_pick = gr.Dropdown(["mean"], value="mean", label="Layer (for the per-step curve)", elem_id="kv-layer")
            err_step = gr.Plot(label="Error per step", elem_id="kv-err-step")
            err_layer = gr.Plot(label="Error per layer", elem_id="kv-err-layer")
            kl_fig = gr.Plot(label="KL and agreement", elem_id="kv-kl")
        with gr.Tab("Attention", id="attention"):
            shown = gr.CheckboxGroup([], label="Methods shown (empty: all)")
            heat = gr.Plot(label="Attention heatmaps", elem_id="kv-heat")
            strip_pick = gr.Dropdown(
                [], label="Kept-token strip: method", elem_id="kv-strip-pick", allow_custom_value=True
            )
            strip = gr.HTML(kept_strip_html(None, None, None), elem_id="kv-strip")
        with gr.Tab("What each head keeps", id="retention"):
            ret_prompt = gr.HTML(prompt_positions_html(None, None), elem_id="kv-ret-prompt")
            gr.HTML(retention_map.legend_html())
            with gr.Row(equal_height=False):
                ret_step = gr.Slider(
                    0, 1, value=0, step=1, label="Decode step (0: right after compression)", elem_id="kv-ret-step",
                    scale=3,
                )  # fmt: skip
                ret_steps = gr.HTML(steps_note(None), elem_id="kv-ret-steps-note")
            ret_plot = gr.Plot(label="What each head keeps", elem_id="kv-ret")
        with gr.Tab("Quality vs memory", id="quality"):
            qvm = gr.Plot(label="Quality vs memory", elem_id="kv-qvm")
        with gr.Tab("Export / import", id="files"):
            with gr.Row():
                export_btn = gr.Button("Export JSON + CSV + HTML report", elem_id="kv-export")
                files = gr.File(label="Downloads", file_count="multiple", interactive=False)
            upload = gr.File(
                label="Load a kvlab JSON export (viewed without recomputing)",
                file_types=[".json"],
                type="filepath",
                elem_id="kv-upload",
            )
        with gr.Tab("Leaderboard", id="leaderboard"):
            leaderboard_tab()
        with gr.Tab("Claims", id="claims"):
            claims_tab()
        with gr.Tab("Needle grid", id="grid"):
            grid_tab()
        with gr.Tab("About", id="about"):
            gr.Markdown(about_markdown())
    return Views(
        status, cards, state, gauges, bytes_fig, layer_pick, err_step, err_layer, kl_fig, shown, heat,
        strip_pick, strip, qvm, export_btn, files, upload, source, ret_plot, ret_prompt, ret_step, ret_steps,
    )  # fmt: skip


def _wire(demo: gr.Blocks, dash: Dashboard, setup: Setup, views: Views, preset_texts: dict[str, str]) -> None:
    """The page's events; each one that a client may call has an ``api_name``."""
    v = views
    setup.preset.change(lambda name: preset_texts.get(name, ""), setup.preset, setup.prompt, api_name="preset")
    s = setup
    gr.on(
        [demo.load, s.prompt.change, s.papers.change, s.baselines.change, s.recent.change, s.quantizers.change,
         s.budgets.change, s.max_new.change, s.record_maps.change, s.model.change, s.question.change],
        dash.plan,
        s.inputs(),
        s.plan,
        api_name="plan",
        trigger_mode="always_last",
        show_progress="hidden",
    )  # fmt: skip
    loading = s.load_btn.click(
        dash.choose_model,
        [s.model, s.model_state],
        [s.model, s.model_state, s.model_line, s.map_layer, s.map_head],
        api_name="load_model",
        concurrency_limit=1,
        concurrency_id="model",
    )
    loading.then(dash.plan, s.inputs(), s.plan, api_name=False, show_progress="hidden")
    if dash.limits.allow_model_choice:  # models downloaded or converted since the page was built
        gr.on(
            [demo.load],
            lambda: gr.update(choices=dash.offered()),
            None,
            s.model,
            api_name=False,
            show_progress="hidden",
        )
    run = setup.run_btn.click(
        gpu(dash.compare, dash.work),
        setup.inputs(),
        [v.status, *v.rendered()],
        api_name="compare",
        concurrency_limit=1,
        concurrency_id="model",
    )
    run.then(
        lambda data: gr.update(
            choices=[
                r["method"] if not r.get("budget") else f"{r['method']}@{r['budget']}"
                for r in (data or {}).get("runs", [])
                if r["method"] != "exact"
            ],
            value=[],
        ),
        v.state,
        v.shown,
        api_name=False,
    )
    setup.cancel_btn.click(
        dash.cancel,  # stops the model work itself; Gradio's own cancel lands between the generator's yields
        None,
        v.status,
        cancels=[run],
        api_name="cancel",
    )
    v.layer_pick.input(dash.view_errors, [v.state, v.layer_pick], v.err_step, api_name="view_errors")
    gr.on(
        [v.shown.input, v.strip_pick.input],
        dash.view_attention,
        [v.state, v.shown, v.strip_pick],
        [v.heat, v.strip],
        api_name="view_attention",
    )
    gr.on(
        [v.ret_step.release, v.ret_step.input],
        dash.view_retention,
        [v.state, v.ret_step],
        v.ret_plot,
        api_name="view_retention",
        trigger_mode="always_last",
        show_progress="hidden",
    )
    v.export_btn.click(dash.export, v.state, v.files, api_name="export")
    v.upload.upload(
        dash.load_json, [v.upload, v.layer_pick, v.strip_pick], [v.status, *v.rendered()], api_name="load_json"
    )


def launch_kwargs() -> dict:
    """Theme and css go to ``launch()`` in Gradio 6."""
    return {"theme": gr.themes.Soft(primary_hue="blue"), "css": CSS}
