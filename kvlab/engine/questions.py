"""Questions asked of one context, in either protocol (docs/tasks.md).

Query-agnostic (``ask_after``): the context alone is prefilled and compressed once (by the engine);
then, for each question, every compressed cache is forked and the question's tokens are fed
through it in one chunked forward (true positions, causal inside the chunk, each compressor's
``feed``: ``feed_question``). All the questions' rows then decode in one lockstep batch: N
questions cost one prefill and one compression per method.

Query-aware with several questions (``kvlab.engine.comparison.each_in_own_prompt``): each question's
whole prompt (context and question) is prefilled and compressed on its own, one comparison after
another.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Generator, Iterator
from typing import NamedTuple

from torch import Tensor

from kvlab.core.budgets import exact_bytes
from kvlab.core.model import LoadedModel
from kvlab.core.results import CompareResult, RunResult
from kvlab.engine import attention as attn
from kvlab.engine import faults
from kvlab.engine.lockstep import Decoder, Lockstep, drop_unmeasured
from kvlab.engine.planning import Refusals
from kvlab.engine.probe import LayerObserver, Probe
from kvlab.engine.rows import feed_stepwise, forward_rows
from kvlab.engine.specs import Event, GenerationSettings, Question, RunSpec
from kvlab.methods import Compressor, PrefillState


class CompressedContext(NamedTuple):
    """What every question of a query-agnostic comparison starts from: the context's ids, the runs,
    their compressed caches and results (forked per question), the prefill's state and last logits [V]."""

    ids: list[int]
    runs: list[RunSpec]
    comps: list[Compressor]
    results: list[RunResult]
    state: PrefillState
    logits: Tensor
    gen: GenerationSettings


def ask_after(
    decoder: Decoder,
    ctx: CompressedContext,
    refusals: Refusals,
    probes: list[Probe],
    questions: list[Question],
    t_start: float,
    shared: dict[str, float],
) -> Iterator[Event]:
    """Query-agnostic, once the context is compressed: per question a fork of every cache and one
    chunked forward of the question's tokens; then lockstep decoding. Yields the events up to ``done``.

    Every question's rows decode together (one batched forward per step for all questions, each
    row at its own true position) when every probe is ``forkable`` (a fresh copy of it then
    follows each question); other probes follow one question at a time, so with them each
    question decodes on its own.

    Timings: ``shared`` (``prefill_s``, ``compress_s`` and ``shared_s``: prefill + compression, once
    for all questions) and ``own_s`` (this question: its fork and chunk, plus its share of the
    decoding it was batched in); ``compare_s`` = shared_s + own_s.
    """
    n, info = len(ctx.ids), decoder.info
    out: list[CompareResult] = []
    joint = all(p.forkable for p in probes)
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
            rows = yield from ask(decoder, ctx, questions, j, followers[j], progress)
            asked.append(rows)
            own.append(time.perf_counter() - t_q)
        t_d = time.perf_counter()
        rows = asked[0] if len(asked) == 1 else Lockstep.joined(asked)
        within = functools.partial(_within, lo + 0.2 * span, 0.8 * span)  # this group's share of the bar
        done = yield from decoder.decode_all(
            rows, t_start, f"{len(ctx.runs)} runs x {len(questions)} questions done", within
        )
        decode_share = (time.perf_counter() - t_d) / len(group)
        for j, rows, own_s in zip(group, asked, own):
            q, results = questions[j], rows.results
            for p in followers[j]:
                p.finish(results)
            drop_unmeasured(results)
            timings = {**shared, "question_s": results[0].timings.question_s, "own_s": own_s + decode_share}
            timings["compare_s"] = shared["shared_s"] + timings["own_s"]
            out.append(refusals.merged(rows.compare_result(info, ctx.ids + q.ids, q.prompt_text, timings, q.text, n)))
    yield Event("done", done, 1.0, result=out[0], results=out)


def ask(
    decoder: Decoder, ctx: CompressedContext, questions: list[Question], j: int, probes: list[Probe], progress: float
) -> Generator[Event, None, Lockstep]:
    """Question ``j``: fork every compressed cache (the last question takes the caches themselves),
    feed its tokens in one chunked forward and pick each run's first token; ``probes`` follow
    this question. Returns its rows."""
    n, q, runs = len(ctx.ids), questions[j], ctx.runs
    last = j == len(questions) - 1
    qcomps = ctx.comps if last else [copy.deepcopy(c) for c in ctx.comps]
    results = ctx.results if last else copy.deepcopy(ctx.results)
    for p in probes:
        p.on_prefill(ctx.state, ctx.logits, qcomps)
    rows = Lockstep(runs, qcomps, results, ctx.gen, n + len(q.ids), decoder.lm.eos_ids, probes)
    with faults.collect() as failed:
        logits = feed_question(decoder, rows, n, q.ids)
    for i, message in sorted(failed.errors.items()):  # a method that raised on the question
        r = rows.results[i]
        r.error, r.finish_reason = message, "error"
        rows.comps[i] = faults.FailedCompressor(rows.comps[i])
        yield from decoder.finish(r, rows.tokens[i], rows.runs[i].label)
    yield Event(
        "question",
        f"question {j + 1} of {len(questions)}: {len(q.ids)} tokens fed through every cache "
        f"in {results[0].timings.question_s:.2f} s",
        progress,
    )
    everyone = [i for i in range(len(runs)) if i not in failed.errors]
    for p in probes:
        p.on_step(0, everyone, logits[everyone])
    yield from decoder.ended(rows, rows.pick(everyone, logits[everyone]))
    return rows


def feed_question(decoder: Decoder, rows: Lockstep, seen: int, ids: list[int]) -> Tensor:
    """Every run's cache takes the question's c tokens at true positions seen..seen+c-1 (``feed_chunk``;
    one decode step per token without ``decoder.paths.chunked_questions``): logits [B, V] after its last token.

    Records each run's bytes after the question (``kv_bytes_per_step[1]``) and the forward's time.
    """
    lm = decoder.lm
    t0 = time.perf_counter()
    if decoder.paths.chunked_questions:
        logits = feed_chunk(lm, rows.comps, rows.probes, seen, ids)
    else:  # the reference path; the decode path calls no probe's ``on_chunk``
        logits = feed_stepwise(lm, rows.comps, seen, ids)
    dt = time.perf_counter() - t0
    for r, comp in zip(rows.results, rows.comps):
        r.timings.question_s = dt
        r.kv_bytes_per_step.append(comp.nbytes())
        r.exact_kv_bytes_per_step.append(exact_bytes(lm.info, seen + len(ids)))
    return logits


def feed_chunk(lm: LoadedModel, comps: list[Compressor], probes: list[Probe], seen: int, ids: list[int]) -> Tensor:
    """Row i feeds ``ids`` through ``comps[i]`` at true positions seen..seen+c-1 in one chunked forward
    (input_ids [B, c], causal inside the chunk; the probes' ``on_chunk``): logits [B, V] after the last."""
    everyone = list(range(len(comps)))
    observers = [LayerObserver(p, everyone, seen) for p in probes if p.sees_chunks]
    handler = attn.LockstepChunk(comps, seen, [o.on_chunk for o in observers])
    return forward_rows(lm, handler, [ids] * len(comps), seen)


def _within(lo: float, span: float, progress: float) -> float:
    """A step's progress (0.2..1 of a single comparison) within the span [lo, lo + span] of a longer one."""
    return lo + span * (progress - 0.2) / 0.8


__all__ = ["CompressedContext", "ask", "ask_after", "feed_chunk", "feed_question"]
