"""The Gradio dashboard: set up a comparison, watch it run, and read it panel by panel.

Panels: setup (model, prompt + presets, methods grouped from the registry, budgets, new tokens,
per-method parameters with the papers' defaults, seed) · run progress and one card per run (text
with differences from exact highlighted, first divergence, bytes, saving, tokens/s) · memory
(gauges, bytes per step) · errors (attention relative error per step and per layer, KL and top-1
agreement) · attention (exact vs method heatmaps, kept-token strip over the prompt text) · what each
head keeps (one retention map per run, a step slider) · quality vs memory · export / import (JSON, CSV,
static HTML report) · the committed leaderboards, the papers' claims and the needle grid, drawn when the
page opens · about.

Everything shown is rendered from one stored result (``gr.State`` holding the result's JSON), so
changing the view never recomputes. Text from prompts and models is always escaped (shown as
text, never as HTML). Every event has an ``api_name``; model work runs one at a time.

Modules: ``config`` (limits, css) · ``gpu_lease`` (ZeroGPU: placement, the lease) · ``presets`` ·
``methods`` (the methods panel and parameter table) · ``cards`` (HTML pieces) · ``about`` · ``export``
(JSON, CSV, HTML report) · ``leaderboard_tab``, ``claims_tab``, ``grid_tab``, ``retention_view`` · ``dashboard``
(the callbacks) · ``page`` (``build_demo``, ``launch_kwargs``).
"""

from kvlab.ui.about import about_markdown
from kvlab.ui.cards import cards_html, diff_text_html, kept_strip_html, progress_html
from kvlab.ui.config import CSS, GROUP_TITLES, Limits
from kvlab.ui.dashboard import FIGURE_OUTPUTS, FIGURE_TITLES, Dashboard, LiveProbe, PageInputs
from kvlab.ui.export import export_files, metrics_csv, report_html
from kvlab.ui.gpu_lease import gpu
from kvlab.ui.methods import CORE_PAPER_METHODS, default_methods, method_groups, param_rows, params_from_rows
from kvlab.ui.page import build_demo, launch_kwargs
from kvlab.ui.prompt_presets import DEFAULT_PRESET, TASK_PRESETS, builtin_presets, presets

__all__ = [
    "CORE_PAPER_METHODS",
    "CSS",
    "DEFAULT_PRESET",
    "FIGURE_OUTPUTS",
    "FIGURE_TITLES",
    "GROUP_TITLES",
    "TASK_PRESETS",
    "Dashboard",
    "Limits",
    "LiveProbe",
    "PageInputs",
    "about_markdown",
    "build_demo",
    "builtin_presets",
    "cards_html",
    "default_methods",
    "diff_text_html",
    "export_files",
    "gpu",
    "kept_strip_html",
    "launch_kwargs",
    "method_groups",
    "metrics_csv",
    "param_rows",
    "params_from_rows",
    "presets",
    "progress_html",
    "report_html",
]
