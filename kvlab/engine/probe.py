"""Measurement hooks on a comparison (metrics add these; the engine stays measurement-agnostic).

A probe subclasses ``Probe``: every hook has a no-op default, and the class declares which of the
costly optional hooks it wants, so the engine wires only those:

* ``on_prefill``, ``on_step``, ``finish``: always called;
* ``attends = True``: ``on_attend(layer, run, q, out)`` for every running row at every layer of
  every decode step (q/out [Hq, 1, d]);
* ``sees_layers = True``: ``on_layer(layer, rows, pos, q, k, v, out)`` once per layer and decode
  step with the whole batch of free-running rows (``rows``: their run indices; q/out [R, Hq, 1, d],
  k/v [R, Hkv, 1, d] the new token's key/value at true position ``pos``);
* ``sees_chunks = True``: ``on_chunk(layer, rows, pos, q, k, v, out)`` once per layer when a
  question is fed after compression (query-agnostic): q/out [R, Hq, c, d], k/v [R, Hkv, c, d] at
  true positions pos..pos+c-1, every run a row;
* ``teacher_forced = True`` (may be set per instance): ``on_forced(step, token, exact_logits,
  forced)``; the engine then also feeds each run the exact run's tokens (the free-running row
  itself while its tokens equal the exact run's, else a copy of its compressor forked at the
  divergence, in the same batched forward) and reports, after each step, the exact run's token,
  its logits [V] and ``forced`` {run index: logits [V] of that run fed the exact tokens}. Needs an
  ``exact`` run;
* ``forkable = True``: the probe is stateless until ``on_prefill`` and wants no hooks but
  ``on_prefill``, ``on_chunk``, ``on_step`` and ``finish``; several questions asked after
  compression then decode as one batch, each followed by its own copy of the probe.

Query-agnostic: a probe sees one ``on_prefill`` .. ``finish`` cycle per question (``on_prefill``
gets the context's state and that question's fork of the compressors; ``logits`` are the
context's last), then ``on_chunk`` per layer, then ``on_step(0, rows, logits [R, V])`` with each
run's logits after the question (the first token's), then the decode steps as usual.

The adapters below (``RowObserver``, ``LayerObserver``, ``ProbeRouter``) map the rows of a batched
forward back to a probe's run indices.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from kvlab.core.results import RunResult
from kvlab.engine import faults
from kvlab.methods import Compressor, PrefillState


class Probe:
    """A probe's hooks, each a no-op; a subclass overrides what it measures and sets the flags of the
    optional hooks it overrides (``attends``, ``sees_layers``, ``sees_chunks``, ``teacher_forced``)."""

    attends: ClassVar[bool] = False
    sees_layers: ClassVar[bool] = False
    sees_chunks: ClassVar[bool] = False
    teacher_forced: bool = False
    forkable: ClassVar[bool] = False

    def on_prefill(self, state: PrefillState, logits: Tensor, compressors: list[Compressor]) -> None:
        """After compression: the prefill's state, its last logits [V] and each run's compressor."""

    def on_attend(self, layer: int, row: int, q: Tensor, out: Tensor) -> None:
        """Run ``row``'s query and attention output [Hq, 1, d] at ``layer`` (``attends``)."""

    def on_layer(self, layer: int, rows: list[int], pos: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        """The free-running rows of one layer of a decode step (``sees_layers``)."""

    def on_chunk(self, layer: int, rows: list[int], pos: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        """One layer of a question's chunk fed after compression (``sees_chunks``)."""

    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None:
        """After a step's forward: the running runs ``rows`` and their logits [R, V]."""

    def on_forced(self, step: int, token: int, exact_logits: Tensor, forced: dict[int, Tensor]) -> None:
        """After a step: the exact run's token and logits [V], each run's logits fed it (``teacher_forced``)."""

    def finish(self, runs: list[RunResult]) -> None:
        """The runs have ended: write the measurements into their results."""


class ProbeRouter(Probe):
    """The ``on_step`` of several questions' rows decoded as one batch, split back to each question's
    own probes (with the run indices of that question). ``parts``: per question, its number of runs
    and its probes, in batch order."""

    def __init__(self, parts: list[tuple[int, list[Probe]]]):
        self.parts: list[tuple[int, int, list[Probe]]] = []
        offset = 0
        for n, probes in parts:
            self.parts.append((offset, n, probes))
            offset += n

    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None:
        for offset, n, probes in self.parts:
            mine = [k for k, i in enumerate(rows) if offset <= i < offset + n]
            if mine:
                local = [rows[k] - offset for k in mine]
                for p in probes:
                    p.on_step(step, local, logits[mine])


class RowObserver:
    """Maps batch rows (active runs only) back to run indices for a probe's ``on_attend``."""

    def __init__(self, probe: Probe, active: list[int]):
        self.probe, self.active = probe, active

    def on_attend(self, layer: int, row: int, q: Tensor, out: Tensor) -> None:
        if row < len(self.active) and not faults.failed(row):  # teacher-forced rows come after the free ones
            self.probe.on_attend(layer, self.active[row], q, out)


class LayerObserver:
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


__all__ = ["LayerObserver", "Probe", "ProbeRouter", "RowObserver"]
