"""One batched forward through the compressors: row i of the batch feeds its tokens at its own true
positions, and the attention handler routes each row's attention through that row's compressor.

Every path that runs the model on compressed caches goes through ``forward_rows``: a lockstep
decode step (one token per row, ``attention.LockstepDecode``), a question fed after compression (a
chunk per row, ``attention.LockstepChunk``) and the token-by-token reference path (``feed_stepwise``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.core.model import LoadedModel
from kvlab.engine import attention as attn
from kvlab.engine.batched_attention import RowAttention, attend_rows
from kvlab.engine.cache import RoutedCache
from kvlab.engine.few_rows import few_row_linears
from kvlab.methods import Compressor


@dataclass(frozen=True)
class DecodePaths:
    """Which of two paths that give the same results the engine takes (the defaults are the fast ones;
    the others are the references tests compare them against, and benchmarks time).

    ``row_attention``: how a decode step's rows attend (``batched_attention.attend_rows``: the rows of
    a class with ``attend_many`` in one call; ``attend_each``: every row alone; or a schedule of
    one's own with the same signature). ``chunked_questions``: a question asked after compression is
    fed through every cache in one chunked forward (False: one decode step per token, ``feed_stepwise``).
    """

    row_attention: RowAttention = attend_rows
    chunked_questions: bool = True


FAST = DecodePaths()  # the default: the batched rows, the chunked question


def forward_rows(lm: LoadedModel, handler: object, ids: list[list[int]], first: int | Sequence[int]) -> Tensor:
    """The model's forward over B rows of c new tokens each: row i's tokens ``ids[i]`` sit at true
    positions first[i] .. first[i] + c - 1 (``first`` an int: the same for every row), causal inside
    the chunk. ``handler`` (an ``attention`` handler) routes every layer's attention. Returns the
    logits after each row's last token, [B, V]."""
    model, dev = lm.model, lm.device
    b, c = len(ids), len(ids[0])
    starts = [first] * b if isinstance(first, int) else list(first)
    positions = torch.tensor(starts, device=dev).unsqueeze(-1) + torch.arange(c, device=dev)
    cache = RoutedCache(lm.info.n_layers, max(starts, default=0))
    with attn.active(model, handler), few_row_linears(b * c, dev):
        out = model(
            input_ids=torch.tensor(ids, device=dev),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[:, -1]


@torch.inference_mode()
def feed_stepwise(lm: LoadedModel, comps: list[Compressor], seen: int, ids: list[int]) -> Tensor:
    """Tokens through the decode path, one forward per token: logits [B, V] after the last.

    Row i feeds ``ids`` through ``comps[i]`` at true positions seen..seen+c-1 (no probes): the path a
    chunked feed (``questions.feed_chunk``) must equal.
    """
    b = len(comps)
    for i, t in enumerate(ids):
        out = forward_rows(lm, attn.LockstepDecode(comps, [seen + i] * b), [[t]] * b, seen + i)
    return out


__all__ = ["FAST", "DecodePaths", "feed_stepwise", "forward_rows"]
