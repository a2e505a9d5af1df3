"""The engine: one exact prefill shared by every method, then lockstep decoding.

Data flow (docs/design.md §2): tokenize -> one exact prefill (``kvlab.prefill``: K/V of the prompt and
what the methods ask for, once for all) -> each method compresses its own copy -> decode all
methods together, one batched forward per step, row i attending through method i's cache ->
results. Positions always continue from the true number of tokens seen.

``Engine.stream`` yields progress ``Event``s; the last one carries the ``CompareResult``. The CLI,
the dashboard and the sweeps go through ``kvlab.run``, which adds the text metrics and task scores.

Two protocols (docs/tasks.md): query-aware (the default) prefills and compresses the whole prompt,
question included. Query-agnostic (``questions=`` given) prefills and compresses the context once,
then, for each question, forks every compressed cache and feeds the question's tokens through it in
one chunked forward (true positions, causal inside the chunk, each compressor's ``feed``); all the
questions' rows then decode in one lockstep batch: N questions cost one prefill and one compression
per method.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from kvlab import attention as attn
from kvlab import cancel, faults
from kvlab.budgets import Budget, BudgetRefused, exact_bytes
from kvlab.cache import LockstepCache
from kvlab.compressors import Compressor, PrefillState, get
from kvlab.compressors.budget_search import planned
from kvlab.few_rows import few_row_linears
from kvlab.models import LoadedModel
from kvlab.prefill import prefill_for
from kvlab.results import QUERY_AGNOSTIC, QUERY_AWARE, CompareResult, RunResult, RunTimings
from kvlab.semantics import UnsupportedAttention


class InputError(ValueError):
    """Bad input from a user (prompt, methods, budgets, settings); the message says what is allowed."""


@dataclass(frozen=True)
class RunSpec:
    """One method at one budget (``budget`` None: the method's own default, e.g. exact)."""

    method: str
    budget: Budget | None = None
    params: dict = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget.label}"


@dataclass
class GenerationSettings:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= 4096:
            raise InputError(f"max_new_tokens={self.max_new_tokens} is out of range; allowed: 1..4096")
        if self.do_sample and not self.temperature > 0:  # NaN too
            raise InputError(f"temperature={self.temperature} must be > 0 when sampling")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.seed < 2**63:
            raise InputError(f"seed={self.seed} is out of range; allowed: 0..{2**63 - 1}")


@dataclass
class Question:
    """A question asked after compression: the prompt's token ids after the context, and its text.

    ``ids`` are the question, the end of the user turn, the assistant marker and any answer
    prefix; ``prompt_text`` is the whole prompt as a person reads it (shown with the result).
    """

    ids: list[int]
    text: str = ""
    prompt_text: str = ""


@dataclass
class Event:
    """Progress: ``kind`` is prefill | compress | question | step | run_done | done; ``progress`` in [0, 1].

    ``result`` of the ``done`` event is the (first) question's result; ``results`` lists every
    question's result (one item when the prompt had one question or none).
    """

    kind: str
    message: str
    progress: float
    step: int | None = None
    total: int | None = None
    run: str | None = None
    result: CompareResult | None = None
    results: list[CompareResult] | None = None


class Probe(Protocol):
    """Optional measurement hooks (metrics add these; the engine stays measurement-agnostic).

    Besides these four, a probe may define (the engine calls them only when present):

    * ``on_layer(layer, rows, pos, q, k, v, out)`` once per layer and decode step with the whole
      batch of free-running rows (``rows``: their run indices; q/out [R, Hq, 1, d], k/v
      [R, Hkv, 1, d] the new token's key/value at true position ``pos``);
    * ``teacher_forced = True`` plus ``on_forced(step, token, exact_logits, forced)``: the engine
      then also feeds each run the exact run's tokens (the free-running row itself while its
      tokens equal the exact run's, else a copy of its compressor forked at the divergence, in the
      same batched forward) and reports, after each step, the exact run's token, its logits [V]
      and ``forced`` {run index: logits [V] of that run fed the exact tokens}. Needs an ``exact`` run;
    * ``on_chunk(layer, rows, pos, q, k, v, out)`` once per layer when a question is fed after
      compression (query-agnostic): q/out [R, Hq, c, d], k/v [R, Hkv, c, d] at true positions
      pos..pos+c-1, every run a row.

    * ``forkable = True``: the probe is stateless until ``on_prefill`` and defines no hooks but
      ``on_prefill``, ``on_chunk``, ``on_step`` and ``finish``; several questions asked after
      compression then decode as one batch, each followed by its own copy of the probe.

    Query-agnostic: a probe sees one ``on_prefill`` .. ``finish`` cycle per question (``on_prefill``
    gets the context's state and that question's fork of the compressors; ``logits`` are the
    context's last), then ``on_chunk`` per layer, then ``on_step(0, rows, logits [R, V])`` with each
    run's logits after the question (the first token's), then the decode steps as usual.
    """

    def on_prefill(self, state: PrefillState, logits: Tensor, compressors: list[Compressor]) -> None: ...
    def on_attend(self, layer: int, row: int, q: Tensor, out: Tensor) -> None: ...
    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None: ...
    def finish(self, runs: list[RunResult]) -> None: ...


def expand_runs(methods: list[str], budgets: list[Budget], params: dict[str, dict] | None = None) -> list[RunSpec]:
    """Every method at every budget; methods without a budget knob (exact) run once.

    Unknown methods or parameters raise ``InputError`` naming what is allowed.
    """
    params = params or {}
    methods = [m.strip() for m in methods if m and m.strip()]
    if not methods:
        raise InputError("no method selected; choose at least one (e.g. exact,streaming)")
    budgets = list(dict.fromkeys(budgets))  # a budget given twice runs once
    specs: list[RunSpec] = []
    for m in dict.fromkeys(methods):
        try:
            cls = get(m)
            cls.resolve_params(params.get(m, {}))
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if cls.name == "exact" or not budgets:
            specs.append(RunSpec(m, None, dict(params.get(m, {}))))
        else:
            specs.extend(RunSpec(m, b, dict(params.get(m, {}))) for b in budgets)
    for m in params:
        if m not in methods:
            raise InputError(f"parameters given for {m!r}, which is not among the methods {', '.join(methods)}")
    return specs


def _pick(logits: Tensor, gen: GenerationSettings, generator: torch.Generator) -> int:
    if not gen.do_sample:
        return int(torch.argmax(logits))
    x = logits.float() / gen.temperature
    if gen.top_k > 0:
        kth = torch.topk(x, min(gen.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if gen.top_p < 1:
        sp, si = torch.sort(probs, descending=True)
        drop = torch.cumsum(sp, -1) - sp > gen.top_p
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class Engine:
    """``time_limit_s``: a comparison's time limit (None: none; the default reads ``faults.time_limit_s``).
    ``stepwise_questions``: feed a question asked after compression one decode step per token instead
    of one chunked forward (the reference the chunk must equal; slower)."""

    def __init__(self, lm: LoadedModel, time_limit_s: float | None = -1.0, stepwise_questions: bool = False):
        self.lm = lm
        self.info = lm.info
        self.time_limit_s = faults.time_limit_s() if time_limit_s == -1.0 else time_limit_s
        self.stepwise_questions = stepwise_questions
        cancel.install(lm.model, lm.info.n_layers)  # a cancel or the time limit stops a forward between layers

    # ----- compare ------------------------------------------------------------------------
    def check_prompt(self, ids: list[int], gen: GenerationSettings) -> None:
        if not ids:
            raise InputError("the prompt is empty; type some text or pick a preset")
        limit = self.info.max_positions
        if len(ids) + gen.max_new_tokens > limit:
            raise InputError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({gen.max_new_tokens}) exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or generate fewer tokens"
            )

    def stream(
        self,
        prompt_ids: list[int],
        runs: list[RunSpec],
        gen: GenerationSettings | None = None,
        prompt_text: str = "",
        probes: list[Probe] | None = None,
        questions: list[Question] | None = None,
    ) -> Iterator[Event]:
        """Compare ``runs`` on one prompt; yields progress ``Event``s, the last one (``done``) with the result.

        Steps: make compressors -> one exact prefill -> compress all -> first tokens (from the
        prefill's logits) -> decode steps (one batched forward each) -> result.

        ``questions`` (query-agnostic): ``prompt_ids`` is the context alone, compressed once; each
        question is then fed through a fork of every compressed cache (``_stream_questions``).

        A cancel of the current ``kvlab.cancel`` token stops the work within one layer
        (``cancel.Cancelled``). The time limit does too: while decoding, the runs then end with
        their tokens so far; before the first token, ``cancel.TimeLimit`` ends the comparison.
        """
        why = f"stopped at the time limit of {self.time_limit_s:g} s (KVLAB_TIME_LIMIT_S)" if self.time_limit_s else ""
        token = cancel.Token.within(self.time_limit_s, f"{why} before the first token: nothing was generated")
        return cancel.scoped(self._stream(prompt_ids, runs, gen, prompt_text, probes, questions), token)

    @torch.inference_mode()
    def _stream(
        self,
        prompt_ids: list[int],
        runs: list[RunSpec],
        gen: GenerationSettings | None,
        prompt_text: str,
        probes: list[Probe] | None,
        questions: list[Question] | None,
    ) -> Iterator[Event]:
        gen = gen or GenerationSettings()
        gen.validate()
        if questions:
            if not prompt_ids:
                raise InputError("the context is empty; give some text to ask the questions about")
            if any(not q.ids for q in questions):
                raise InputError("a question has no tokens; give each question some text")
            self.check_prompt(prompt_ids + max((q.ids for q in questions), key=len), gen)
        else:
            self.check_prompt(prompt_ids, gen)
        if not runs:
            raise InputError("no method selected; choose at least one")
        probes = probes or []
        t_start = time.perf_counter()
        # the cache grows by the question's tokens and the generated ones: a plan must hold both
        grows = gen.max_new_tokens - 1 + max((len(q.ids) for q in questions or ()), default=0)
        comps, knobs = self._make_compressors(runs, len(prompt_ids), gen.seed, grows)
        refusals = _Refusals(runs, {i: k for i, k in enumerate(knobs) if isinstance(k, Exception)})
        yield from refusals.events()
        runs, comps, knobs = refusals.kept(runs), refusals.kept(comps), refusals.kept(knobs)
        if not runs:  # every run refused: nothing to prefill
            rows = _Lockstep([], [], [], gen, len(prompt_ids), self.lm.eos_ids, [])
            none = refusals.merged(
                self._result(prompt_ids, prompt_text, rows, {"compare_s": time.perf_counter() - t_start})
            )
            yield Event("done", "every run refused its budget", 1.0, result=none, results=[none])
            return
        if questions:
            planned = _Planned(runs, comps, knobs, refusals)
            yield from self._stream_questions(prompt_ids, planned, gen, probes, questions, t_start)
            return

        state, last_logits, prefill_s = prefill_for(self.lm, prompt_ids, comps)
        yield Event("prefill", f"prefill of {len(prompt_ids)} tokens done in {prefill_s:.2f} s", 0.1)

        results = yield from self._compress_all(state, runs, comps, knobs, prefill_s)
        for p in probes:
            p.on_prefill(state, last_logits, comps)
        del state  # the prompt's exact K/V: each compressor holds its own copy now

        rows = _Lockstep(runs, comps, results, gen, len(prompt_ids), self.lm.eos_ids, probes)
        yield from self._first_tokens(rows, last_logits)
        done = yield from self._decode_all(rows, t_start, f"{len(runs)} runs done")

        for p in probes:
            p.finish(results)
        _drop_unmeasured(results)
        timings = {"compare_s": time.perf_counter() - t_start, "prefill_s": prefill_s}
        result = refusals.merged(self._result(prompt_ids, prompt_text, rows, timings))
        yield Event("done", done, 1.0, result=result, results=[result])

    def _stream_questions(
        self,
        ctx_ids: list[int],
        planned: _Planned,
        gen: GenerationSettings,
        probes: list,
        questions: list[Question],
        t_start: float,
    ) -> Iterator[Event]:
        """Query-agnostic: one prefill and one compression of the context, then per question a fork of
        every cache and one chunked forward of the question's tokens; then lockstep decoding.

        Every question's rows decode together (one batched forward per step for all questions, each
        row at its own true position) when every probe is ``forkable`` (a fresh copy of it then
        follows each question); other probes follow one question at a time, so with them each
        question decodes on its own.

        Timings: ``shared_s`` (prefill + compression, once for all questions) and ``own_s`` (this
        question: its fork and chunk, plus its share of the decoding it was batched in);
        ``compare_s`` = shared_s + own_s.
        """
        n = len(ctx_ids)
        runs, comps, knobs, refusals = planned
        state, last_logits, prefill_s = prefill_for(self.lm, ctx_ids, comps)
        yield Event("prefill", f"prefill of the context ({n} tokens) done in {prefill_s:.2f} s", 0.1)
        base = yield from self._compress_all(state, runs, comps, knobs, prefill_s)
        shared = {
            "prefill_s": prefill_s,
            "compress_s": sum(r.timings.compress_s for r in base),
            "shared_s": time.perf_counter() - t_start,
        }
        context = _Context(ctx_ids, runs, comps, base, state, last_logits, gen)
        out: list[CompareResult] = []
        joint = all(getattr(p, "forkable", False) for p in probes)
        groups = [list(range(len(questions)))] if joint else [[j] for j in range(len(questions))]
        # a forkable probe is stateless until on_prefill: each question gets its own copy
        followers = [[copy.deepcopy(p) for p in probes] for _ in questions] if joint else [probes] * len(questions)
        done = ""
        for g, group in enumerate(groups):
            lo, span = 0.2 + 0.8 * g / len(groups), 0.8 / len(groups)
            asked, own = [], []
            for k, j in enumerate(group):
                t_q = time.perf_counter()
                progress = lo + 0.2 * span * (k + 1) / len(group)
                rows = yield from self._ask(context, questions, j, followers[j], progress)
                asked.append(rows)
                own.append(time.perf_counter() - t_q)
            t_d = time.perf_counter()
            rows = asked[0] if len(asked) == 1 else _Lockstep.joined(asked)
            within = functools.partial(_within, lo + 0.2 * span, 0.8 * span)  # this group's share of the bar
            done = yield from self._decode_all(
                rows, t_start, f"{len(runs)} runs x {len(questions)} questions done", within
            )
            decode_share = (time.perf_counter() - t_d) / len(group)
            for j, rows, own_s in zip(group, asked, own):
                q, results = questions[j], rows.results
                for p in followers[j]:
                    p.finish(results)
                _drop_unmeasured(results)
                timings = {**shared, "question_s": results[0].timings.question_s, "own_s": own_s + decode_share}
                timings["compare_s"] = shared["shared_s"] + timings["own_s"]
                out.append(refusals.merged(self._result(ctx_ids + q.ids, q.prompt_text, rows, timings, q.text, n)))
        del state, context
        yield Event("done", done, 1.0, result=out[0], results=out)

    def _ask(
        self, ctx: _Context, questions: list[Question], j: int, probes: list, progress: float
    ) -> Generator[Event, None, _Lockstep]:
        """Question ``j``: fork every compressed cache (the last question takes the caches themselves),
        feed its tokens in one chunked forward and pick each run's first token; ``probes`` follow
        this question. Returns its rows."""
        n, q, runs = len(ctx.ids), questions[j], ctx.runs
        last = j == len(questions) - 1
        qcomps = ctx.comps if last else [copy.deepcopy(c) for c in ctx.comps]
        results = ctx.results if last else copy.deepcopy(ctx.results)
        for p in probes:
            p.on_prefill(ctx.state, ctx.logits, qcomps)
        rows = _Lockstep(runs, qcomps, results, ctx.gen, n + len(q.ids), self.lm.eos_ids, probes)
        with faults.collect() as failed:
            logits = self._feed_question(rows, n, q.ids)
        for i, message in sorted(failed.errors.items()):  # a method that raised on the question
            r = rows.results[i]
            r.error, r.finish_reason = message, "error"
            rows.comps[i] = faults.FailedCompressor(rows.comps[i])
            yield from self._finish(r, rows.tokens[i], rows.runs[i].label)
        yield Event(
            "question",
            f"question {j + 1} of {len(questions)}: {len(q.ids)} tokens fed through every cache "
            f"in {results[0].timings.question_s:.2f} s",
            progress,
        )
        everyone = [i for i in range(len(runs)) if i not in failed.errors]
        for p in probes:
            p.on_step(0, everyone, logits[everyone])
        yield from self._ended(rows, rows.pick(everyone, logits[everyone]))
        return rows

    def _feed_question(self, rows: _Lockstep, seen: int, ids: list[int]) -> Tensor:
        """Every run's cache takes the question's c tokens at true positions seen..seen+c-1 in one
        chunked forward (input_ids [B, c], causal inside the chunk): logits [B, V] after its last token.

        Records each run's bytes after the question (``kv_bytes_per_step[1]``) and the forward's time.
        """
        t0 = time.perf_counter()
        model, dev = self.lm.model, self.lm.device
        b, c = len(rows.comps), len(ids)
        if self.stepwise_questions:
            logits = self.feed_stepwise(rows.comps, seen, ids)
        else:
            cache = LockstepCache(rows.comps, self.info.n_layers, seen, chunk=True)
            everyone = list(range(b))
            observers = [_LayerObserver(p, everyone, seen) for p in rows.probes if _defines(p, "on_chunk")]
            handler = attn.LockstepChunk(rows.comps, seen, [o.on_chunk for o in observers])
            with attn.active(model, handler), few_row_linears(b * c, dev):
                out = model(
                    input_ids=torch.tensor([ids] * b, device=dev),
                    position_ids=torch.arange(seen, seen + c, device=dev).expand(b, c),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits = out.logits[:, -1]
        dt = time.perf_counter() - t0
        for r, comp in zip(rows.results, rows.comps):
            r.timings.question_s = dt
            r.kv_bytes_per_step.append(comp.nbytes())
            r.exact_kv_bytes_per_step.append(exact_bytes(self.info, seen + c))
        return logits

    @torch.inference_mode()
    def feed_stepwise(self, comps: list[Compressor], seen: int, ids: list[int]) -> Tensor:
        """The same tokens through the decode path, one forward per token: logits [B, V] after the last.

        Row i feeds ``ids`` through ``comps[i]`` at true positions seen..seen+c-1 (no probes).
        """
        model, dev, b = self.lm.model, self.lm.device, len(comps)
        for i, t in enumerate(ids):
            cache = LockstepCache(comps, self.info.n_layers, seen + i)
            with attn.active(model, attn.LockstepDecode(comps, positions=[seen + i] * b)), few_row_linears(b, dev):
                out = model(
                    input_ids=torch.tensor([[t]] * b, device=dev),
                    position_ids=torch.full((b, 1), seen + i, device=dev),
                    past_key_values=cache,
                    use_cache=True,
                )
        return out.logits[:, -1]

    # ----- the steps of ``stream`` ------------------------------------------------------------
    def _make_compressors(
        self, runs: list[RunSpec], n: int, seed: int, decode_steps: int
    ) -> tuple[list[Compressor | None], list[dict | BudgetRefused | PlanFailed]]:
        """One compressor per run, planned for ``n`` prompt tokens and ``decode_steps`` decode steps;
        returns them and their chosen knobs (or the ``BudgetRefused`` of a run that cannot hold its
        budget, or ``PlanFailed`` when its constructor or plan raised: its compressor is then None)."""
        made = [faults.made(get(spec.method), self.info, spec.budget, spec.params, seed=seed) for spec in runs]
        comps = [c if not isinstance(c, str) else None for c in made]  # None: its constructor raised
        return comps, [_plan(c, n, decode_steps) if c is not None else PlanFailed(m) for c, m in zip(comps, made)]

    def _compress_all(
        self, state: PrefillState, runs: list[RunSpec], comps: list[Compressor], knobs: list[dict], prefill_s: float
    ) -> Generator[Event, None, list[RunResult]]:
        """Each compressor compresses its copy of the prefill; yields one event per run, returns their results."""
        results = []
        exact_now = exact_bytes(self.info, state.n_tokens)
        for i, (spec, comp) in enumerate(zip(runs, comps)):
            cancel.checkpoint()
            t0 = time.perf_counter()
            error = faults.error_of(comp.compress, state)
            if error:  # this run ends here (see _first_tokens); its stand-in holds nothing
                comps[i] = comp = faults.FailedCompressor(comp)
            comp_s = time.perf_counter() - t0
            r = RunResult(
                method=spec.method,
                budget=None if spec.budget is None else spec.budget.label,
                params=_jsonable({**comp.cfg, **knobs[i]}),
                kv_bytes=comp.nbytes(),
                kv_bytes_breakdown=comp.nbytes_by_kind(),
                shared_bytes=comp.shared_nbytes_by_kind(),
                timings=RunTimings(prefill_s=prefill_s, compress_s=comp_s),
                error=error,
            )
            r.kv_bytes_per_step.append(r.kv_bytes)
            r.exact_kv_bytes_per_step.append(exact_now)
            results.append(r)
            yield Event(
                "compress",
                f"{spec.label}: compressed in {comp_s:.2f} s",
                0.1 + 0.1 * (i + 1) / len(runs),
                run=spec.label,
            )
        return results

    def _first_tokens(self, rows: _Lockstep, logits: Tensor) -> Iterator[Event]:
        """Every run's first token from the shared prefill's logits [V] (a run whose compression failed ends here)."""
        ok = [i for i, r in enumerate(rows.results) if not r.error]
        yield from self._ended(rows, rows.pick(ok, [logits] * len(ok)))
        for i in sorted(set(range(len(rows.runs))) - set(ok)):
            rows.results[i].finish_reason = "error"
            rows.forcing.drop(i)
            yield from self._finish(rows.results[i], [], rows.runs[i].label)

    def _decode_step(self, rows: _Lockstep, step: int) -> Iterator[Event]:
        """One batched forward over the running rows (plus teacher-forced rows), then each row's next token."""
        t0 = time.perf_counter()
        with faults.collect() as failed:
            all_logits = self._forward(rows, step)
        yield from self._failed(rows, failed.errors)
        active = list(rows.active)  # the runs that did not fail
        rows_ok = [r for r, i in enumerate(rows.batch) if i in active] if failed.errors else slice(len(active))
        logits = all_logits[rows_ok]
        for p in rows.probes:
            p.on_step(step, list(active), logits)
        dt = time.perf_counter() - t0
        ended = rows.pick(active, logits)
        for i in active:
            r = rows.results[i]
            r.timings.decode_s += dt
            r.kv_bytes_per_step.append(rows.comps[i].nbytes())
            r.exact_kv_bytes_per_step.append(exact_bytes(self.info, rows.starts[i] + step))
        rows.forcing.report(step, rows.tokens, rows.batch, all_logits)
        total = rows.gen.max_new_tokens - 1
        yield Event("step", f"decode step {step} of {total}", 0.2 + 0.8 * step / max(1, total), step=step, total=total)
        yield from self._ended(rows, ended)

    def _forward(self, rows: _Lockstep, step: int) -> Tensor:
        """The model's forward for one new token per row, each at its true position: logits [B, V].

        Rows: the running runs (batch row r -> run ``rows.active[r]``), then the teacher-forced copies.
        Run i's new token sits at ``rows.starts[i] + step - 1`` (the tokens already in its cache).
        """
        model, dev = self.lm.model, self.lm.device
        active = rows.batch = list(rows.active)
        row_comps = [rows.comps[i] for i in active] + rows.forcing.compressors()
        inputs = [rows.tokens[i][-1] for i in active] + rows.forcing.inputs(rows.tokens)
        seen = [rows.starts[i] + step - 1 for i in active + rows.forcing.batch_runs()]
        cache = LockstepCache(row_comps, self.info.n_layers, seen)
        observers = [_RowObserver(p, active) for p in rows.probes if _defines(p, "on_attend")]
        # probes see one question at a time, so every row sits at the same position then
        layer_obs = [_LayerObserver(p, active, seen[0]) for p in rows.probes if _defines(p, "on_layer")]
        handler = attn.LockstepDecode(
            row_comps, [o.on_attend for o in observers], [o.on_layer for o in layer_obs], positions=seen
        )
        with attn.active(model, handler), few_row_linears(len(inputs), dev):
            out = model(
                input_ids=torch.tensor([[t] for t in inputs], device=dev),
                position_ids=torch.tensor(seen, device=dev).unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
        return out.logits[:, -1]

    def _failed(self, rows: _Lockstep, errors: dict[int, str]) -> Iterator[Event]:
        """End the runs whose compressor raised in the forward (``errors``: batch row -> message).

        A teacher-forced copy that raised is dropped (its run keeps decoding, or has ended already).
        """
        batch, forked = rows.batch, rows.forcing.batch_runs()
        for row, message in sorted(errors.items()):
            i = batch[row] if row < len(batch) else forked[row - len(batch)]
            rows.forcing.drop(i)
            if row >= len(batch) or i not in rows.active:
                continue
            rows.active.remove(i)
            r = rows.results[i]
            r.error, r.finish_reason = message, "error"
            rows.comps[i] = faults.FailedCompressor(rows.comps[i])
            yield from self._finish(r, rows.tokens[i], rows.runs[i].label)

    def _decode_all(
        self, rows: _Lockstep, t_start: float, done: str, progress: Callable[[float], float] | None = None
    ) -> Generator[Event, None, str]:
        """Decode steps until every run stopped or the time limit passed; returns the comparison's message.

        ``progress`` maps a step event's progress (0.2..1) into this part of a longer comparison."""
        for step in range(1, rows.gen.max_new_tokens):
            if not rows.active:
                break
            if self.time_limit_s is not None and time.perf_counter() - t_start > self.time_limit_s:
                return (yield from self._out_of_time(rows, step))
            try:
                events = list(self._decode_step(rows, step))
            except cancel.TimeLimit:  # inside the step's forward: the step is dropped, the tokens so far kept
                return (yield from self._out_of_time(rows, step))
            for ev in events:
                if progress is not None and ev.kind == "step":
                    ev.progress = progress(ev.progress)
                yield ev
        return done

    def _out_of_time(self, rows: _Lockstep, step: int) -> Generator[Event, None, str]:
        """Stop every running run at the time limit, keeping its tokens so far; returns the comparison's message."""
        why = f"stopped at the time limit of {self.time_limit_s:g} s (KVLAB_TIME_LIMIT_S) before decode step {step}"
        if (token := cancel.current()) is not None:
            token.limit_handled()  # what follows (finishing the runs, the probes' results) must not stop
        stopped, rows.active = list(rows.active), []
        for i in stopped:
            r = rows.results[i]
            r.error, r.finish_reason = why, "time_limit"
            yield from self._finish(r, rows.tokens[i], rows.runs[i].label)
        return f"{why}: {len(stopped)} of {len(rows.runs)} runs stopped with the tokens so far"

    def _ended(self, rows: _Lockstep, ended: list[int]) -> Iterator[Event]:
        """Finish the runs that just stopped, then let teacher forcing fork the ones that left the exact path."""
        for i in ended:
            yield from self._finish(rows.results[i], rows.tokens[i], rows.runs[i].label)
        rows.forcing.after_pick(rows.tokens, rows.comps, rows.active)

    def _result(
        self,
        prompt_ids: list[int],
        prompt_text: str,
        rows: _Lockstep,
        timings: dict,
        question: str | None = None,
        context_tokens: int = 0,
    ) -> CompareResult:
        """The finished comparison: the model, the prompt, the settings and every run's result.

        ``question`` not None: the query-agnostic protocol (the question fed after compressing
        the first ``context_tokens`` tokens)."""
        return CompareResult(
            model=self.info.to_json(),
            prompt=prompt_text,
            prompt_tokens=len(prompt_ids),
            prompt_token_ids=list(prompt_ids),
            settings=asdict(rows.gen),
            timings=timings,
            runs=rows.results,
            protocol=QUERY_AWARE if question is None else QUERY_AGNOSTIC,
            question=question or "",
            context_tokens=context_tokens,
        )

    def _finish(self, r: RunResult, toks: list[int], label: str) -> Iterator[Event]:
        r.token_ids = list(toks)
        r.text = self.lm.decode(toks)
        decoded = max(0, len(toks) - 1)
        r.timings.tokens_per_s = decoded / r.timings.decode_s if r.timings.decode_s > 0 else 0.0
        yield Event("run_done", f"{label}: {len(toks)} tokens ({r.finish_reason})", -1, run=label)

    def compare(
        self, prompt_ids: list[int], runs: list[RunSpec], gen: GenerationSettings | None = None, **kw
    ) -> CompareResult:
        """The result of ``stream`` (with ``questions=``: the first question's; ``compare_all`` gives all)."""
        return self.compare_all(prompt_ids, runs, gen, **kw)[0]

    def compare_all(
        self, prompt_ids: list[int], runs: list[RunSpec], gen: GenerationSettings | None = None, **kw
    ) -> list[CompareResult]:
        """Every question's result (one item without ``questions=``)."""
        results: list[CompareResult] = []
        for ev in self.stream(prompt_ids, runs, gen, **kw):
            if ev.kind == "done":
                results = ev.results
        return results


class _Lockstep:
    """One comparison while it decodes: per run its compressor, result, tokens and sampler; the running runs."""

    def __init__(
        self,
        runs: list[RunSpec],
        comps: list[Compressor],
        results: list[RunResult],
        gen: GenerationSettings,
        n: int,
        eos: set[int],
        probes: list[Probe],
    ):
        self.runs, self.comps, self.results, self.gen, self.eos = runs, comps, results, gen, eos
        self.starts = [n] * len(runs)  # per run: the tokens in its cache before the first decode step
        self.probes = probes
        exact = next((i for i, spec in enumerate(runs) if spec.method == "exact"), None)
        self.forcing = _TeacherForcing(exact, [p for p in probes if getattr(p, "teacher_forced", False)])
        self.generators = [torch.Generator().manual_seed(gen.seed) for _ in runs]
        self.tokens: list[list[int]] = [[] for _ in runs]
        self.active: list[int] = []
        self.batch: list[int] = []  # the runs of the last forward's free rows, in row order

    @classmethod
    def joined(cls, parts: list[_Lockstep]) -> _Lockstep:
        """The rows of several questions decoded as one batch: every list is the parts' in order and
        shares their items, so each part's results and tokens fill in as the batch decodes; each
        step's logits go to the probes of the question that owns the row (``forkable`` probes only)."""
        first = parts[0]
        router = [_ProbeRouter(parts)] if any(part.probes for part in parts) else []
        rows = cls([], [], [], first.gen, 0, first.eos, router)
        for part in parts:
            offset = len(rows.runs)
            rows.runs += part.runs
            rows.comps += part.comps
            rows.results += part.results
            rows.starts += part.starts
            rows.generators += part.generators
            rows.tokens += part.tokens
            rows.active += [offset + i for i in part.active]
        return rows

    def pick(self, rows, logits) -> list[int]:
        """Each row's next token from its logits [V]; updates the running runs and returns those that stopped."""
        still = []
        for i, row_logits in zip(rows, logits):
            t = _pick(row_logits, self.gen, self.generators[i])
            self.tokens[i].append(t)
            if t in self.eos:
                self.results[i].finish_reason = "eos"
            elif len(self.tokens[i]) >= self.gen.max_new_tokens:
                self.results[i].finish_reason = "length"
            else:
                still.append(i)
        ended = [i for i in rows if i not in still]
        self.active = still
        return ended


class _ProbeRouter:
    """The ``on_step`` of several questions' rows decoded as one batch, split back to each question's
    own probes (with the run indices of that question)."""

    def __init__(self, parts: list[_Lockstep]):
        self.parts, offset = [], 0
        for part in parts:
            self.parts.append((offset, len(part.runs), part.probes))
            offset += len(part.runs)

    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None:
        for offset, n, probes in self.parts:
            mine = [k for k, i in enumerate(rows) if offset <= i < offset + n]
            if mine:
                local = [rows[k] - offset for k in mine]
                for p in probes:
                    p.on_step(step, local, logits[mine])


class _RowObserver:
    """Maps batch rows (active runs only) back to run indices for a probe."""

    def __init__(self, probe: Probe, active: list[int]):
        self.probe, self.active = probe, active

    def on_attend(self, layer: int, row: int, q: Tensor, out: Tensor) -> None:
        if row < len(self.active) and not faults.failed(row):  # teacher-forced rows come after the free ones
            self.probe.on_attend(layer, self.active[row], q, out)


def _defines(probe, hook: str) -> bool:
    """True when ``probe`` implements ``hook`` with a body (Protocol stubs and missing hooks: False)."""
    fn = getattr(type(probe), hook, None)
    return fn is not None and getattr(Probe, hook, None) is not fn


class _LayerObserver:
    """Hands a probe the free-running rows of each layer's batch (teacher-forced rows come after them)."""

    def __init__(self, probe: Probe, active: list[int], pos: int):
        self.probe, self.active, self.pos = probe, active, pos

    def on_layer(self, layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        r = len(self.active)
        ok = [row for row in range(r) if not faults.failed(row)]  # a failed row's output is zeros
        if len(ok) < r:
            self.probe.on_layer(layer, [self.active[row] for row in ok], self.pos, q[ok], k[ok], v[ok], out[ok])
        else:
            self.probe.on_layer(layer, self.active, self.pos, q[:r], k[:r], v[:r], out[:r])

    def on_chunk(self, layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        self.probe.on_chunk(layer, self.active, self.pos, q, k, v, out)


class _TeacherForcing:
    """Runs fed the exact run's tokens, for teacher-forced fidelity at little extra cost.

    While a run's tokens equal the exact run's, its free-running row *is* the teacher-forced row.
    When it first picks a different token (or stops), its compressor (which has seen only the
    shared tokens so far) is copied and the copy is fed the exact tokens as an extra batch row.
    """

    def __init__(self, exact: int | None, probes: list):
        self.exact, self.probes = exact, probes
        self.on = exact is not None and bool(probes)
        self.aligned: set[int] = set()
        self.forked: dict[int, Compressor] = {}
        self.batch: list[int] = []
        self.started = False

    def after_pick(self, tokens: list[list[int]], comps: list[Compressor], active: list[int]) -> None:
        """Update after tokens were picked; ``active`` are the runs that decode on."""
        if not self.on:
            return
        if self.exact not in active:  # the exact continuation is complete: nothing more to force
            self.on, self.forked, self.aligned = False, {}, set()
            return
        if not self.started:
            self.started = True
            self.aligned = {i for i in range(len(tokens)) if i != self.exact}
        ref = tokens[self.exact]
        for i in sorted(self.aligned):
            if tokens[i] != ref[: len(tokens[i])] or len(tokens[i]) != len(ref) or i not in active:
                self.aligned.discard(i)
                self.forked[i] = copy.deepcopy(comps[i])

    def compressors(self) -> list[Compressor]:
        """The forked copies, one batch row each (after the free rows), in ``batch_runs`` order."""
        self.batch = list(self.forked) if self.on else []
        return [self.forked[i] for i in self.batch]

    def batch_runs(self) -> list[int]:
        """The run of each teacher-forced row of the last forward, in row order."""
        return self.batch

    def drop(self, i: int) -> None:
        """Stop feeding run ``i`` the exact tokens (its method raised); without the exact run, stop altogether."""
        self.aligned.discard(i)
        self.forked.pop(i, None)
        if i == self.exact:
            self.on, self.forked, self.aligned = False, {}, set()

    def inputs(self, tokens: list[list[int]]) -> list[int]:
        return [tokens[self.exact][-1]] * len(self.forked) if self.on else []

    def report(self, step: int, tokens: list[list[int]], active: list[int], logits: Tensor) -> None:
        """``logits`` [B, V]: the free rows (``active``), then the forked rows in order."""
        if not self.on:
            return
        row = {i: r for r, i in enumerate(active)}
        forced = {i: logits[row[i]] for i in self.aligned | {self.exact} if i in row}
        forced.update({i: logits[len(active) + j] for j, i in enumerate(self.batch) if i in self.forked})
        for p in self.probes:
            p.on_forced(step, tokens[self.exact][-1], logits[row[self.exact]], forced)


def _plan(comp: Compressor, n: int, decode_steps: int) -> dict | BudgetRefused | PlanFailed:
    """The run's knobs; or why it cannot run: its budget refused, or its plan raised (that run only)."""
    comp.decode_steps = decode_steps
    try:
        return planned(comp, n)
    except (BudgetRefused, UnsupportedAttention) as exc:  # the budget, or the model's attention, refused
        return exc
    except faults.OOM:
        raise
    except Exception as exc:  # a method's failure ends its own run
        return PlanFailed(faults.describe(exc))


class PlanFailed(Exception):
    """A method's ``plan`` raised: its run ends before the prefill with this message as its error."""


def _within(lo: float, span: float, progress: float) -> float:
    """A step's progress (0.2..1 of a single comparison) within the span [lo, lo + span] of a longer one."""
    return lo + span * (progress - 0.2) / 0.8


def _drop_unmeasured(results: list[RunResult]) -> None:
    """A run that failed before its first token has nothing to measure: no metrics, no extras."""
    for r in results:
        if r.finish_reason == "error" and not r.token_ids:
            r.metrics, r.extras = {}, {}


class _Context(NamedTuple):
    """What every question of a query-agnostic comparison starts from: the context's ids, the runs,
    their compressed caches and results (forked per question), the prefill's state and last logits [V]."""

    ids: list[int]
    runs: list[RunSpec]
    comps: list[Compressor]
    results: list[RunResult]
    state: PrefillState
    logits: Tensor
    gen: GenerationSettings


class _Planned(NamedTuple):
    """The runs left after planning (refused ones set aside), their compressors and chosen knobs."""

    runs: list[RunSpec]
    comps: list[Compressor]
    knobs: list[dict]
    refusals: _Refusals


@dataclass
class _Refusals:
    """Runs whose plan refused its budget (``BudgetRefused``): left out of prefill and decoding, then put
    back in the result, in the asked order, as runs that ended ``refused`` with the reason in ``error``."""

    asked: list[RunSpec]
    refused: dict[int, BudgetRefused | PlanFailed]

    def kept(self, xs: list) -> list:
        return [x for i, x in enumerate(xs) if i not in self.refused]

    def events(self) -> Iterator[Event]:
        for i, exc in self.refused.items():
            why = "ended on an error" if isinstance(exc, PlanFailed) else "refused"
            yield Event("run_done", f"{self.asked[i].label}: {why}: {exc}", -1, run=self.asked[i].label)

    def merged(self, result: CompareResult) -> CompareResult:
        ran = iter(result.runs)
        result.runs = [
            RunResult(
                spec.method,
                None if spec.budget is None else spec.budget.label,
                _jsonable(dict(spec.params)),
                finish_reason="error" if isinstance(self.refused[i], PlanFailed) else "refused",
                error=str(self.refused[i]),
            )
            if i in self.refused
            else next(ran)
            for i, spec in enumerate(self.asked)
        ]
        return result


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, Tensor):
            v = v.tolist()
        elif isinstance(v, (tuple, set)):
            v = list(v)
        out[k] = v
    return out
