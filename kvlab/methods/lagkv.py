"""LagKV: each partition of the prompt scored against the next one, with no attention at all.

Liang, Zhang, Li, Li. "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important", 2025, https://arxiv.org/abs/2504.04704 — as kvpress 0.5.5 implements it
(``LagKVPress``). Per layer and KV head, after the first ``n_sink`` tokens the prompt is cut into
partitions of ``lag_size`` tokens; the last whole partition and the remainder after it form the
tail. Each other partition is scored against the one after it (its "lag" reference):

1. keys and values are min-max normalised per channel by the reference partition's range,
   (x - min_ref) / (max_ref - min_ref);
2. each token's score is the softmax, over its partition, of the standard deviation of its
   normalised channels, for the keys and for the values, averaged: a token whose key and value
   stand out against what follows is informative;
3. each partition's tokens are ranked by it; the score kept is the rank / ``lag_size`` (so every
   partition offers the same scores and the top-k takes about the same share of each, the paper's
   per-partition top-k). The sinks and the tail get 1 (always kept).

A prompt shorter than ``n_sink + 2 x lag_size`` has no partition with a reference: its scores then
rise with the position after the sinks, so the sinks and the most recent tokens are kept.

Defaults are kvpress's (4 sinks, lags of 128). ``cross_scoring`` keeps the raw score (step 2)
instead of the rank, so that scores compare across heads (kvpress offers it for ``AdaKVPress``;
``ada-lagkv`` here).

Deviations from kvpress:

* When the capacity is smaller than the sinks and the tail together (up to
  ``n_sink + 2 lag_size - 1`` tokens, all of score 1), kvpress's top-k picks among equal scores, an
  arbitrary subset (on the embedded model, a 629-token prompt at budget 0.25 then generated
  "TheTheThe..."); kvlab keeps the sinks and, after them, the most recent tokens. With room for
  them all, the scores are kvpress's.
* A channel constant over the reference partition (max = min) divides by zero there (a NaN
  score); here its range counts as 1.

Scores are computed on the cached (post-RoPE) keys in float32, as kvpress on a float32 model. The
paper also compresses while decoding, one partition at a time; here, as in kvpress, only the
prompt is compressed and generated tokens are all kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored


def lag_scores(parts: Tensor) -> Tensor:
    """parts [.., P, lag, d] (P >= 2 consecutive partitions) -> [.., P - 1, lag]: each of the first P - 1
    partitions' tokens scored against the next partition (softmax over the partition of the standard
    deviation of the channels min-max normalised by the next partition's range)."""
    ref, cur = parts[..., 1:, :, :], parts[..., :-1, :, :]
    low, high = ref.amin(-2, keepdim=True), ref.amax(-2, keepdim=True)
    span = high - low
    span = torch.where(span > 0, span, torch.ones_like(span))
    return ((cur - low) / span).std(-1).softmax(-1)


def tail_start(n: int, n_sink: int, lag: int) -> int:
    """Where the always-kept tail of an ``n``-token prompt begins: the last whole partition (``n`` when no
    partition has a reference)."""
    if n < n_sink + 2 * lag:
        return n
    return n_sink + ((n - n_sink) // lag - 1) * lag


def lagkv_scores(keys: Tensor, values: Tensor, n_sink: int, lag: int, cross: bool) -> Tensor:
    """keys [.., n, d], values [.., n, dv] (float32) -> LagKV's scores [.., n] (module docstring)."""
    n = keys.shape[-2]
    lead = keys.shape[:-2]
    if n < n_sink + 2 * lag:  # no partition has a reference: the sinks, then the position
        score = torch.ones(*lead, n, dtype=keys.dtype, device=keys.device)
        if n > n_sink:
            score[..., n_sink:] = torch.arange(n - n_sink, device=keys.device) / (n - n_sink)
        return score
    end = n_sink + ((n - n_sink) // lag) * lag
    k_parts = keys[..., n_sink:end, :].reshape(*lead, -1, lag, keys.shape[-1])
    v_parts = values[..., n_sink:end, :].reshape(*lead, -1, lag, values.shape[-1])
    score = (lag_scores(k_parts) + lag_scores(v_parts)) / 2  # [.., P - 1, lag], in [0, 1]
    if not cross:
        score = (score.argsort(-1).argsort(-1) / lag).to(keys.dtype)
    sink = torch.ones(*lead, n_sink, dtype=score.dtype, device=score.device)
    tail = torch.ones(*lead, lag + n - end, dtype=score.dtype, device=score.device)
    return torch.cat([sink, score.reshape(*lead, -1), tail], -1)


class LagKV(PromptScored):
    name = "lagkv"
    title = "LagKV"
    group = "recent"
    paper = (
        "Liang, Zhang, Li, Li, LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are "
        "Important, 2025 (arXiv:2504.04704)"
    )
    summary = (
        "Keeps, in each partition of 128 prompt tokens, the tokens whose keys and values vary most against the "
        "next partition's range, plus the first 4 and the last partition."
    )
    params = (
        Param("n_sink", 4, "first prompt tokens always kept", minimum=0),
        Param("lag_size", 128, "tokens per partition; each is scored against the next", minimum=1),
        Param("cross_scoring", False, "keep the raw scores instead of ranks within each partition"),
    )

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: LagKV's score of every prompt token (the sinks and the tail: 1). When the capacity holds
        fewer tokens than score 1, the sinks score 3 and the others of score 1 rise with their position in (1, 2):
        the sinks, then the most recent tokens, are kept."""
        c = self.cfg
        scores = lagkv_scores(
            state.keys.float(), state.values.float(), int(c["n_sink"]), int(c["lag_size"]), bool(c["cross_scoring"])
        )
        n, sink = state.n_tokens, min(int(c["n_sink"]), state.n_tokens)
        tail = tail_start(n, sink, int(c["lag_size"]))
        if self.capacity >= sink + n - tail:
            return scores
        pos = torch.arange(n, device=scores.device)
        ramp = torch.where(pos >= tail, 1 + pos / n, scores)
        return torch.where(pos < sink, 3.0, ramp)
