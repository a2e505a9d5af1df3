"""Reference paths the tests compare the engine's fast paths against (not used by the product).

* ``stepwise_questions``: a question asked after compression is fed one decode step per token
  (``rows.feed_stepwise``) instead of in one chunked forward, the path the chunk must equal;
* ``per_row_attention``: every row of a decode step attends alone (``comp.attend``), the path the
  batched ``attend_many`` calls must equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from torch import Tensor

from kvlab.core.model import LoadedModel
from kvlab.engine import faults, questions
from kvlab.engine.attention import LockstepDecode
from kvlab.engine.probe import Probe
from kvlab.engine.rows import feed_stepwise
from kvlab.methods import Compressor


def _stepwise(lm: LoadedModel, comps: list[Compressor], probes: list[Probe], seen: int, ids: list[int]) -> Tensor:
    return feed_stepwise(lm, comps, seen, ids)  # the decode path calls no ``on_chunk``


@contextlib.contextmanager
def stepwise_questions() -> Iterator[None]:
    """While open, questions asked after compression go through the decode path one token at a time."""
    with mock.patch.object(questions, "feed_chunk", _stepwise):
        yield


def _per_row(self: LockstepDecode, layer: int, query: Tensor) -> list[Tensor]:
    return [faults.attend(row, comp, layer, query[row]) for row, comp in enumerate(self.compressors)]


@contextlib.contextmanager
def per_row_attention() -> Iterator[None]:
    """While open, every row of a lockstep decode step attends through its own ``comp.attend`` (no
    ``attend_many`` call for the rows of one class), the path the batched calls must equal."""
    with mock.patch.object(LockstepDecode, "row_outputs", _per_row):
        yield
