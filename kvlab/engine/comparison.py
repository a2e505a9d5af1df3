"""The engine: one exact prefill shared by every method, then lockstep decoding.

Data flow (docs/design.md §3): tokenize -> plan every run (``kvlab.engine.planning``: refused runs set
aside) -> one exact prefill (K/V of the prompt, last queries and, when a method asks, accumulated
attention) -> each method compresses its own copy -> decode all methods together, one batched
forward per step, row i attending through method i's cache (``kvlab.engine.lockstep``) -> results.
Positions always continue from the true number of tokens seen.

``Engine.stream`` yields progress ``Event``s; the last one carries the ``CompareResult``. The CLI,
the dashboard and the sweeps go through ``kvlab.run``, which adds the text metrics and task scores.

Two protocols (docs/tasks.md): query-aware (the default) prefills and compresses the whole prompt,
question included. Query-agnostic (``questions=`` given) prefills and compresses the context once,
then asks each question through a fork of every compressed cache (``kvlab.engine.questions``).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from typing import Literal

import torch

from kvlab.core import cancel, threads
from kvlab.core.budgets import exact_bytes
from kvlab.core.model import LoadedModel
from kvlab.core.results import CompareResult, RunResult, RunTimings
from kvlab.engine import faults
from kvlab.engine.lockstep import Decoder, Lockstep, drop_unmeasured
from kvlab.engine.planning import jsonable, planned
from kvlab.engine.prefill import prefill_for
from kvlab.engine.probe import Probe
from kvlab.engine.questions import CompressedContext, ask_after
from kvlab.engine.rows import FAST, DecodePaths
from kvlab.engine.specs import Event, GenerationSettings, InputError, Question, RunSpec, results_of
from kvlab.methods import Compressor, PrefillState


class Engine:
    """Runs comparisons on ``lm``. ``time_limit_s``: a comparison's time limit in seconds (None: none;
    "environment", the default: ``faults.time_limit_s``, from ``KVLAB_TIME_LIMIT_S`` or the Space).
    ``paths``: the fast paths by default, or the reference paths they must equal (``DecodePaths``)."""

    def __init__(
        self,
        lm: LoadedModel,
        time_limit_s: float | None | Literal["environment"] = "environment",
        paths: DecodePaths = FAST,
    ):
        self.lm = lm
        self.info = lm.info
        self.time_limit_s = faults.time_limit_s() if time_limit_s == "environment" else time_limit_s
        self.paths = paths
        cancel.install(lm.model, lm.info.n_layers)  # a cancel or the time limit stops a forward between layers

    # ----- compare ------------------------------------------------------------------------
    def check_prompt(self, ids: list[int], gen: GenerationSettings, prefilled: int | None = None) -> None:
        """Refuse (``InputError``, one line) an empty prompt, one past the model's context, and a run that would
        cross a length where the model's RoPE switches factors (``ModelInfo.switch_crossed``). ``ids``: every
        token fed before generating (the context and the longest question); ``prefilled``: the tokens of the
        prefill (None: all of ``ids``)."""
        if not ids:
            raise InputError("the prompt is empty; type some text or pick a preset")
        limit = self.info.max_positions
        if len(ids) + gen.max_new_tokens > limit:
            raise InputError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({gen.max_new_tokens}) exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or generate fewer tokens"
            )
        first = len(ids) if prefilled is None else prefilled
        longest = len(ids) + gen.max_new_tokens - 1  # the last generated token is never fed
        switch = self.info.switch_crossed(first, longest)
        if switch is not None:
            what = f"the context ({first} tokens) + the longest question" if prefilled is not None else "the prompt"
            raise InputError(
                f"{what} + max_new_tokens ({gen.max_new_tokens}) would run past {switch} tokens, where this "
                f"model's RoPE switches to other factors for every position (transformers' generate re-encodes the "
                f"whole sequence there; kvlab's compressed caches cannot): keep prompt + max_new_tokens at most "
                f"{switch + 1} tokens, or use a prompt longer than {switch} tokens (docs/models.md)"
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

        Steps: plan and make compressors -> one exact prefill -> compress all -> first tokens (from
        the prefill's logits) -> decode steps (one batched forward each) -> result.

        ``questions`` (query-agnostic): ``prompt_ids`` is the context alone, compressed once; each
        question is then fed through a fork of every compressed cache (``questions.ask_after``).

        A cancel of the current ``kvlab.core.cancel`` token stops the work within one layer
        (``cancel.Cancelled``). The time limit does too: while decoding, the runs then end with
        their tokens so far; before the first token, ``cancel.TimeLimit`` ends the comparison.
        """
        why = f"stopped at the time limit of {self.time_limit_s:g} s (KVLAB_TIME_LIMIT_S)" if self.time_limit_s else ""
        token = cancel.Token.within(self.time_limit_s, f"{why} before the first token: nothing was generated")
        governed = threads.governed(self._stream(prompt_ids, runs, gen, prompt_text, probes, questions))
        return cancel.scoped(governed, token)

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
            self.check_prompt(prompt_ids + max((q.ids for q in questions), key=len), gen, len(prompt_ids))
        else:
            self.check_prompt(prompt_ids, gen)
        if not runs:
            raise InputError("no method selected; choose at least one")
        probes = probes or []
        t_start = time.perf_counter()
        decoder = Decoder(self.lm, self.time_limit_s, self.paths)
        # the cache grows by the question's tokens and the generated ones: a plan must hold both
        grows = gen.max_new_tokens - 1 + max((len(q.ids) for q in questions or ()), default=0)
        runs, comps, knobs, refusals = planned(self.info, runs, len(prompt_ids), gen.seed, grows)
        yield from refusals.events()
        if not runs:  # every run refused: nothing to prefill
            rows = Lockstep([], [], [], gen, len(prompt_ids), self.lm.eos_ids, [])
            timings = {"compare_s": time.perf_counter() - t_start}
            none = refusals.merged(rows.compare_result(self.info, prompt_ids, prompt_text, timings))
            yield Event("done", "every run refused its budget", 1.0, result=none, results=[none])
            return

        state, last_logits, prefill_s = prefill_for(self.lm, prompt_ids, comps)
        what = f"the context ({len(prompt_ids)} tokens)" if questions else f"{len(prompt_ids)} tokens"
        yield Event("prefill", f"prefill of {what} done in {prefill_s:.2f} s", 0.1)
        results = yield from self._compress_all(state, runs, comps, knobs, prefill_s)
        if questions:
            shared = {
                "prefill_s": prefill_s,
                "compress_s": sum(r.timings.compress_s for r in results),
                "shared_s": time.perf_counter() - t_start,
            }
            context = CompressedContext(prompt_ids, runs, comps, results, state, last_logits, gen)
            del state
            yield from ask_after(decoder, context, refusals, probes, questions, t_start, shared)
            return

        for p in probes:
            p.on_prefill(state, last_logits, comps)
        del state  # the prompt's exact K/V: each compressor holds its own copy now

        rows = Lockstep(runs, comps, results, gen, len(prompt_ids), self.lm.eos_ids, probes)
        yield from decoder.first_tokens(rows, last_logits)
        done = yield from decoder.decode_all(rows, t_start, f"{len(runs)} runs done")

        for p in probes:
            p.finish(results)
        drop_unmeasured(results)
        timings = {"compare_s": time.perf_counter() - t_start, "prefill_s": prefill_s}
        result = refusals.merged(rows.compare_result(self.info, prompt_ids, prompt_text, timings))
        yield Event("done", done, 1.0, result=result, results=[result])

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
            if error:  # this run ends here (see Decoder.first_tokens); its stand-in holds nothing
                comps[i] = comp = faults.FailedCompressor(comp)
            comp_s = time.perf_counter() - t0
            r = RunResult(
                method=spec.method,
                budget=None if spec.budget is None else spec.budget.label,
                params=jsonable({**comp.cfg, **knobs[i]}),
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

    def compare(
        self, prompt_ids: list[int], runs: list[RunSpec], gen: GenerationSettings | None = None, **kw
    ) -> CompareResult:
        """The result of ``stream`` (with ``questions=``: the first question's; ``compare_all`` gives all)."""
        return self.compare_all(prompt_ids, runs, gen, **kw)[0]

    def compare_all(
        self, prompt_ids: list[int], runs: list[RunSpec], gen: GenerationSettings | None = None, **kw
    ) -> list[CompareResult]:
        """Every question's result (one item without ``questions=``)."""
        return results_of(self.stream(prompt_ids, runs, gen, **kw))


def each_in_own_prompt(
    engine: Engine,
    ctx: list[int],
    questions: list[Question],
    runs: list[RunSpec],
    gen: GenerationSettings,
    probes: list[Probe],
) -> Iterator[Event]:
    """Query-aware with several questions: each question's whole prompt (``ctx`` + its ids) prefilled and
    compressed on its own; one ``question`` event after each, then ``done`` with every question's result."""
    results: list[CompareResult] = []
    span = 1.0 / len(questions)
    for j, q in enumerate(questions):
        for ev in engine.stream(ctx + q.ids, runs, gen, q.prompt_text, probes):
            if ev.kind == "done":
                assert ev.result is not None
                ev.result.question, ev.result.context_tokens = q.text, len(ctx)
                results.append(ev.result)
                yield Event("question", f"question {j + 1} of {len(questions)} done", span * (j + 1))
            else:
                if ev.progress >= 0:
                    ev.progress = span * (j + ev.progress)
                yield ev
    yield Event("done", f"{len(runs)} runs x {len(questions)} questions done", 1.0, result=results[0], results=results)


__all__ = ["Engine", "each_in_own_prompt"]
