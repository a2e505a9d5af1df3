"""The Gradio dashboard: set up a comparison, watch it run, and read it panel by panel.

Panels: setup (model, prompt + presets, methods grouped from the registry, budgets, new tokens,
per-method parameters with the papers' defaults, seed) · run progress and one card per run (text
with differences from exact highlighted, first divergence, bytes, saving, tokens/s) · memory
(gauges, bytes per step) · errors (attention relative error per step and per layer, KL and top-1
agreement) · attention (exact vs method heatmaps, kept-token strip over the prompt text) · quality
vs memory · export / import (JSON, CSV, static HTML report) · about.

Everything shown is rendered from one stored result (``gr.State`` holding the result's JSON), so
changing the view never recomputes. Text from prompts and models is always escaped (shown as
text, never as HTML). Every event has an ``api_name``; model work runs one at a time.
"""

from __future__ import annotations

import csv
import difflib
import html
import io
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
import torch

from kvlab import plots
from kvlab.budgets import BudgetError, parse_budgets
from kvlab.compressors import methods
from kvlab.engine import Engine, GenerationSettings, InputError, expand_runs
from kvlab.models import EMBEDDED, LoadedModel, ModelLoadError, load_model
from kvlab.results import CompareResult, RunResult

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "style.css").read_text() if (ASSETS / "style.css").is_file() else ""
GROUP_TITLES = {"paper": "Papers' methods", "baseline": "Baselines", "reference": "Reference"}


# ----- configuration ----------------------------------------------------------------------------
@dataclass
class Limits:
    """What a shared page allows (environment variables override the defaults)."""

    max_prompt_tokens: int = int(os.environ.get("KVLAB_MAX_PROMPT_TOKENS", 4096))
    max_new_tokens: int = int(os.environ.get("KVLAB_MAX_NEW_TOKENS", 256))
    allow_model_choice: bool = os.environ.get("KVLAB_ALLOW_MODEL_CHOICE", "0") == "1"
    queue_size: int = int(os.environ.get("KVLAB_QUEUE_SIZE", 16))


def gpu(fn: Callable) -> Callable:
    """``spaces.GPU`` on a ZeroGPU Space; a no-op everywhere else (the package is absent)."""
    try:
        import spaces  # type: ignore
    except ImportError:
        return fn
    return spaces.GPU(duration=int(os.environ.get("KVLAB_GPU_SECONDS", 120)))(fn)


# ----- presets ----------------------------------------------------------------------------------
def _reference_text(chars: int) -> str:
    from pydoc_data.topics import topics

    keys = ("assignment", "augassign", "assert", "atom-identifiers", "attribute-access", "binary", "bitwise")
    return "\n\n".join(topics[k] for k in keys)[:chars]


def _filler(n: int) -> str:
    line = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    return line * n


def builtin_presets() -> dict[str, str]:
    """Prompts for the preset picker (~1k tokens each, except free chat)."""
    doc = _reference_text(3800)
    half = _filler(24)
    lines = "\n".join(
        f"line {w}-{i}: REGISTER_CONTENT is <{(7919 * i) % 50000}>"
        for i, w in enumerate(("amber", "brisk", "cedar", "delta", "ember", "fjord") * 10)
    )
    return {
        "Document question": f"{doc}\n\nQuestion: according to the text above, what does an augmented assignment "
        "statement do? Answer in one sentence.",
        "Pass-key retrieval": "There is an important pass key hidden in a lot of irrelevant text. Find it.\n"
        f"{half}The pass key is 71432. Remember it. 71432 is the pass key.\n{half}"
        "What is the pass key?",
        "Line retrieval": f"Below is a record of lines. Memorize them.\n{lines}\n\n"
        "What is the REGISTER_CONTENT in line cedar-26?",
        "Free chat": "Explain in three sentences why the sky is blue.",
    }


TASK_PRESETS = {
    "Document question": "document",
    "Pass-key retrieval": "passkey",
    "Needle in prose": "needle",
    "Several needles": "multikey",
    "Line retrieval": "lines",
}


def presets(lm: LoadedModel | None = None, n_tokens: int = 1000) -> tuple[dict[str, str], dict[str, Any]]:
    """Preset prompts and, for task presets, their ``kvlab.tasks.Task`` (answer + scoring).

    Task prompts come from kvlab.tasks sized to ~``n_tokens`` for ``lm``; the built-in texts stand in
    when that is not possible.
    """
    texts, tasks = builtin_presets(), {}
    if lm is None:
        return texts, tasks
    try:
        from kvlab.tasks import make_task

        for label, name in TASK_PRESETS.items():
            task = make_task(name, n_tokens, 0, lm.encode)
            texts[label], tasks[label] = task.prompt, task
    except Exception:  # noqa: BLE001 - presets must never break the page
        pass
    return texts, tasks


DEFAULT_PRESET = "Document question"


# ----- methods and parameters -------------------------------------------------------------------
def method_groups() -> dict[str, list[tuple[str, str]]]:
    """Registry methods by group: {"paper": [(label, name)], "baseline": [...], "reference": [...]}."""
    out: dict[str, list[tuple[str, str]]] = {"reference": [], "paper": [], "baseline": []}
    for name, cls in methods().items():
        out.setdefault(cls.group, []).append((f"{cls.title or name} ({name})" if cls.title else name, name))
    return out


CORE_PAPER_METHODS = (
    "qjl",
    "subgen-kcenter",
    "balancekv",
    "scissorhands",
)  # one per paper (SubGen as run in its experiments): the default comparison


def default_methods() -> tuple[list[str], list[str]]:
    """The default comparison: exact + the four papers' methods (their variants stay one tick away).

    Falls back to every registered paper method, then to StreamingLLM, while the registry is partial.
    """
    groups = method_groups()
    registered = [n for _, n in groups.get("paper", [])]
    papers = [n for n in CORE_PAPER_METHODS if n in registered] or registered
    baselines = [] if papers else [n for _, n in groups.get("baseline", []) if n == "streaming"]
    return papers, baselines


def param_rows() -> list[list[str]]:
    """One row per (method, parameter): method, parameter, value (editable), paper default, meaning."""
    rows = []
    for name, cls in methods().items():
        for p in cls.params:
            d = "auto" if p.default is None else str(p.default)
            rows.append([name, p.name, d, d, p.help])
    return rows


def params_from_rows(rows: Any, chosen: list[str]) -> dict[str, dict]:
    """Overrides for the chosen methods: rows whose value differs from the default."""
    if rows is None:
        return {}
    if hasattr(rows, "values") and hasattr(rows, "columns"):
        rows = rows.values.tolist()
    out: dict[str, dict] = {}
    for row in rows:
        if len(row) < 4:
            continue
        method, name, value, default = (str(x).strip() if x is not None else "" for x in row[:4])
        if method in chosen and value and value != default and value.lower() not in ("auto", "none"):
            out.setdefault(method, {})[name] = value
    return out


# ----- live view of a run -----------------------------------------------------------------------
@dataclass
class LiveProbe:
    """Reads each cache's bytes right after compression and, when greedy, the tokens as they come.

    It defines no ``on_attend``: the engine then skips the per-row attention hook for it.
    """

    n_runs: int
    greedy: bool
    bytes_now: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    comps: list = field(default_factory=list)

    def on_prefill(self, state, logits, compressors) -> None:
        self.comps = list(compressors)
        self.bytes_now = [c.nbytes() for c in compressors]
        first = int(torch.argmax(logits)) if self.greedy else None
        self.tokens = [[first] if first is not None else [] for _ in compressors]

    def on_step(self, step, rows, logits) -> None:
        for row, i in enumerate(rows):
            self.bytes_now[i] = self.comps[i].nbytes()
            if self.greedy:
                self.tokens[i].append(int(torch.argmax(logits[row])))

    def finish(self, runs) -> None:
        self.comps = []


def metric_probes(record: bool, map_layer: int | None, map_head: int) -> list:
    """The metrics probe (attention error, KL / agreement, attention maps) when measurements are on."""
    if not record:
        return []
    from kvlab.metrics import MetricsProbe, ProbeSettings

    return [MetricsProbe(ProbeSettings(map_layer=map_layer, map_head=map_head))]


def add_text_metrics(result: CompareResult, task=None) -> None:
    """Cheap, always-on text metrics (diff, first divergence, similarity) and the task score."""
    from kvlab.metrics import add_text_metrics as add

    add(result)
    if task is not None:
        from kvlab.tasks import score_result

        score_result(task, result)


# ----- HTML pieces (every user or model text goes through html.escape) ---------------------------
def progress_html(frac: float, message: str) -> str:
    pct = max(0.0, min(1.0, frac)) * 100
    return (
        f"<div class='kv-progress' role='progressbar' aria-valuenow='{pct:.0f}'>"
        f"<div class='kv-progress-bar' style='width:{pct:.1f}%'></div></div>"
        f"<div class='kv-progress-msg'>{html.escape(message)}</div>"
    )


def _pieces(ids: list[int], lm: LoadedModel | None) -> list[str]:
    if lm is None:
        return [f"⟨{i}⟩" for i in ids]
    return [lm.tokenizer.decode([i], skip_special_tokens=True) for i in ids]


def diff_opcodes(run: RunResult, exact: RunResult | None) -> list:
    ops = plots.metric(run, "diff")
    if ops:
        return ops
    if exact is None:
        return []
    return [list(o) for o in difflib.SequenceMatcher(a=exact.token_ids, b=run.token_ids, autojunk=False).get_opcodes()]


def first_divergence(run: RunResult, exact: RunResult | None) -> int | None:
    fd = plots.metric(run, "first_divergence")
    if fd is not None or exact is None:
        return fd
    for i, (a, b) in enumerate(zip(exact.token_ids, run.token_ids)):
        if a != b:
            return i
    return None if len(exact.token_ids) == len(run.token_ids) else min(len(exact.token_ids), len(run.token_ids))


def diff_text_html(run: RunResult, exact: RunResult | None, lm: LoadedModel | None) -> str:
    """The run's text, with the tokens that differ from the exact run highlighted."""
    if exact is None or run is exact or not run.token_ids:
        return html.escape(run.text)
    pieces = _pieces(run.token_ids, lm) if lm is not None else None
    if pieces is None or "".join(pieces).strip() != run.text.strip():
        pieces = None
    if pieces is None:  # no tokenizer for this result: show plain text
        return html.escape(run.text)
    out = []
    for tag, _i1, _i2, j1, j2 in diff_opcodes(run, exact):
        seg = html.escape("".join(pieces[j1:j2]))
        if not seg:
            if tag == "delete":
                out.append("<span class='kv-del' title='exact had more here'>⌫</span>")
            continue
        out.append(seg if tag == "equal" else f"<mark class='kv-diff'>{seg}</mark>")
    return "".join(out)


def _card(
    run: RunResult, exact: RunResult | None, lm: LoadedModel | None, group: str, color: str, live: bool = False
) -> str:
    ex_bytes = plots.exact_bytes_at_prefill(run)
    held = 100 * run.kv_bytes / ex_bytes if ex_bytes else 0.0
    if run is exact or exact is None:
        div = "reference" if run is exact else "no exact run to compare"
    elif live:
        div = "running…"
    else:
        fd = first_divergence(run, exact)
        sim = plots.metric(run, "text_similarity")
        div = "identical to exact" if fd is None else f"differs from token {fd}"
        if plots._finite(sim):
            div += f" · similarity {sim:.2f}"
    score = plots.metric(run, "task_score")
    extra = f"<span class='kv-chip'>task {score:.2f}</span>" if plots._finite(score) else ""
    tps = f"{run.timings.tokens_per_s:.1f} tok/s" if run.timings.tokens_per_s else "—"
    return (
        f"<div class='kv-card kv-{html.escape(group)}' style='border-top-color:{color}'>"
        f"<div class='kv-card-head'><b>{html.escape(run.label)}</b>"
        f"<span class='kv-chip'>{html.escape(GROUP_TITLES.get(group, group))}</span>{extra}</div>"
        f"<div class='kv-stats'><span>{run.kv_bytes / 1024:,.0f} / {ex_bytes / 1024:,.0f} KiB</span>"
        f"<span>{100 - held:.0f}% saved</span><span>{tps}</span></div>"
        f"<div class='kv-div'>{html.escape(div)}</div>"
        f"<pre class='kv-text'>{diff_text_html(run, exact, lm)}</pre></div>"
    )


def cards_html(result: CompareResult | None, lm: LoadedModel | None, live: bool = False) -> str:
    if result is None or not result.runs:
        return (
            "<div class='kv-empty'>Run a comparison (or load a JSON export) to see one card per method × budget.</div>"
        )
    exact = next((r for r in result.runs if r.method == "exact"), None)
    groups = {n: c.group for n, c in methods().items()}
    return (
        "<div class='kv-cards'>"
        + "".join(
            _card(
                r, exact, lm, groups.get(r.method, "baseline"), plots.color_of(result, r.label), live and r is not exact
            )
            for r in result.runs
        )
        + "</div>"
    )


def kept_strip_html(result: CompareResult | None, label: str | None, lm: LoadedModel | None) -> str:
    """The prompt's text, token by token; tokens the chosen run evicted are struck through and faded.

    Below it, one thin strip per run: each cell a prompt position, dark where kept (at the map's
    layer/KV head) or shaded by the fraction of (layer, KV head) pairs keeping it.
    """
    if result is None or not result.runs:
        return "<div class='kv-empty'>no result yet</div>"
    runs = plots.compressed_runs(result)
    bars = [_density_bar(r, result.prompt_tokens) for r in runs]
    bars = [b for b in bars if b]
    run = next((r for r in runs if r.label == label), runs[0] if runs else None)
    kept = plots.kept_of(run) if run is not None else None
    if run is not None and kept is None and plots.attn_map(run) is not None:
        parts_note = (
            f"<div class='kv-strip-title'>{html.escape(run.label)} keeps every prompt position "
            "(compressed), so no token is evicted</div>"
        )
    else:
        parts_note = ""
    if run is None or (kept is None and not bars):
        return (
            "<div class='kv-empty'>no kept positions in this result (turn the measurements on; sketched or "
            "clustered caches keep no token positions)</div>"
        )
    parts = [parts_note] if parts_note else []
    if kept is not None:
        keep = set(kept)
        pieces = _pieces(result.prompt_token_ids, lm)
        toks = "".join(
            f"<span class='{'kv-kept' if i in keep else 'kv-evicted'}'>{html.escape(p)}</span>"
            for i, p in enumerate(pieces)
        )
        site = plots.map_site(result)
        where = f" (layer {site[0]}, KV head of query head {site[1]})" if site else ""
        parts.append(
            f"<div class='kv-strip-title'>{html.escape(run.label)}: {len(keep)} of "
            f"{result.prompt_tokens} prompt tokens kept{html.escape(where)}</div>"
            f"<div class='kv-strip-text'>{toks}</div>"
        )
    if bars:
        parts.append("<div class='kv-strip-title'>Kept density over all layers and KV heads</div>" + "".join(bars))
    return "<div class='kv-strip'>" + "".join(parts) + "</div>"


def _density_bar(run: RunResult, n: int) -> str:
    dens = (run.extras or {}).get("kept_density")
    if not dens:
        return ""
    grad = ",".join(
        f"rgba(31,119,180,{0.08 + 0.92 * float(d):.2f}) {100 * i / len(dens):.2f}% {100 * (i + 1) / len(dens):.2f}%"
        for i, d in enumerate(dens)
    )
    return (
        f"<div class='kv-bar-row'><span class='kv-bar-label'>{html.escape(run.label)}</span>"
        f"<span class='kv-bar' style='background:linear-gradient(90deg,{grad})'></span></div>"
    )


# ----- about ------------------------------------------------------------------------------------
def about_markdown() -> str:
    lines = ["## The methods", ""]
    for group in ("reference", "paper", "baseline"):
        members = [(n, c) for n, c in methods().items() if c.group == group]
        if not members:
            continue
        lines.append(f"### {GROUP_TITLES[group]}")
        for name, cls in members:
            paper = f" — *{_md(cls.paper)}*" if cls.paper else ""
            lines.append(f"* **{_md(cls.title or name)}** (`{name}`): {_md(cls.summary)}{paper}")
        lines.append("")
    lines += [
        "## Budgets and bytes",
        "",
        "* A budget is a fraction of the bytes the exact cache holds for the same tokens (`0.25`), or a "
        "token count per layer and KV head (`512t`); several at once, comma-separated. Every method runs at "
        "every budget; `exact` runs once.",
        "* Each method maps the budget onto its own knobs (tokens kept, sketch size, bits); the chosen knobs "
        "are stored with the result.",
        "* Bytes are counted from the tensors each cache really holds — packed bits, norms, scales, zero "
        "points, indices, positions, weights, score counters — never from a formula. The exact cache holds "
        "layers × KV heads × tokens × head_dim × 2 × dtype size.",
        "* Prefill-only methods keep generated tokens uncompressed; streaming methods hold their budget while "
        "decoding. The bytes-per-step chart shows both.",
    ]
    return "\n".join(lines)


def _md(text: str) -> str:
    return re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text or "")


# ----- export -----------------------------------------------------------------------------------
SUMMARY_METRICS = (
    "attn_rel_error_mean",
    "kl_mean",
    "top1_agreement",
    "perplexity",
    "first_divergence",
    "text_similarity",
    "task_score",
)


def metrics_csv(result: CompareResult) -> str:
    """One row per run: bytes, saving, timings and the scalar metrics."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        [
            "run",
            "method",
            "budget",
            "kv_bytes",
            "exact_bytes",
            "fraction_held",
            "tokens_per_s",
            "prefill_s",
            "compress_s",
            "decode_s",
            *SUMMARY_METRICS,
            "text",
        ]
    )
    for r in result.runs:
        ex = plots.exact_bytes_at_prefill(r)
        w.writerow(
            [
                r.label,
                r.method,
                r.budget or "",
                r.kv_bytes,
                ex,
                f"{r.kv_bytes / ex:.4f}" if ex else "",
                f"{r.timings.tokens_per_s:.2f}",
                f"{r.timings.prefill_s:.3f}",
                f"{r.timings.compress_s:.3f}",
                f"{r.timings.decode_s:.3f}",
                *["" if plots.metric(r, k) is None else plots.metric(r, k) for k in SUMMARY_METRICS],
                r.text,
            ]
        )
    return buf.getvalue()


def report_html(result: CompareResult, lm: LoadedModel | None = None) -> str:
    """A self-contained static HTML page of the run: settings, cards and every overview figure."""
    figs = plots.overview_figures(result)
    figs["attention"] = plots.attention_heatmaps(result)
    body = []
    for i, fig in enumerate(figs.values()):
        body.append(
            fig.to_html(
                full_html=False, include_plotlyjs="inline" if i == 0 else False, default_height=fig.layout.height
            )
        )
    settings = html.escape(json.dumps(result.settings))
    prompt = html.escape(result.prompt[:4000] + ("…" if len(result.prompt) > 4000 else ""))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvlab report</title>"
        f"<style>{CSS} body{{font-family:system-ui,sans-serif;max-width:1200px;margin:auto;padding:16px}}</style>"
        "</head><body><h1>kvlab report</h1>"
        f"<p>Model <b>{html.escape(str(result.model.get('id', '')))}</b> on "
        f"{html.escape(str(result.model.get('device', '')))}"
        f" · prompt {result.prompt_tokens} tokens · settings <code>{settings}</code></p>"
        f"<details><summary>Prompt</summary><pre class='kv-text'>{prompt}</pre></details>"
        f"{cards_html(result, lm)}{''.join(body)}</body></html>"
    )


def export_files(result: CompareResult, lm: LoadedModel | None) -> list[str]:
    out = Path(tempfile.mkdtemp(prefix="kvlab-export-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = {
        out / f"kvlab-{stamp}.json": result.dumps(),
        out / f"kvlab-{stamp}-metrics.csv": metrics_csv(result),
        out / f"kvlab-{stamp}-report.html": report_html(result, lm),
    }
    for p, text in paths.items():
        p.write_text(text, encoding="utf-8")
    return [str(p) for p in paths]


# ----- the page ---------------------------------------------------------------------------------
class Dashboard:
    """The callbacks behind the page; holds the model(s) loaded once at start."""

    def __init__(self, lm: LoadedModel, limits: Limits | None = None):
        self.lm = lm
        self.limits = limits or Limits()
        self.engines: dict[str, Engine] = {EMBEDDED: Engine(lm)}
        self.tasks: dict[str, Any] = {}

    # ----- model work ----------------------------------------------------------------------
    def engine_for(self, model: str) -> Engine:
        model = (model or EMBEDDED).strip() or EMBEDDED
        if model not in self.engines:
            if not self.limits.allow_model_choice:
                raise InputError(
                    "this page runs the embedded model only (set KVLAB_ALLOW_MODEL_CHOICE=1 to allow others)"
                )
            try:
                self.engines[model] = Engine(load_model(model))
            except ModelLoadError as exc:
                raise InputError(str(exc)) from None
        return self.engines[model]

    def validate(self, prompt: str, papers, baselines, budgets: str, max_new, model: str):
        if not (prompt or "").strip():
            raise InputError("the prompt is empty; type some text or pick a preset")
        chosen = ["exact"] + list(papers or []) + list(baselines or [])
        if len(chosen) == 1:
            raise InputError("no method selected; tick at least one of the papers' methods or baselines")
        try:
            bl = parse_budgets(budgets)
        except BudgetError as exc:
            raise InputError(str(exc)) from None
        max_new = int(max_new or 0)
        if not 1 <= max_new <= self.limits.max_new_tokens:
            raise InputError(f"max new tokens must be in 1..{self.limits.max_new_tokens}")
        engine = self.engine_for(model)
        task = next((t for t in self.tasks.values() if t.prompt == prompt), None)
        if task is not None:  # a task preset: its answer prefix opens the assistant's turn
            from kvlab.tasks import prompt_ids

            ids = prompt_ids(engine.lm, task)
        else:
            ids = engine.lm.encode(prompt)
        if len(ids) > self.limits.max_prompt_tokens:
            raise InputError(
                f"the prompt has {len(ids)} tokens; this page allows at most "
                f"{self.limits.max_prompt_tokens} (set KVLAB_MAX_PROMPT_TOKENS to change it)"
            )
        return engine, ids, chosen, bl, max_new

    def compare(
        self,
        model,
        prompt,
        papers,
        baselines,
        budgets,
        max_new,
        seed,
        param_table,
        record_maps,
        map_layer=None,
        map_head=0,
        progress=gr.Progress(),  # noqa: B008 (gradio injects progress through this default)
    ):
        """Generator: yields (status, cards, state, *figures) as the comparison runs."""
        n_out = len(FIGURE_OUTPUTS) + 3
        try:
            engine, ids, chosen, bl, max_new = self.validate(prompt, papers, baselines, budgets, max_new, model)
            specs = expand_runs(chosen, bl, params_from_rows(param_table, chosen))
            gen = GenerationSettings(max_new_tokens=max_new, seed=int(seed or 0))
            live = LiveProbe(len(specs), greedy=not gen.do_sample)
            probes = [live] + metric_probes(bool(record_maps), self._map_layer(map_layer, engine), int(map_head or 0))
            result = None
            last_yield = 0.0
            for ev in engine.stream(ids, specs, gen, prompt_text=prompt, probes=probes):
                if ev.progress >= 0:
                    progress(ev.progress, desc=ev.message)
                if ev.kind == "done":
                    result = ev.result
                    break
                now = time.perf_counter()
                if live.bytes_now and (ev.kind != "step" or now - last_yield > 0.5):
                    last_yield = now
                    partial = self._partial(engine, ids, specs, live)
                    yield (
                        progress_html(ev.progress, ev.message),
                        cards_html(partial, engine.lm, live=True),
                        *[gr.skip()] * (n_out - 2),
                    )
                elif ev.kind in ("prefill", "compress"):
                    yield (progress_html(ev.progress, ev.message), *[gr.skip()] * (n_out - 1))
        except InputError as exc:
            raise gr.Error(str(exc)) from None
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise gr.Error("out of GPU memory: try a shorter prompt, fewer methods or fewer new tokens") from None
        add_text_metrics(result, next((t for t in self.tasks.values() if t.prompt == prompt), None))
        data = result.to_json()
        msg = (
            f"done: {len(result.runs)} runs on {result.prompt_tokens} prompt tokens in "
            f"{result.timings.get('compare_s', 0):.1f} s"
        )
        yield (progress_html(1.0, msg), *self.render(data, "mean", None))

    @staticmethod
    def _map_layer(value, engine: Engine) -> int | None:
        if value is None or str(value).strip() in ("", "auto"):
            return None
        layer = int(value)
        if not 0 <= layer < engine.info.n_layers:
            raise InputError(f"map layer {layer} is out of range; allowed: 0..{engine.info.n_layers - 1}")
        return layer

    def _partial(self, engine: Engine, ids, specs, live: LiveProbe) -> CompareResult:
        from kvlab.budgets import exact_bytes

        runs = []
        for spec, b, toks in zip(specs, live.bytes_now, live.tokens or [[] for _ in specs]):
            r = RunResult(
                method=spec.method,
                budget=None if spec.budget is None else spec.budget.label,
                params={},
                kv_bytes=b,
                exact_kv_bytes_per_step=[exact_bytes(engine.info, len(ids))],
                text=engine.lm.decode(toks) if toks else "…",
            )
            runs.append(r)
        return CompareResult(
            model=engine.info.to_json(),
            prompt="",
            prompt_tokens=len(ids),
            prompt_token_ids=[],
            settings={},
            timings={},
            runs=runs,
        )

    # ----- views (no recomputation) --------------------------------------------------------
    def _lm_for(self, result: CompareResult) -> LoadedModel | None:
        return self.lm if result.model.get("id") == self.lm.info.id else None

    def render(self, data: dict | None, layer_choice, strip_label):
        """Everything below the progress bar, from the stored result JSON."""
        if not data:
            return (
                cards_html(None, None),
                None,
                *[plots.no_data(t, "no result yet") for t in FIGURE_TITLES],
                kept_strip_html(None, None, None),
                gr.update(),
                gr.update(),
            )
        result = CompareResult.from_json(data)
        lm = self._lm_for(result)
        labels = [r.label for r in plots.compressed_runs(result)]
        layers = ["mean"] + [str(i) for i in range(plots.n_layers(result))]
        strip = strip_label if strip_label in labels else (labels[0] if labels else None)
        return (
            cards_html(result, lm),
            data,
            plots.gauges(result),
            plots.bytes_per_step(result),
            plots.error_per_step(result, layer_choice),
            plots.error_per_layer(result),
            plots.kl_and_agreement(result),
            plots.attention_heatmaps(result),
            plots.quality_vs_memory(result),
            kept_strip_html(result, strip, lm),
            gr.update(choices=layers, value=layer_choice if layer_choice in layers else "mean"),
            gr.update(choices=labels, value=strip),
        )

    def view_errors(self, data, layer_choice):
        if not data:
            return plots.no_data(FIGURE_TITLES[2], "no result yet")
        return plots.error_per_step(CompareResult.from_json(data), layer_choice)

    def view_attention(self, data, shown, strip_label):
        if not data:
            return plots.no_data(FIGURE_TITLES[5], "no result yet"), kept_strip_html(None, None, None)
        result = CompareResult.from_json(data)
        return (
            plots.attention_heatmaps(result, shown or None),
            kept_strip_html(result, strip_label, self._lm_for(result)),
        )

    # ----- files ---------------------------------------------------------------------------
    def export(self, data):
        if not data:
            raise gr.Error("nothing to export yet: run a comparison or load a JSON file first")
        result = CompareResult.from_json(data)
        return export_files(result, self._lm_for(result))

    def load_json(self, path, layer_choice, strip_label):
        if not path:
            raise gr.Error("choose a kvlab JSON export to load")
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            result = CompareResult.from_json(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise gr.Error(f"this file is not a kvlab result JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
        msg = f"loaded {len(result.runs)} runs from {Path(path).name} (not recomputed)"
        return (progress_html(1.0, msg), *self.render(result.to_json(), layer_choice, strip_label))


FIGURE_TITLES = (
    "Cache size",
    "Bytes per decode step",
    "Attention relative error per decode step",
    "Attention relative error per layer",
    "Teacher-forced fidelity",
    "Attention over the prompt",
    "Quality vs memory",
)
FIGURE_OUTPUTS = FIGURE_TITLES + ("kept strip", "layer picker", "strip picker")


def build_demo(lm: LoadedModel, limits: Limits | None = None) -> gr.Blocks:
    """The page. Launch with ``launch_kwargs()`` (theme, css) and ``queue_kwargs``."""
    dash = Dashboard(lm, limits)
    preset_texts, dash.tasks = presets(lm)
    lim = dash.limits
    groups = method_groups()
    papers0, baselines0 = default_methods()

    with gr.Blocks(title="kvlab — KV-cache compression side by side") as demo:
        gr.HTML(
            "<div class='kv-header'><h1>kvlab</h1><p>KV-cache compression methods side by side on a real "
            f"model: texts, bytes, attention error, attention maps. Model: <b>{html.escape(lm.info.id)}</b> "
            f"on {html.escape(lm.info.device)}.</p></div>"
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                preset = gr.Dropdown(
                    list(preset_texts),
                    value=DEFAULT_PRESET,
                    label="Preset",
                    info="document question, pass-key, line retrieval or free chat",
                )
                prompt = gr.Textbox(
                    value=preset_texts[DEFAULT_PRESET], label="Prompt", lines=9, max_lines=16, elem_id="kv-prompt"
                )
                model = gr.Textbox(
                    value=EMBEDDED,
                    label="Model",
                    interactive=lim.allow_model_choice,
                    info="'embedded' (SmolLM2-135M-Instruct)"
                    + (
                        ", a Hugging Face id or a local folder"
                        if lim.allow_model_choice
                        else "; other models: set KVLAB_ALLOW_MODEL_CHOICE=1"
                    ),
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
                with gr.Row():
                    budgets = gr.Textbox(
                        value="0.25",
                        label="Budgets",
                        elem_id="kv-budgets",
                        info="fractions of the exact bytes or token counts: 0.5, 0.25, 512t",
                    )
                    max_new = gr.Slider(
                        1, lim.max_new_tokens, value=min(32, lim.max_new_tokens), step=1, label="Max new tokens"
                    )
                with gr.Row():
                    seed = gr.Number(value=0, precision=0, label="Seed", minimum=0)
                    record_maps = gr.Checkbox(
                        value=True,
                        label="Measure attention error, KL & maps",
                        info="the costly measurements (a shadow exact cache)",
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
                run_btn = gr.Button("Run comparison", variant="primary", elem_id="kv-run")
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
        status = gr.HTML(progress_html(0.0, "ready"), elem_id="kv-status")
        cards = gr.HTML(cards_html(None, None), elem_id="kv-cards")
        state = gr.State(None)
        with gr.Tabs():
            with gr.Tab("Memory", id="memory"):
                gauges = gr.Plot(label="Cache size", elem_id="kv-gauges")
                bytes_fig = gr.Plot(label="Bytes per step", elem_id="kv-bytes")
            with gr.Tab("Errors", id="errors"):
                layer_pick = gr.Dropdown(
                    ["mean"], value="mean", label="Layer (for the per-step curve)", elem_id="kv-layer"
                )
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
            with gr.Tab("Quality vs memory", id="quality"):
                qvm = gr.Plot(label="Quality vs memory", elem_id="kv-qvm")
            with gr.Tab("Export / import", id="files"):
                with gr.Row():
                    export_btn = gr.Button("Export JSON + CSV + HTML report", elem_id="kv-export")
                    files = gr.File(label="Downloads", file_count="multiple", interactive=False)
                upload = gr.File(
                    label="Load a kvlab JSON export (viewed without recomputing)", file_types=[".json"], type="filepath"
                )
            with gr.Tab("About", id="about"):
                gr.Markdown(about_markdown())

        views = [cards, state, gauges, bytes_fig, err_step, err_layer, kl_fig, heat, qvm, strip, layer_pick, strip_pick]
        preset.change(lambda name: preset_texts.get(name, ""), preset, prompt, api_name="preset")
        run_btn.click(
            gpu(dash.compare),
            [model, prompt, papers, baselines, budgets, max_new, seed, param_table, record_maps, map_layer, map_head],
            [status, *views],
            api_name="compare",
            concurrency_limit=1,
            concurrency_id="model",
        ).then(
            lambda data: gr.update(
                choices=[
                    r["method"] if not r.get("budget") else f"{r['method']}@{r['budget']}"
                    for r in (data or {}).get("runs", [])
                    if r["method"] != "exact"
                ],
                value=[],
            ),
            state,
            shown,
            api_name=False,
        )
        layer_pick.input(dash.view_errors, [state, layer_pick], err_step, api_name="view_errors")
        gr.on(
            [shown.input, strip_pick.input],
            dash.view_attention,
            [state, shown, strip_pick],
            [heat, strip],
            api_name="view_attention",
        )
        export_btn.click(dash.export, state, files, api_name="export")
        upload.upload(dash.load_json, [upload, layer_pick, strip_pick], [status, *views], api_name="load_json")
    return demo


def launch_kwargs() -> dict:
    """Theme and css go to ``launch()`` in Gradio 6."""
    return {"theme": gr.themes.Soft(primary_hue="blue"), "css": CSS}
