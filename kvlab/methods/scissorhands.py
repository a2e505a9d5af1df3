"""Scissorhands: a budgeted KV cache that drops the tokens most often found unimportant.

Liu, Desai, Liao, Wang, Xie, Xu, Kyrillidis, Shrivastava. "Scissorhands: Exploiting the
Persistence of Importance Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023,
https://arxiv.org/abs/2305.17118 — Algorithm 1 (inference with a budget KV cache) and Algorithm 2
(compress the KV cache), Sec. 4.1. Per layer and KV head the cache holds at most ``B`` tokens.
Each token has an importance record: how many of the last ``w`` queries (the history window) gave
it an attention score below 1/t, t being the query's generation step, i.e. its position + 1
(Algorithm 2; ``threshold="cache"`` uses 1/(tokens in the compressed cache) instead). When the
cache grows past ``B``, the ``m`` tokens with the highest record are dropped (the paper uses
m = 0.5 B); the last ``r`` tokens are never dropped. The record is kept up to date during
generation (the paper's "maintain the importance record during generation steps" option), so no
query needs to be stored or re-run.

kvlab specifics:

* Window bookkeeping: a query counts towards the next compression only if it is among the last
  ``w`` queries before it (the schedule is known: compressions happen when the cache reaches
  B + 1). Records are reset after each decoding compression, so while decoding the effective
  window is min(w, m) (the defaults give w = m). At prefill the last ``w`` prompt queries rank the
  prompt tokens; those of them that also fall in the window of the first decoding compression
  seed the records.
* The prefill compression drops max(m, n - B) tokens, so a long prompt lands exactly on B.
* Grouped-query attention: the attention of the query heads of a KV group is averaged before the
  1/t test. Budgets are spread evenly over heads, and by default over layers; ``layer_ramp`` > 0
  gives later layers more (Sec. 4.1, "Allocating Budgets Across Attention Heads": more budget to
  later layers, whose persistence ratio is lower, Fig. 2): layer l gets B (1 - ramp) .. B (1 + ramp)
  on a straight line, the same total. The paper gives no numbers for its allocation.
* ``prompt="window"`` (default) compresses the prompt once, ranking its tokens by the last ``w``
  prompt queries; ``prompt="token"`` runs Algorithm 1 over the prompt as the paper states it: the
  cache starts empty and grows one token at a time, each query updates the records and the cache
  is compressed (Algorithm 2) whenever it passes B (it needs every prompt query).
* Records are int16, one per kept token, and count towards the bytes and the budget.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.core import cancel
from kvlab.core.attention_ops import causal_window_probs, pool_heads
from kvlab.methods.dense import DenseLayer
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.pyramidkv import pyramid_budgets
from kvlab.methods.scored import ScoredEvictionCompressor

_PROBS_CHUNK_BYTES = 4 * 2**20  # one chunk of prefill window attention, small enough to stay in cache


class Scissorhands(ScoredEvictionCompressor):
    name = "scissorhands"
    title = "Scissorhands"
    group = "paper"
    paper = (
        "Liu et al., Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache "
        "Compression at Test Time, NeurIPS 2023 (arXiv:2305.17118)"
    )
    summary = (
        "Counts how often each token's attention falls below 1/t over a history window; "
        "drops the most often unimportant."
    )
    score_dtype = torch.int16
    evict_highest = True
    reset_after_eviction = True
    counted: _PrefillRecords | None = None  # the records the last prefill counted (its ``prefill_needs`` observer)
    params = (
        Param("B", None, "token budget per layer and KV head (empty: from the memory budget)", minimum=1, kind=int),
        Param("m_ratio", 0.5, "drop amount m as a fraction of B (paper: 0.5)", minimum=0.0, maximum=1.0),
        Param("w_ratio", 0.5, "history window w as a fraction of B (public port: 0.5)", minimum=0.0, maximum=1.0),
        Param("r_ratio", 0.25, "recent window r as a fraction of B (public port: 0.25)", minimum=0.0, maximum=1.0),
        Param(
            "layer_ramp",
            0.0,
            "per-layer budgets: layer l of L gets B (1 + ramp (2 l / (L - 1) - 1)), later layers more "
            "(Sec. 4.1); 0: even",
            minimum=0.0,
            maximum=0.9,
        ),
        Param(
            "prompt",
            "window",
            "the prompt: compressed once, ranked by the last w queries (window), or run token by token "
            "through Algorithm 1 (token)",
            choices=("window", "token"),
        ),
        Param(
            "threshold",
            "position",
            "'low attention' is below 1/t with t the query's position + 1 (Algorithm 2) or the cache size",
            choices=("position", "cache"),
        ),
    )

    # ----- knobs --------------------------------------------------------------------------
    def plan_tokens(self, n_prompt: int) -> dict:
        cfg = self.cfg
        self.set_full(self.is_full and cfg["B"] is None)
        self.capacity = B = int(cfg["B"]) if cfg["B"] is not None else self.tokens_for_budget(n_prompt)
        if B < 1:
            raise ValueError(f"scissorhands: B={B} must be at least 1")
        self.m = max(1, round(cfg["m_ratio"] * B))
        self.w = max(1, round(cfg["w_ratio"] * B))
        self.recent = min(round(cfg["r_ratio"] * B), B - self.m)  # leave room to drop m at B + 1
        n_after = n_prompt - max(self.m, n_prompt - B) if n_prompt > B else n_prompt
        self.token_prompt = cfg["prompt"] == "token"
        self.prompt_window = n_prompt if self.token_prompt else min(n_prompt, self.w)
        self.carry_window = max(0, min(self.prompt_window, self.w - (B - n_after)))
        knobs = {"B": B, "m": self.m, "w": self.w, "r": self.recent, "w_decode": min(self.w, self.m)}
        self.per_layer = None
        n_layers = self.info.n_layers
        caps = None
        if cfg["layer_ramp"] > 0 and not self.full:
            caps = pyramid_budgets(n_layers * B, n_layers, 1.0 / (1.0 - cfg["layer_ramp"]), 1 << 30)[::-1]
            caps = [max(2, c) for c in caps]
        elif self.sem.has_local and not self.full and cfg["B"] is None:
            caps = self.spread_capacity(n_prompt, B)
        if caps is not None:
            ms = [max(1, round(cfg["m_ratio"] * c)) for c in caps]
            self.per_layer = {
                "B": caps,
                "m": ms,
                "w": [max(1, round(cfg["w_ratio"] * c)) for c in caps],
                "r": [min(round(cfg["r_ratio"] * c), c - m) for c, m in zip(caps, ms)],
            }
            knobs["layer_B"] = caps
        return {**knobs, "prompt": "token"} if self.token_prompt else knobs

    def planned_tokens(self, n_prompt: int) -> int:
        """Mean kept tokens per layer (per-layer budgets sum to L x B, each capped by the prompt and by what a
        local layer's queries see over the horizon, ``reach``)."""
        if self.per_layer is None:
            return super().planned_tokens(n_prompt)
        caps = enumerate(self.per_layer["B"])
        return sum(min(self.reach(i, n_prompt), c) for i, c in caps) / self.info.n_layers

    def layer_capacity(self, layer: int) -> int:
        return self.capacity if self.per_layer is None else self.per_layer["B"][layer]

    def drop_size(self, capacity: int) -> int:
        """m of a layer of budget ``capacity`` (B): an append past B drops m tokens at once."""
        return max(1, round(self.cfg["m_ratio"] * capacity))

    def layer_recent(self, layer: int) -> int:
        return self.recent if self.per_layer is None else self.per_layer["r"][layer]

    def _layer(self, key: str, layer: int) -> int:
        own = {"m": self.m, "w": self.w}
        return own[key] if self.per_layer is None else self.per_layer[key][layer]

    def _drop(self, n: int, layer: int = 0) -> int:
        cap = self.layer_capacity(layer)
        return max(self._layer("m", layer), n - cap) if n > cap else 0

    def prefill_drop(self, n: int, layer: int = 0) -> int:
        return 0 if self.full else self._drop(n, layer)

    def decode_drop(self, n: int, layer: int = 0) -> int:
        return self._drop(n, layer)

    def compress_tokens(self, state: PrefillState) -> None:
        """``prompt="token"``: Algorithm 1 over the prompt (an empty cache fed every prompt token, its
        query attending and updating the records, compressed whenever it passes B); else the default."""
        if self.full or not self.token_prompt:
            return super().compress_tokens(state)
        n_layers, hkv, _, d = state.keys.shape
        dev = state.keys.device
        self.layers = [
            DenseLayer.make(
                torch.empty(hkv, 0, d, dtype=self.cache_dtype, device=dev),
                torch.empty(hkv, 0, d, dtype=self.cache_dtype, device=dev),
                torch.empty(hkv, 0, dtype=torch.int32, device=dev),
            )
            for _ in range(n_layers)
        ]
        self.scores = [torch.zeros(hkv, 0, dtype=self.score_dtype, device=dev) for _ in range(n_layers)]
        queries = state.queries[:, :, -state.n_tokens :]
        for layer in range(n_layers):
            self.feed(layer, queries[layer], self.as_cached(state.keys[layer]), self.as_cached(state.values[layer]), 0)

    # ----- importance records -------------------------------------------------------------
    def low_score_flags(self, probs: Tensor, first_pos: int, n_kv_heads: int | None = None) -> Tensor:
        """Which visible tokens each query scored below 1/t: probs [.., Hq, w, n] of queries at
        positions first_pos .. first_pos + w - 1 (causal) -> bool [.., Hkv, w, n] (Hkv defaults to
        the model's; pass 1 for the query heads of a single KV group)."""
        pooled = pool_heads(probs, n_kv_heads or self.info.n_kv_heads, head_dim=-3, reduce="mean")
        w, n = pooled.shape[-2:]
        qpos = torch.arange(first_pos, first_pos + w, device=probs.device).unsqueeze(-1)
        visible = torch.arange(n, device=probs.device).unsqueeze(0) <= qpos
        return (pooled < 1.0 / (qpos + 1).to(pooled.dtype)) & visible

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        """The last ``prompt_window`` prompt queries, and (``prompt="window"``) an observer that counts the
        records while the prefill attends them (``initial_scores`` then reads them instead of recounting)."""
        if self.full:
            return PrefillNeeds()
        if not self.prompt_window or self.token_prompt:
            return PrefillNeeds(query_window=self.prompt_window)
        self.counted = _PrefillRecords(self, n_prompt)
        return PrefillNeeds(query_window=self.prompt_window, observer=self.counted)

    def initial_scores(self, state: PrefillState) -> tuple[Tensor, Tensor]:
        """Records over the last ``prompt_window`` prompt queries (rank) and over the last
        ``carry_window`` of them (carried into decoding), each [L, Hkv, n] int32.

        Counted during the prefill when it ran with this method's ``prefill_needs`` observer (the
        engine's does). Otherwise computed here, the reference: per (layer, KV head) stream and block of
        window queries, a block's [g, rows, n] attention at most ``_PROBS_CHUNK_BYTES`` (small
        enough to stay in cache): several streams per block when the whole window fits, else a few
        query rows of one stream at a time (a window of thousands of queries never makes a [g, w, n]
        temporary).
        """
        counted, self.counted = self.counted, None
        records = None if counted is None else counted.records(state.n_tokens)
        if records is not None:
            return records
        w, n, carry = self.prompt_window, state.n_tokens, self.carry_window
        n_layers, hkv, _, d = state.keys.shape
        g = self.info.n_heads // hkv
        queries = state.queries[:, :, state.queries.shape[-2] - w :].reshape(n_layers * hkv, g, w, d)
        keys = state.keys.reshape(n_layers * hkv, 1, n, d)
        row_bytes = g * n * 4
        rows = max(1, min(w, _PROBS_CHUNK_BYTES // row_bytes))  # query rows per block
        step = max(1, _PROBS_CHUNK_BYTES // (row_bytes * w)) if rows == w else 1  # streams per block
        rank = torch.zeros(n_layers * hkv, n, dtype=torch.int32)
        kept = rank if carry == w else torch.zeros_like(rank)
        for a in range(0, n_layers * hkv, step):
            cancel.checkpoint()
            for r in range(0, w, rows):
                q = queries[a : a + step, :, r : r + rows]  # queries at positions n - w + r ...
                probs = causal_window_probs(q, keys[a : a + step, :, : n - w + r + q.shape[-2]], state.scaling)
                flags = self.low_score_flags(probs, n - w + r, n_kv_heads=1)[:, 0]  # [S, rows, n']
                m = flags.shape[-1]
                rank[a : a + step, :m] += flags.sum(-2, dtype=torch.int32)
                if kept is not rank and r + q.shape[-2] > w - carry:
                    lo = max(0, w - carry - r)  # the block's rows inside the carried window
                    kept[a : a + step, :m] += flags[..., lo:, :].sum(-2, dtype=torch.int32)
        return rank.view(n_layers, hkv, n), kept.view(n_layers, hkv, n)

    def threshold(self, n_cache: int) -> float:
        """The "low attention" bound of this step's query: 1/t, t = position + 1 (or the cache size)."""
        return 1.0 / (self.position + 1 if self.cfg["threshold"] == "position" else n_cache)

    def observe(self, layer: int, attn: Tensor) -> None:
        """Count this step's low scores if the query is within the window of the next compression."""
        n = attn.shape[-1]  # tokens this query attended; the next compression comes B - n queries later
        if n > self.layer_capacity(layer) - self._layer("w", layer):
            self.scores[layer] += (attn < self.threshold(n)).to(self.score_dtype)


class _PrefillRecords:
    """``Scissorhands.initial_scores`` counted from the prefill's own attention of the last
    ``prompt_window`` queries (``attention.PrefillCapture`` hands it each block of rows)."""

    def __init__(self, comp: Scissorhands, n: int):
        self.comp, self.n, self.rows = comp, n, comp.prompt_window
        self.rank: Tensor | None = None  # [L, Hkv, n] int32, made on the device of the first block
        self.kept: Tensor | None = None
        self.seen = [0] * comp.info.n_layers  # query rows counted per layer
        self.failed = False

    def __call__(self, layer: int, probs: Tensor, first_pos: int) -> None:
        """probs [Hq, r, e] of the queries at first_pos.. over keys 0..e-1."""
        try:
            rank, kept = self.rank, self.kept
            if rank is None or kept is None:
                info = self.comp.info
                rank = torch.zeros(info.n_layers, info.n_kv_heads, self.n, dtype=torch.int32, device=probs.device)
                kept = rank if self.comp.carry_window == self.rows else torch.zeros_like(rank)
                self.rank, self.kept = rank, kept
            flags = self.comp.low_score_flags(probs, first_pos)  # [Hkv, r, e]
            e = flags.shape[-1]
            rank[layer, :, :e] += flags.sum(-2, dtype=torch.int32)
            lo = max(0, self.n - self.comp.carry_window - first_pos)  # the rows inside the carried window
            if kept is not rank and lo < flags.shape[-2]:
                kept[layer, :, :e] += flags[:, lo:].sum(-2, dtype=torch.int32)
            self.seen[layer] += flags.shape[-2]
        except Exception:  # the reference path in initial_scores recounts (and raises there, isolated)
            self.failed = True

    def complete(self, n: int) -> bool:
        return not self.failed and n == self.n and all(r == self.rows for r in self.seen)

    def records(self, n: int) -> tuple[Tensor, Tensor] | None:
        """(rank, kept) when every row of the ``n``-token prefill was counted, else None."""
        if self.rank is None or self.kept is None or not self.complete(n):
            return None
        return self.rank, self.kept
