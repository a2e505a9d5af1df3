"""Teacher forcing: the exact run's tokens fed to copies of the runs that left them, for the probes
that measure fidelity along the exact continuation (``Probe.teacher_forced``)."""

from __future__ import annotations

import copy

from torch import Tensor

from kvlab.engine.probe import Probe
from kvlab.methods import Compressor


class TeacherForcing:
    """Runs fed the exact run's tokens, for teacher-forced fidelity at little extra cost.

    While a run's tokens equal the exact run's, its free-running row *is* the teacher-forced row.
    When it first picks a different token (or stops), its compressor (which has seen only the
    shared tokens so far) is copied and the copy is fed the exact tokens as an extra batch row.
    """

    def __init__(self, exact: int | None, probes: list[Probe]):
        self.exact, self.probes = exact, probes
        self.on = exact is not None and bool(probes)
        self.aligned: set[int] = set()
        self.forked: dict[int, Compressor] = {}
        self.batch: list[int] = []
        self.started = False

    def after_pick(self, tokens: list[list[int]], comps: list[Compressor], active: list[int]) -> None:
        """Update after tokens were picked; ``active`` are the runs that decode on."""
        if not self.on or self.exact is None:
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
        if not self.on or self.exact is None:
            return []
        return [tokens[self.exact][-1]] * len(self.forked)

    def report(self, step: int, tokens: list[list[int]], active: list[int], logits: Tensor) -> None:
        """``logits`` [B, V]: the free rows (``active``), then the forked rows in order."""
        if not self.on or self.exact is None:
            return
        row = {i: r for r, i in enumerate(active)}
        forced = {i: logits[row[i]] for i in self.aligned | {self.exact} if i in row}
        forced.update({i: logits[len(active) + j] for j, i in enumerate(self.batch) if i in self.forked})
        for p in self.probes:
            p.on_forced(step, tokens[self.exact][-1], logits[row[self.exact]], forced)


__all__ = ["TeacherForcing"]
