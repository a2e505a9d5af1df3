"""The page's callbacks: run a comparison (streaming cards as it goes) and render a stored result.

Everything shown is rendered from one stored result (``gr.State`` holding the result's JSON), so
changing the view never recomputes. Model work goes through ``kvlab.run``, the flow the CLI and
the sweeps use.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr
import torch

from kvlab import faults, plots
from kvlab.admission import AdmissionError, AdmissionLimits, Estimate, admit, estimate
from kvlab.budgets import BudgetError, exact_bytes, parse_budgets
from kvlab.engine import Engine, GenerationSettings, InputError, RunSpec
from kvlab.gpu import WorkSize
from kvlab.metrics import ProbeSettings
from kvlab.models import EMBEDDED, LoadedModel, ModelLoadError, load_model
from kvlab.results import QUERY_AGNOSTIC, CompareResult, RunResult
from kvlab.run import Comparison, stream
from kvlab.schema import ResultFileError, load_result_text
from kvlab.tasks import Task
from kvlab.ui.cards import cards_html, kept_strip_html, progress_html
from kvlab.ui.config import Limits
from kvlab.ui.export import export_files
from kvlab.ui.methods import params_from_rows

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
        if step == 0:  # a question asked after compression: each run's first token comes from its own logits
            self.tokens = [[] for _ in self.comps]
        for row, i in enumerate(rows):
            self.bytes_now[i] = self.comps[i].nbytes()
            if self.greedy:
                self.tokens[i].append(int(torch.argmax(logits[row])))

    def finish(self, runs) -> None:
        self.comps = []

    def _ran(self, specs: list[RunSpec]) -> list[RunSpec]:
        """The specs whose runs were compressed (a refused budget never reaches the probe)."""
        ran = {(c.name, c.budget) for c in self.comps}
        return [s for s in specs if (s.method, s.budget) in ran] if ran else specs

    def partial(self, engine: Engine, specs: list[RunSpec], prompt_tokens: int) -> CompareResult:
        """What is known so far, as a result for the cards: bytes now and, when greedy, the text so far."""
        runs = [
            RunResult(
                method=spec.method,
                budget=None if spec.budget is None else spec.budget.label,
                params={},
                kv_bytes=b,
                exact_kv_bytes_per_step=[exact_bytes(engine.info, prompt_tokens)],
                text=engine.lm.decode(toks) if toks else "…",
            )
            for spec, b, toks in zip(self._ran(specs), self.bytes_now, self.tokens or [[] for _ in specs])
        ]
        return CompareResult(
            model=engine.info.to_json(),
            prompt="",
            prompt_tokens=prompt_tokens,
            prompt_token_ids=[],
            settings={},
            timings={},
            runs=runs,
        )


def whole_number(value, what: str, default: int) -> int:
    """``value`` (a number or its text; None or empty: ``default``) as an int, else ``InputError`` naming ``what``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        number = float(value)
        if number != int(number):
            raise ValueError
        return int(number)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{what} must be a whole number, got {str(value)[:40]!r}") from None


def _question_text(question) -> str:
    """The question box's text, stripped ("" when empty or only spaces: no question is asked)."""
    if question is None:
        return ""
    if not isinstance(question, str):
        raise InputError(f"the question must be text, got {type(question).__name__}")
    return question.strip()


def text_error(message: str) -> gr.Error:
    """A page error whose message is shown as text: Gradio renders a toast's message as (sanitized) HTML."""
    return gr.Error(html.escape(message, quote=False))


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#|~!])")


def markdown_text(message: str) -> str:
    """``message`` for a Markdown component, shown as text: no HTML, links or emphasis from user input."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(message, quote=False))


def _ended_early(result: CompareResult) -> str:
    """The status line's note on runs that did not run to the end (an error, the time limit)."""
    failed = sum(r.finish_reason == "error" for r in result.runs)
    stopped = next((r.error for r in result.runs if r.finish_reason == "time_limit"), "")
    note = f" · {failed} ended on an error (see their cards)" if failed else ""
    return note + (f" · {stopped}; the texts so far are kept" if stopped else "")


class Dashboard:
    """The callbacks behind the page; holds the model(s) loaded once at start."""

    def __init__(self, lm: LoadedModel, limits: Limits | None = None):
        self.lm = lm
        self.limits = limits or Limits()
        self.admission = AdmissionLimits.from_env()
        self.engines: dict[str, Engine] = {EMBEDDED: Engine(lm)}
        self.tasks: dict[str, Task] = {}  # preset label -> its task (set by the page)

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

    def request(
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
        map_layer,
        map_head,
        task,
        question="",
    ) -> tuple[Engine, Comparison, int]:
        """The page's inputs as a ``Comparison``, checked against the page's limits.

        Returns the engine of the chosen model, the comparison and the prompt's token count. ``task``
        is the preset's task while its prompt is unedited (the page drops it on any edit), else None.
        ``question``: asked after compressing the prompt (query-agnostic); the prompt is then a
        context and a preset's task is not scored.
        """
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("the prompt is empty; type some text or pick a preset")
        question = _question_text(question)
        for what, text in (("prompt", prompt), ("question", question)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(f"the {what} holds characters that are not valid Unicode (lone surrogates)") from None
        chosen = ["exact"] + list(papers or []) + list(baselines or [])
        if len(chosen) == 1:
            raise InputError("no method selected; tick at least one of the papers' methods or baselines")
        try:
            bl = parse_budgets(budgets)
        except BudgetError as exc:
            raise InputError(str(exc)) from None
        max_new = whole_number(max_new, "max new tokens", 0)
        if not 1 <= max_new <= self.limits.max_new_tokens:
            raise InputError(f"max new tokens must be in 1..{self.limits.max_new_tokens}")
        engine = self.engine_for(model)
        measure = None
        if record_maps:
            head = whole_number(map_head, "the attention-map head", 0)
            if not 0 <= head < engine.info.n_heads:
                raise InputError(f"map head {head} is out of range; allowed: 0..{engine.info.n_heads - 1}")
            measure = ProbeSettings(map_layer=self._map_layer(map_layer, engine), map_head=head)
        comparison = Comparison(
            task if isinstance(task, Task) and not question else prompt,
            chosen,
            bl,
            params=params_from_rows(param_table, chosen),
            settings=GenerationSettings(max_new_tokens=max_new, seed=whole_number(seed, "the seed", 0)),
            measure=measure,
            questions=[question] if question else (),
        )
        n = len(comparison.encode(engine.lm))
        if n > self.limits.max_prompt_tokens:
            what = "the context and the question have" if question else "the prompt has"
            raise InputError(
                f"{what} {n} tokens; this page allows at most "
                f"{self.limits.max_prompt_tokens} (set KVLAB_MAX_PROMPT_TOKENS to change it)"
            )
        try:
            admit(self.estimate(engine, comparison, n), self.admission, engine.lm.device)
        except AdmissionError as exc:
            raise InputError(str(exc)) from None
        return engine, comparison, n

    @staticmethod
    def estimate(engine: Engine, comparison: Comparison, n: int) -> Estimate:
        """The request's planned peak memory (no model work)."""
        budgets = [spec.budget for spec in comparison.check()]
        return estimate(engine.info, n, budgets, comparison.settings.max_new_tokens, comparison.measure is not None)

    def plan(self, *inputs) -> str:
        """One line for the page before Run: the run count and the estimate, or why it would be refused."""
        try:
            engine, comparison, n = self.request(*inputs)
        except InputError as exc:
            return f"⚠ {markdown_text(str(exc))}"
        est = self.estimate(engine, comparison, n)
        return f"{est.summary()} · within this page's limits"

    def work(self, model, prompt, papers, baselines, budgets, max_new, *rest, **kw) -> WorkSize:
        """The request's size for a GPU lease, from the raw inputs (cheap: tokenizing only)."""
        engine = self.engine_for(model)
        runs = (1 + len(papers or []) + len(baselines or [])) * max(1, len(set(parse_budgets(budgets))))
        record = rest[3] if len(rest) > 3 else True
        return WorkSize(len(engine.lm.encode(prompt or "")), runs, int(max_new or 1), bool(record))

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
        task=None,
        question="",
        progress=gr.Progress(),  # noqa: B008 (gradio injects progress through this default)
    ):
        """Generator: yields (status, cards, state, *figures) as the comparison runs."""
        n_out = len(FIGURE_OUTPUTS) + 3
        try:
            engine, comparison, n = self.request(
                model,
                prompt,
                papers,
                baselines,
                budgets,
                max_new,
                seed,
                param_table,
                record_maps,
                map_layer,
                map_head,
                task,
                question,
            )
            specs = comparison.check()
            live = LiveProbe(len(specs), greedy=not comparison.settings.do_sample)
            result = None
            last_yield = 0.0
            for ev in stream(engine, comparison, probes=[live]):
                if ev.progress >= 0:
                    progress(ev.progress, desc=ev.message)
                if ev.kind == "done":
                    result = ev.result
                    break
                now = time.perf_counter()
                if live.bytes_now and (ev.kind != "step" or now - last_yield > 0.5):
                    last_yield = now
                    yield (
                        progress_html(ev.progress, ev.message),
                        cards_html(live.partial(engine, specs, n), engine.lm, live=True),
                        *[gr.skip()] * (n_out - 2),
                    )
                elif ev.kind in ("prefill", "compress"):
                    yield (progress_html(ev.progress, ev.message), *[gr.skip()] * (n_out - 1))
        except (InputError, faults.OutOfMemory) as exc:
            raise text_error(str(exc)) from None
        except faults.OOM as exc:  # outside the engine (tokenizing, rendering)
            message = str(faults.out_of_memory(exc))
        else:
            message = None
        if message is not None:
            live = result = None
            faults.release()
            raise text_error(message)
        msg = (
            f"done: {len(result.runs)} runs on {result.prompt_tokens} prompt tokens in "
            f"{result.timings.get('compare_s', 0):.1f} s" + _ended_early(result)
        )
        if result.protocol == QUERY_AGNOSTIC:
            msg += f" · query-agnostic: the question was asked after compressing {result.context_tokens} tokens"
        yield (progress_html(1.0, msg), *self.render(result.to_json(), "mean", None))

    def task_of(self, preset: str) -> Task | None:
        """The task behind a preset (None for free prompts)."""
        return self.tasks.get(preset)

    @staticmethod
    def _map_layer(value, engine: Engine) -> int | None:
        if value is None or str(value).strip() in ("", "auto"):
            return None
        layer = whole_number(value, "the attention-map layer", 0)
        if not 0 <= layer < engine.info.n_layers:
            raise InputError(f"map layer {layer} is out of range; allowed: 0..{engine.info.n_layers - 1}")
        return layer

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
            result = load_result_text(Path(path).read_bytes())
        except OSError as exc:
            raise text_error(f"cannot read the file: {exc.strerror or exc}") from None
        except ResultFileError as exc:
            raise text_error(str(exc)) from None
        msg = f"loaded {len(result.runs)} runs from {Path(path).name} (not recomputed)"
        return (progress_html(1.0, msg), *self.render(result.to_json(), layer_choice, strip_label))
