"""The page's callbacks: run a comparison (streaming cards as it goes) and render a stored result.

Everything shown is rendered from one stored result (``gr.State`` holding the result's JSON), so
changing the view never recomputes. Model work goes through ``kvlab.run``, the flow the CLI and
the sweeps use.
"""

from __future__ import annotations

import gc
import html
import re
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import gradio as gr
import torch

from kvlab.core import cancel
from kvlab.core.budgets import TOLERANCE, Budget, BudgetError, exact_bytes, parse_budgets, prefill_only_peak
from kvlab.core.model import LoadedModel, ModelLoadError
from kvlab.core.results import QUERY_AGNOSTIC, CompareResult, RunResult
from kvlab.engine import faults
from kvlab.engine.admission import AdmissionError, AdmissionLimits, Estimate, admit, estimate
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import EMBEDDED, Progress, load_model, spec_of, unload
from kvlab.engine.probe import Probe
from kvlab.engine.specs import GenerationSettings, InputError, RunSpec
from kvlab.measure.metrics import ProbeSettings
from kvlab.measure.retention import RetentionSettings
from kvlab.methods import get
from kvlab.report import comparison_figures as plots
from kvlab.report import retention_map
from kvlab.report.result_file import ResultFileError, load_result_text
from kvlab.run import Comparison, stream
from kvlab.tasks import Task, join_question
from kvlab.ui.cards import cards_html, kept_strip_html, progress_html, source_html
from kvlab.ui.config import Limits
from kvlab.ui.export import export_files
from kvlab.ui.gpu_lease import WorkSize
from kvlab.ui.methods import params_from_rows
from kvlab.ui.model_choice import model_line, offered, refused_line
from kvlab.ui.retention_view import prompt_positions_html, slider_range, steps_note

FIGURE_TITLES = (
    "Cache size",
    "Bytes per decode step",
    "Attention relative error per decode step",
    "Attention relative error per layer",
    "Teacher-forced fidelity",
    "Attention over the prompt",
    "Quality vs memory",
)
FIGURE_OUTPUTS = FIGURE_TITLES + (
    "kept strip", "layer picker", "strip picker", "source line", "retention maps", "retention prompt",
    "retention step", "retention steps",
)  # fmt: skip


CANCEL_WAIT_S = 30.0  # how long Cancel waits for the model work in progress to end
KEEP_CHOSEN = 1  # models held besides the page's first one: loading another frees the oldest


@dataclass
class PageInputs:
    """The page's inputs of a comparison, in the order the page sends them (``page.Setup.inputs``) and
    ``Dashboard.compare`` and the API take them. Values are as a client sent them: checked by
    ``Dashboard.request``."""

    model: str = EMBEDDED
    prompt: str = ""
    papers: list | None = None
    baselines: list | None = None
    budgets: str = ""
    max_new: int = 32
    seed: int = 0
    param_table: list | None = None
    record_maps: bool = True
    map_layer: int | None = None
    map_head: int = 0
    question: str = ""
    recent: list | None = None  # the recent methods' group (after ``question``: older clients leave it out)
    quantizers: list | None = None  # the quantizers' group (last, for the same reason)

    def chosen(self) -> list[str]:
        """Every method ticked, exact first (it always runs)."""
        groups = (self.papers, self.baselines, self.recent, self.quantizers)
        return ["exact"] + [name for group in groups for name in (group or [])]

    @classmethod
    def of(cls, values) -> PageInputs:
        """The first ``len(fields)`` of ``values`` (a callback's arguments; Gradio may add more after them)."""
        return cls(*list(values)[: len(fields(cls))])


def _session(request: gr.Request | None) -> str:
    """The browser session (or API client) a callback serves ("" outside Gradio)."""
    return str(getattr(request, "session_hash", "") or "")


@dataclass
class LiveProbe(Probe):
    """Reads each cache's bytes right after compression and, when greedy, the tokens as they come.

    It wants no per-row attention hook (``attends`` is False): the engine skips it.
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

    def partial(self, engine: Engine, specs: list[RunSpec], comparison: Comparison, n: int) -> CompareResult:
        """What is known so far, as a result for the cards: bytes now and, when greedy, the text so far."""
        runs = [
            RunResult(
                method=spec.method,
                budget=None if spec.budget is None else spec.budget.label,
                params={},
                kv_bytes=b,
                exact_kv_bytes_per_step=[exact_bytes(engine.info, n)],
                text=engine.lm.decode(toks) if toks else "…",
            )
            for spec, b, toks in zip(self._ran(specs), self.bytes_now, self.tokens or [[] for _ in specs])
        ]
        asked = list(comparison.questions[:1])
        return CompareResult(
            model=engine.info.to_json(),
            prompt=join_question(comparison.prompt, asked[0]) if asked else comparison.prompt,
            prompt_tokens=n,
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


def short_prompt_warning(methods, budgets, n: int, new: int) -> str:
    """The plan line's warning when the prompt is short against the new tokens: the prefill-only methods
    chosen keep their generated tokens whole, so their peak passes their budget (``prefill_only_peak``, at
    the budget where it passes most) by more than 5%; "" otherwise."""
    held = [m for m in methods if m != "exact" and not get(m).streaming]
    budgets = [Budget.parse(b) for b in budgets]
    if not held or not budgets:
        return ""
    worst = max(budgets, key=lambda b: prefill_only_peak(b, n, new))
    factor = prefill_only_peak(worst, n, new)
    if factor <= 1 + TOLERANCE:
        return ""
    names = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    return markdown_text(
        f" · ⚠ short prompt against the new tokens ({n} prompt, {new} new): prefill-only methods ({names}) keep "
        f"generated tokens whole and will peak near {factor:.1f}x budget {worst.label}; the decoding- methods "
        "and the streaming ones hold it"
    )


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
    """The callbacks behind the page; holds the model loaded at start and the last one chosen on the page."""

    def __init__(self, lm: LoadedModel, limits: Limits | None = None, device: str | None = None):
        self.lm = lm
        self.limits = limits or Limits()
        self.device = device  # where models load (``gpu_lease.placement_device``: "cuda" on ZeroGPU; None: auto)
        self.keep = KEEP_CHOSEN  # models held besides the first (more when the page preloads its list)
        self.admission = AdmissionLimits.from_env()
        self.start = spec_of(lm)  # the model the page started with: always held
        self.engines: dict[str, Engine] = {self.start: Engine(lm)}  # spec -> engine, oldest first
        self.tasks: dict[str, Task] = {}  # preset label -> its task (set by the page)
        self.running: dict[str, cancel.Token] = {}  # session -> its running comparison's token
        self._lock = threading.Lock()

    # ----- model work ----------------------------------------------------------------------
    def engine_for(self, model, load: bool = True, progress: Progress | None = None) -> Engine:
        """The engine of ``model`` (a spec: "embedded", a folder, a hub id), loaded first when ``load``.

        Raises ``InputError`` (one line) for a model this page does not offer, one not loaded yet
        (``load`` False), or one that cannot be loaded or is refused; the models held stay as they were.
        """
        spec = model.strip() if isinstance(model, str) else ""
        spec = spec or EMBEDDED
        if spec in self.engines:
            return self.engines[spec]
        if not self.limits.allow_model_choice and spec not in offered(self.start, self.limits):
            listed = ", ".join(offered(self.start, self.limits))
            raise InputError(
                f"this page offers a fixed list of models ({listed}); set KVLAB_ALLOW_MODEL_CHOICE=1 to allow others"
            )
        if not load:
            raise InputError(f"model {spec!r} is not loaded yet: press Load model (Run loads it too)")
        try:
            engine = Engine(load_model(spec, device=self.device, progress=progress))
        except ModelLoadError as exc:
            raise InputError(str(exc)) from None
        self.engines[spec] = engine
        self._free_older(spec)
        return engine

    def _free_older(self, keep: str) -> None:
        """Hold at most ``self.keep`` models besides the first one (``keep``, just loaded, stays)."""
        chosen = [s for s in self.engines if s not in (self.start, keep)]
        for spec in chosen[: max(0, len(chosen) + 1 - self.keep)]:
            engine = self.engines.pop(spec)
            if engine.lm.model is not self.lm.model:
                unload(engine.lm)
        gc.collect()

    def preload(self, specs) -> list[str]:
        """Load every model of ``specs`` now and hold them all (ZeroGPU: models are placed at import, never
        inside a lease); returns the specs held. A model that cannot be loaded raises ``InputError``."""
        specs = list(dict.fromkeys(s for s in specs if s and s != self.start))
        self.keep = max(self.keep, len(specs))
        for spec in specs:
            self.engine_for(spec)
        return [self.start, *specs]

    def offered(self) -> list[str]:
        """The models the page's model box lists (this machine's, or the fixed list), and those held now."""
        return offered(self.start, self.limits, list(self.engines))

    def choose_model(self, model, current, progress=gr.Progress()):  # noqa: B008 (gradio injects progress)
        """The Load model button: load ``model`` with progress and show the self-check's verdict.

        Returns (the model box, the session's model, the model line, the map layer, the map head). A
        model that cannot be loaded or is refused leaves the box on ``current`` (the session's model,
        still loaded) and says why in the model line."""
        current = current if isinstance(current, str) and current.strip() else self.start
        spec = model.strip() if isinstance(model, str) else ""
        if not spec:
            message = "the model box is empty; pick a model or type a folder or a Hugging Face id"
            return gr.update(value=current), current, refused_line(message, current), gr.skip(), gr.skip()
        try:
            engine = self.engine_for(spec, progress=lambda fraction, stage: progress(fraction, desc=stage))
        except InputError as exc:
            return gr.update(value=current), current, refused_line(str(exc), current), gr.skip(), gr.skip()
        info = engine.info
        return (
            gr.update(value=spec, choices=self.offered()),
            spec,
            model_line(engine.lm),
            gr.update(value=info.n_layers // 2, maximum=info.n_layers - 1),
            gr.update(value=0, maximum=info.n_heads - 1),
        )

    def request(
        self, inputs: PageInputs, load: bool = True, progress: Progress | None = None
    ) -> tuple[Engine, Comparison, int]:
        """The page's inputs as a ``Comparison``, checked against the page's limits.

        Returns the engine of the chosen model, the comparison and the prompt's token count. A
        preset's task (its answer, its scoring) applies while the prompt is that preset's text
        exactly (compared here, when the run starts) and no question is asked. ``question``: asked
        after compressing the prompt (query-agnostic); the prompt is then a context. ``load``: load the
        chosen model when it is not held yet (with ``progress``), else refuse it.
        """
        prompt = inputs.prompt
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("the prompt is empty; type some text or pick a preset")
        question = _question_text(inputs.question)
        for what, text in (("prompt", prompt), ("question", question)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(f"the {what} holds characters that are not valid Unicode (lone surrogates)") from None
        chosen = inputs.chosen()
        if len(chosen) == 1:
            raise InputError(
                "no method selected; tick at least one of the papers' methods, baselines, recent methods or quantizers"
            )
        try:
            bl = parse_budgets(inputs.budgets)
        except BudgetError as exc:
            raise InputError(str(exc)) from None
        max_new = whole_number(inputs.max_new, "max new tokens", 0)
        if not 1 <= max_new <= self.limits.max_new_tokens:
            raise InputError(f"max new tokens must be in 1..{self.limits.max_new_tokens}")
        engine = self.engine_for(inputs.model, load, progress)
        measure = None
        if inputs.record_maps:
            head = whole_number(inputs.map_head, "the attention-map head", 0)
            if not 0 <= head < engine.info.n_heads:
                raise InputError(f"map head {head} is out of range; allowed: 0..{engine.info.n_heads - 1}")
            measure = ProbeSettings(map_layer=self._map_layer(inputs.map_layer, engine), map_head=head)
        task = None if question else self.task_for(prompt)
        comparison = Comparison(
            task or prompt,
            chosen,
            bl,
            params=params_from_rows(inputs.param_table, chosen),
            settings=GenerationSettings(max_new_tokens=max_new, seed=whole_number(inputs.seed, "the seed", 0)),
            measure=measure,
            questions=[question] if question else (),
            retention=RetentionSettings(),
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

    def plan(self, *values) -> str:
        """One line for the page before Run: the run count and the estimate, or why it would be refused.

        ``values``: the page's inputs in ``PageInputs`` order."""
        try:
            engine, comparison, n = self.request(PageInputs.of(values), load=False)
        except InputError as exc:
            return f"⚠ {markdown_text(str(exc))}"
        est = self.estimate(engine, comparison, n)
        task = f" · scored as the preset's task ({comparison.task.name})" if comparison.task is not None else ""
        short = short_prompt_warning(comparison.methods, comparison.budgets, n, comparison.settings.max_new_tokens)
        return f"{est.summary()}{task} · within this page's limits{short}"

    def work(self, *values, **kw) -> WorkSize:
        """The request's size for a GPU lease, from the raw inputs of ``compare`` (cheap: tokenizing only).

        ``values`` are ``compare``'s arguments: the page's inputs first, in ``PageInputs`` order (then
        what Gradio adds: progress, the request)."""
        inputs = PageInputs.of(values)
        held = self.engines.get(inputs.model.strip() if isinstance(inputs.model, str) else "")
        engine = held or self.engines[self.start]  # a model not held yet: sized by the first one's tokenizer
        methods = len(inputs.chosen())
        runs = methods * max(1, len(set(parse_budgets(inputs.budgets))))
        text = inputs.prompt if isinstance(inputs.prompt, str) else ""
        if isinstance(inputs.question, str) and inputs.question.strip():
            text += "\n" + inputs.question
        return WorkSize(len(engine.lm.encode(text)), runs, int(inputs.max_new or 1), bool(inputs.record_maps))

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
        question="",
        recent=None,
        quantizers=None,
        progress=gr.Progress(),  # noqa: B008 (gradio injects progress through this default)
        request: gr.Request | None = None,
    ):
        """Generator: yields (status, cards, state, *figures) as the comparison runs.

        The page's inputs come first, in ``PageInputs`` order (the API's order). The model work
        runs under a ``kvlab.core.cancel`` token that ``cancel`` (the Cancel button, same session) sets.
        """
        token = self._start(request)
        inputs = PageInputs(
            model, prompt, papers, baselines, budgets, max_new, seed, param_table, record_maps, map_layer,
            map_head, question, recent, quantizers,
        )  # fmt: skip
        try:
            yield from self._compare(inputs, progress, token)
        finally:
            self._end(request, token)

    def _compare(self, inputs: PageInputs, progress, token: cancel.Token):
        """``compare``'s work under ``token``: it ends (what it held freed) before the token is finished."""
        n_out = len(FIGURE_OUTPUTS) + 3
        stopped = None
        live: LiveProbe | None = None
        result: CompareResult | None = None
        try:
            engine, comparison, n = self.request(
                inputs, progress=lambda fraction, stage: progress(fraction, desc=f"loading the model: {stage}")
            )
            specs = comparison.check()
            live = LiveProbe(len(specs), greedy=not comparison.settings.do_sample)
            last_yield = 0.0
            for ev in cancel.scoped(stream(engine, comparison, probes=[live]), token):
                if ev.progress >= 0:
                    progress(ev.progress, desc=ev.message)
                if ev.kind == "done":
                    result = ev.result
                    break
                now = time.perf_counter()
                if live.bytes_now and (ev.kind != "step" or now - last_yield > 0.5):
                    last_yield = now
                    cards = cards_html(live.partial(engine, specs, comparison, n), engine.lm, live=True)
                    with token.paused():  # while Gradio has the partial result, nothing runs here
                        yield (progress_html(ev.progress, ev.message), cards, *[gr.skip()] * (n_out - 2))
                elif ev.kind in ("prefill", "compress", "question"):
                    with token.paused():
                        yield (progress_html(ev.progress, ev.message), *[gr.skip()] * (n_out - 1))
        except (InputError, faults.OutOfMemory) as exc:
            raise text_error(str(exc)) from None
        except faults.OOM as exc:  # outside the engine (tokenizing, rendering)
            message = str(faults.out_of_memory(exc))
        except cancel.Cancelled as exc:  # the Cancel button (its own status says so) or the time limit
            message, stopped = None, str(exc) if isinstance(exc, cancel.TimeLimit) else ""
        else:
            message = None
        if message is not None or stopped is not None:
            live = result = None
            faults.release()
        if message is not None:
            raise text_error(message)
        if stopped is not None:
            if stopped:
                yield (progress_html(0.0, stopped), *[gr.skip()] * (n_out - 1))
            return
        assert result is not None  # the stream ends with its "done" event
        msg = (
            f"done: {len(result.runs)} runs on {result.prompt_tokens} prompt tokens in "
            f"{result.timings.get('compare_s', 0):.1f} s" + _ended_early(result)
        )
        if result.protocol == QUERY_AGNOSTIC:
            msg += f" · query-agnostic: the question was asked after compressing {result.context_tokens} tokens"
        yield (progress_html(1.0, msg), *self.render(result.to_json(), "mean", None))

    # ----- cancel --------------------------------------------------------------------------
    def _start(self, request: gr.Request | None) -> cancel.Token:
        """A fresh token for this session's comparison (a cancel before it starts stops it at once)."""
        token = cancel.Token()
        token.working()
        with self._lock:
            self.running[_session(request)] = token
        return token

    def _end(self, request: gr.Request | None, token: cancel.Token) -> None:
        token.finished()
        with self._lock:
            if self.running.get(_session(request)) is token:
                del self.running[_session(request)]

    def cancel(self, request: gr.Request | None = None) -> str:
        """Stop this session's running comparison where its model work is (within one layer); the status line.

        Waits (at most ``CANCEL_WAIT_S``) for the work in progress to end, so that the page says
        "cancelled" once nothing of it runs and the next comparison starts at once.
        """
        with self._lock:
            token = self.running.get(_session(request))
        if token is None:
            return progress_html(0.0, "cancelled: nothing was running; change the setup and run again")
        t0 = time.perf_counter()
        token.cancel()
        ended = token.wait_idle(CANCEL_WAIT_S)
        took = time.perf_counter() - t0
        where = f"its model work ended {took:.1f} s after the click" if ended else "its model work is still ending"
        return progress_html(0.0, f"cancelled: the comparison was stopped ({where}); change the setup and run again")

    def task_for(self, prompt: str) -> Task | None:
        """The preset task whose prompt ``prompt`` is, exactly (None for any other text)."""
        return next((t for t in self.tasks.values() if t.prompt == prompt), None)

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
        """The held model that produced ``result`` (its tokenizer shows the kept-token strip), if any."""
        held = [e.lm for e in list(self.engines.values())]
        return next((lm for lm in held if lm.info.id == result.model.get("id")), None)

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
                source_html(None),
                retention_map.figure_or_empty(None),
                prompt_positions_html(None, None),
                gr.update(value=0, maximum=1),
                steps_note(None),
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
            source_html(result),
            retention_map.figure(result, step=0),
            prompt_positions_html(result, lm),
            gr.update(value=0, maximum=max(1, slider_range(result)[0]), step=1),
            steps_note(result),
        )

    def view_retention(self, data, step):
        """The retention maps at the slider's ``step`` (from the stored result; nothing recomputed)."""
        if not data:
            return retention_map.figure_or_empty(None)
        return retention_map.figure(CompareResult.from_json(data), step=int(step or 0))

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
