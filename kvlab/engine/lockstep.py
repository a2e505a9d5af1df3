"""Lockstep decoding: every run of a comparison decodes in one batched forward per step.

Row i of the batch attends through run i's compressor (``attention.LockstepDecode``), each at its
own true position. A run leaves the batch at EOS, at the token limit, when its method raises (its
run ends with the error, the others go on) or at the time limit (every run keeps its tokens so
far). Teacher forcing (``TeacherForcing``) adds rows fed the exact run's tokens for the probes that
ask (``Probe.teacher_forced``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict

import torch
from torch import Tensor

from kvlab.core import cancel
from kvlab.core.budgets import exact_bytes
from kvlab.core.model import LoadedModel, ModelInfo
from kvlab.core.results import QUERY_AGNOSTIC, QUERY_AWARE, CompareResult, RunResult
from kvlab.engine import attention as attn
from kvlab.engine import faults
from kvlab.engine.probe import LayerObserver, Probe, ProbeRouter, RowObserver
from kvlab.engine.rows import FAST, DecodePaths, forward_rows
from kvlab.engine.sampling import next_token
from kvlab.engine.specs import Event, GenerationSettings, RunSpec
from kvlab.engine.teacher_forcing import TeacherForcing
from kvlab.methods import Compressor


class Lockstep:
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
        self.forcing = TeacherForcing(exact, [p for p in probes if p.teacher_forced])
        self.generators = [torch.Generator().manual_seed(gen.seed) for _ in runs]
        self.tokens: list[list[int]] = [[] for _ in runs]
        self.active: list[int] = []
        self.batch: list[int] = []  # the runs of the last forward's free rows, in row order

    @classmethod
    def joined(cls, parts: list[Lockstep]) -> Lockstep:
        """The rows of several questions decoded as one batch: every list is the parts' in order and
        shares their items, so each part's results and tokens fill in as the batch decodes; each
        step's logits go to the probes of the question that owns the row (``forkable`` probes only)."""
        first = parts[0]
        routed = any(part.probes for part in parts)
        router: list[Probe] = [ProbeRouter([(len(p.runs), p.probes) for p in parts])] if routed else []
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

    def pick(self, rows: list[int], logits: Tensor | Sequence[Tensor]) -> list[int]:
        """Each row's next token from its logits [V]; updates the running runs and returns those that stopped."""
        still = []
        for i, row_logits in zip(rows, logits):
            t = next_token(row_logits, self.gen, self.generators[i])
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

    def compare_result(
        self,
        info: ModelInfo,
        prompt_ids: list[int],
        prompt_text: str,
        timings: dict[str, float],
        question: str | None = None,
        context_tokens: int = 0,
    ) -> CompareResult:
        """The finished comparison: the model, the prompt, the settings and every run's result.

        ``question`` not None: the query-agnostic protocol (the question fed after compressing
        the first ``context_tokens`` tokens)."""
        return CompareResult(
            model=info.to_json(),
            prompt=prompt_text,
            prompt_tokens=len(prompt_ids),
            prompt_token_ids=list(prompt_ids),
            settings=asdict(self.gen),
            timings=timings,
            runs=self.results,
            protocol=QUERY_AWARE if question is None else QUERY_AGNOSTIC,
            question=question or "",
            context_tokens=context_tokens,
        )


def drop_unmeasured(results: list[RunResult]) -> None:
    """A run that failed before its first token has nothing to measure: no metrics, no extras."""
    for r in results:
        if r.finish_reason == "error" and not r.token_ids:
            r.metrics, r.extras = {}, {}


class Decoder:
    """Decodes a comparison's rows on ``lm``: the first tokens, then one batched forward per step until
    every run stopped or ``time_limit_s`` (seconds since the comparison began; None: none) passed,
    along ``paths`` (the fast ones by default)."""

    def __init__(self, lm: LoadedModel, time_limit_s: float | None, paths: DecodePaths = FAST):
        self.lm, self.info, self.time_limit_s, self.paths = lm, lm.info, time_limit_s, paths

    def first_tokens(self, rows: Lockstep, logits: Tensor) -> Iterator[Event]:
        """Every run's first token from the shared prefill's logits [V] (a run whose compression failed ends here)."""
        ok = [i for i, r in enumerate(rows.results) if not r.error]
        yield from self.ended(rows, rows.pick(ok, [logits] * len(ok)))
        for i in sorted(set(range(len(rows.runs))) - set(ok)):
            rows.results[i].finish_reason = "error"
            rows.forcing.drop(i)
            yield from self.finish(rows.results[i], [], rows.runs[i].label)

    def decode_all(
        self, rows: Lockstep, t_start: float, done: str, progress: Callable[[float], float] | None = None
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

    def ended(self, rows: Lockstep, ended: list[int]) -> Iterator[Event]:
        """Finish the runs that just stopped, then let teacher forcing fork the ones that left the exact path."""
        for i in ended:
            yield from self.finish(rows.results[i], rows.tokens[i], rows.runs[i].label)
        rows.forcing.after_pick(rows.tokens, rows.comps, rows.active)

    def finish(self, r: RunResult, toks: list[int], label: str) -> Iterator[Event]:
        """A run has ended with tokens ``toks``: its text and speed, and its ``run_done`` event."""
        r.token_ids = list(toks)
        r.text = self.lm.decode(toks)
        decoded = max(0, len(toks) - 1)
        r.timings.tokens_per_s = decoded / r.timings.decode_s if r.timings.decode_s > 0 else 0.0
        yield Event("run_done", f"{label}: {len(toks)} tokens ({r.finish_reason})", -1, run=label)

    def _decode_step(self, rows: Lockstep, step: int) -> Iterator[Event]:
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
        yield from self.ended(rows, ended)

    def _forward(self, rows: Lockstep, step: int) -> Tensor:
        """The model's forward for one new token per row, each at its true position: logits [B, V].

        Rows: the running runs (batch row r -> run ``rows.active[r]``), then the teacher-forced copies.
        Run i's new token sits at ``rows.starts[i] + step - 1`` (the tokens already in its cache).
        """
        active = rows.batch = list(rows.active)
        row_comps = [rows.comps[i] for i in active] + rows.forcing.compressors()
        inputs = [rows.tokens[i][-1] for i in active] + rows.forcing.inputs(rows.tokens)
        seen = [rows.starts[i] + step - 1 for i in active + rows.forcing.batch_runs()]
        observers = [RowObserver(p, active) for p in rows.probes if p.attends]
        # probes see one question at a time, so every row sits at the same position then
        layer_obs = [LayerObserver(p, active, seen[0]) for p in rows.probes if p.sees_layers]
        handler = attn.LockstepDecode(
            row_comps, seen, [o.on_attend for o in observers], [o.on_layer for o in layer_obs], self.paths.row_attention
        )
        return forward_rows(self.lm, handler, [[t] for t in inputs], seen)

    def _failed(self, rows: Lockstep, errors: dict[int, str]) -> Iterator[Event]:
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
            yield from self.finish(r, rows.tokens[i], rows.runs[i].label)

    def _out_of_time(self, rows: Lockstep, step: int) -> Generator[Event, None, str]:
        """Stop every running run at the time limit, keeping its tokens so far; returns the comparison's message."""
        why = f"stopped at the time limit of {self.time_limit_s:g} s (KVLAB_TIME_LIMIT_S) before decode step {step}"
        if (token := cancel.current()) is not None:
            token.limit_handled()  # what follows (finishing the runs, the probes' results) must not stop
        stopped, rows.active = list(rows.active), []
        for i in stopped:
            r = rows.results[i]
            r.error, r.finish_reason = why, "time_limit"
            yield from self.finish(r, rows.tokens[i], rows.runs[i].label)
        return f"{why}: {len(stopped)} of {len(rows.runs)} runs stopped with the tokens so far"
