"""KVzip: KV pairs scored by how much the model needs them to reconstruct its context.

Kim, Kim, Kwon, Lee, Yun, Song. "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", NeurIPS 2025, https://arxiv.org/abs/2505.23416 (code: github.com/snu-mllab/KVzip).

Sec. 3.2: after the prefill, the model reads a reconstruction input, the repeat prompt followed by
the context itself (teacher-forced), over the exact cache. A context KV pair's score is the largest
attention it receives from the reconstruction's queries: per layer and KV head, the max over the
query heads of its group and over the reconstruction tokens. Query-agnostic: the question never
takes part. Sec. 3.3 (long contexts): the context is cut into chunks of m = 2K tokens (2000 in the
authors' code), one extra forward each; chunk i > 0 asks to repeat the context "starting with"
the previous chunk's last 8 tokens; each chunk scores only its own pairs, with the softmax
normalised over the template prefix, the chunk and the reconstruction's own keys (causal).
Eviction: the lowest scores go first, ranked in one list over every layer and KV head (the paper's
non-uniform head budgets, its default), so each (layer, KV head) keeps its own number of pairs;
``allocation=uniform`` keeps the same number in every one (the paper's uniform variant).
Prefill-only: the question's and generated tokens are all kept. Extra cost: one forward over the
reconstruction input, about the prompt's length again (the paper's "2x prefill"), once per prompt:
the budgets of one comparison share its scores.

How the ragged counts are held: each KV head of each layer is its own one-head dense store (K, V
and an int32 position per kept pair), so the bytes are exactly the kept pairs', with no padding;
that head's query group attends over it alone.

Deviations from the paper and the authors' code:

* The template prefix (the chat template before the user's text, ``chat_wrap``'s opening, when the
  prompt starts with it: system prompt, user header) is not reconstructed but is among every
  chunk's keys, as the authors' system prompt is. As in the authors' code (``EvictCache``: the
  pairs before the context are always valid), it is never evicted (``keep_template``, default on;
  off: its pairs are scored like the context's, their largest probability over all chunks, and
  compete for the budget). The authors' ratio leaves the system prompt's bytes out; kvlab's budget
  counts the whole cache, so the prefix is paid for from the same budget and the context keeps
  that much less. kvpress keeps 4 sink tokens. A prompt outside the chat template gets no
  template tokens in its reconstruction input (and has no prefix to keep).
* What is reconstructed is the whole compressed prompt after that prefix: in the query-aware
  protocol the question, the end of the user turn and the answer prefix are part of it.
* The reconstruction input is the repeat prompt, then the template's end of user turn and
  assistant marker (``chat_wrap``'s closing, empty without a template), then the chunk, as in the
  authors' code; it continues the prompt's open turn (the authors' prompts always end in the
  context, kvlab's query-aware ones end in the answer prefix).
* Scores are computed in float32 (the authors' softmax runs in the model's 16-bit dtype); the global
  ranking keeps exactly the budget's number of pairs (``topk``; the authors keep those strictly
  above a threshold, fewer when scores tie).
* On a sliding-window layer a pair is scored with the layer's window (a query sees only keys
  inside it) and the store keeps only its window, as every kvlab cache does; kvpress skips such
  layers.
* A prompt within ``chunk`` tokens of the model's context length is reconstructed in smaller chunks,
  so that prompt + reconstruction input fit in the model's positions.
* The head-level variant (one score per head, DuoAttention-style) and the context-independent
  variant (scores loaded per model) are not implemented.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.attention_ops import on_positions, pool_heads
from kvlab.core.semantics import LayerSemantics, ModelSemantics
from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor, DenseLayer
from kvlab.methods.handover import ModelAccess, PrefillNeeds, PrefillState
from kvlab.methods.params import Param

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
CARRY = 8  # tokens of the previous chunk quoted after REPEAT_NEXT
QUERY_BLOCK = 256  # reconstruction queries scored at a time (memory O(block x keys))
# one prefill's model access -> chunk size -> its reconstruction scores [L, Hkv, n] (gone with the prefill)
SCORED: weakref.WeakKeyDictionary[ModelAccess, dict[int, Tensor]] = weakref.WeakKeyDictionary()


def template(model: ModelAccess) -> tuple[list[int], list[int]]:
    """The chat template's (opening, closing) ids around a user turn, when the prompt is in it (it
    starts with the opening: system prompt, user header); else ([], [])."""
    opening, closing = model.chat_wrap("Hello")
    if not opening or list(model.prompt_ids[: len(opening)]) != list(opening):
        return [], []
    return list(opening), list(closing)


def reconstruction_inputs(
    model: ModelAccess, first: int, size: int, closing: list[int]
) -> list[tuple[int, int, list[int]]]:
    """(start, end, ids) per chunk of the context ``prompt_ids[first:]``: the chunk is positions
    start..end-1, ``ids`` the reconstruction input (repeat prompt, ``closing``: the template's end
    of user turn and assistant marker, the chunk's tokens)."""
    ids = list(model.prompt_ids)
    out = []
    for start in range(first, len(ids), size):
        end = min(len(ids), start + size)
        if start == first:
            ask = model.encode(REPEAT_FIRST)
        else:  # "starting with" the previous chunk's last tokens
            ask = model.encode(REPEAT_NEXT) + ids[max(first, start - CARRY) : start]
        out.append((start, end, ask + closing + ids[start:end]))
    return out


def chunk_scores(q: Tensor, k: Tensor, sem: LayerSemantics, sink: int, start: int, end: int, n_kv_heads: int) -> Tensor:
    """KVzip scores, in one layer, of the pairs 0..sink-1 (the template prefix) then start..end-1 (the
    chunk): [Hkv, sink + end - start].

    q: [Hq, c, d] the reconstruction queries at positions n..n+c-1; k: [Hkv, n + c, d] (post-RoPE).
    Each query's softmax runs over the keys 0..sink-1, start..end-1 and n..its own position (and
    inside the layer's window); a pair's score is its largest probability over the queries and the
    query heads of its KV group.
    """
    c, total = q.shape[-2], k.shape[-2]
    n, m = total - c, sink + end - start  # m: the pairs scored, before the reconstruction's own keys
    dev = k.device
    kpos = torch.cat(
        [torch.arange(sink, device=dev), torch.arange(start, end, device=dev), torch.arange(n, total, device=dev)]
    )
    keys = k[:, kpos].float()
    best = torch.zeros(q.shape[0], m, device=dev)
    for s in range(0, c, QUERY_BLOCK):
        e = min(c, s + QUERY_BLOCK)
        if sem.is_local:  # causality and the window, by position
            x = sm.logits(q[:, s:e].float(), keys, sem)  # [Hq, b, m + c]
            bias = sm.window_bias(sem, torch.arange(n + s, n + e, device=dev), kpos)
            x = x if bias is None else x + bias
        else:  # the block's queries are the last e - s of the keys up to its own: causal over those
            x = sm.mask_future(sm.logits(q[:, s:e].float(), keys[:, : m + e], sem), e - s)  # [Hq, b, m + e]
        best = torch.maximum(best, sm.softmax(x, sem)[..., :m].amax(-2))
    return pool_heads(best, n_kv_heads, head_dim=-2, reduce="max")


def reconstruction_scores(
    model: ModelAccess, semantics: ModelSemantics, n_kv_heads: int, chunk: int, max_positions: int
) -> Tensor:
    """KVzip scores of every prompt pair: [L, Hkv, n] float32 (higher = keep).

    The context after the template prefix (``template``'s opening) is reconstructed chunk by chunk
    (``reconstruction_inputs``, one ``extend`` each) and scored by ``chunk_scores``; the prefix,
    among every chunk's keys, gets its largest score over the chunks. Chunks shrink so that prompt
    + reconstruction input fit in ``max_positions`` (the caller's: the model's context, or a RoPE switch the
    prompt ends before).
    """
    n = len(model.prompt_ids)
    opening, closing = template(model)
    sink = len(opening)
    room = max_positions - n - len(model.encode(REPEAT_NEXT)) - CARRY - len(closing)
    if room < 1 and n > sink:
        raise ValueError(
            f"kvzip: a prompt of {n} tokens leaves no room for its reconstruction in the {max_positions} tokens "
            "it may reach (the model's context, or the length where its RoPE switches factors)"
        )
    scores = torch.zeros(len(semantics), n_kv_heads, n)
    for start, end, ids in reconstruction_inputs(model, sink, min(chunk, room), closing):

        def observe(layer: int, q: Tensor, k: Tensor, start: int = start, end: int = end) -> None:
            s = chunk_scores(q, k, semantics[layer], sink, start, end, n_kv_heads).to(scores.device)
            scores[layer, :, :sink] = torch.maximum(scores[layer, :, :sink], s[:, :sink])
            scores[layer, :, start:end] = s[:, sink:]

        model.extend(ids, observe)
    return scores


def keep_mask(scores: Tensor, per_head: int, allocation: str) -> Tensor:
    """[L, Hkv, n] bool: the L x Hkv x ``per_head`` best pairs over all layers and heads (``global``), or
    the ``per_head`` best of each layer and head (``uniform``)."""
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if allocation == "uniform":
        return keep.scatter_(-1, scores.topk(per_head, dim=-1).indices, True)
    flat = keep.view(-1)
    flat[scores.reshape(-1).topk(per_head * scores.shape[0] * scores.shape[1]).indices] = True
    return keep


def head_semantics(sem: LayerSemantics, head: int, group: int) -> LayerSemantics:
    """The layer's semantics for KV head ``head``'s query group alone (its sinks sliced)."""
    if sem.sinks is None:
        return sem
    return dataclasses.replace(sem, sinks=sem.sinks[head * group : (head + 1) * group])


def keep_from(store: DenseLayer, first: int) -> None:
    """Drop a one-head store's pairs before position ``first`` (a sliding window moving on)."""
    pos = store.views()[2]
    if pos.numel() and int(pos.min()) < first:
        store.keep(torch.nonzero(pos[0] >= first).view(1, -1))


class KVzip(DenseCompressor):
    name = "kvzip"
    plain_feed = False  # its own append (and attend)
    title = "KVzip"
    group = "recent"
    paper = (
        "Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, "
        "NeurIPS 2025 (arXiv:2505.23416)"
    )
    summary = "Keeps the pairs the model attends to most while repeating its context (one list over all heads)."
    no_composition = (
        "KVzip keeps a different number of pairs per head; a composition stores every head of a layer alike"
    )
    params = (
        Param(
            "allocation",
            "global",
            "global: one ranking over every layer and KV head (ragged per-head counts, the paper's default); "
            "uniform: the same count in each",
            choices=("global", "uniform"),
        ),
        Param("chunk", 2000, "context tokens reconstructed per extra forward (the paper's 2K)", minimum=CARRY),
        Param(
            "keep_template",
            True,
            "never evict the chat template's opening (system prompt, user header), as the authors' code; "
            "its pairs are paid for from the budget",
        ),
    )

    capacity: int  # pairs per layer and KV head on average (global) or in each (uniform)
    full: bool
    sem: ModelSemantics  # (``ModelInfo`` always fills its semantics)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heads: list[list[DenseLayer]] = []  # per layer, per KV head: that head's kept pairs
        self.head_sems: list[list[LayerSemantics]] = []

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        self.capacity = self.tokens_for_budget(n_prompt)
        return {"capacity": self.capacity, "allocation": self.cfg["allocation"]}

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return PrefillNeeds(model_access=not self.keeps_all(n_prompt))

    def keeps_all(self, n: int) -> bool:
        return self.full or self.capacity >= n

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n] reconstruction scores of the prompt's pairs (``reconstruction_scores``)."""
        model = state.model
        if model is None:
            raise ValueError(
                "kvzip needs the model's own forward pass (PrefillNeeds.model_access); the prefill gave none"
            )
        chunk = int(self.cfg["chunk"])
        done = SCORED.setdefault(model, {})  # the same prompt at several budgets is reconstructed once
        if chunk not in done:
            # a reconstruction past a RoPE switch (Phi-3's longrope) would rotate its queries with other factors
            # than the prompt's keys: it stays within the switch as within the context
            n, longest = state.n_tokens, self.info.max_positions
            switch = self.info.switch_crossed(n, longest)
            done[chunk] = reconstruction_scores(
                model, self.sem, self.info.n_kv_heads, chunk, longest if switch is None else switch
            )
        return done[chunk]

    def template_length(self, state: PrefillState) -> int:
        """The pairs never evicted: the chat template's opening (0 with ``keep_template`` off, or when the
        prompt is not in the template)."""
        if not self.cfg["keep_template"] or state.model is None:
            return 0
        return min(len(template(state.model)[0]), state.n_tokens)

    def compress_tokens(self, state: PrefillState) -> None:
        n_layers, n_kv, n = state.keys.shape[0], state.keys.shape[1], state.n_tokens
        if self.keeps_all(n):
            keep = torch.ones(n_layers, n_kv, n, dtype=torch.bool, device=state.keys.device)
        else:
            scores = self.scores(state).to(state.keys.device)
            prefix = self.template_length(state)
            if prefix:  # the authors never evict the template's opening: it ranks above every context pair
                scores = scores.clone()
                scores[..., :prefix] = float("inf")
            keep = keep_mask(scores, self.capacity, self.cfg["allocation"])
        g = self.info.group_size
        self.layers, self.heads, self.head_sems = [], [], []
        self.head_held: dict[int, list[int]] = {}
        for layer in range(n_layers):
            first = self.sem[layer].visible_from(n - 1)
            stores = []
            for h in range(n_kv):
                idx = torch.nonzero(keep[layer, h]).view(-1)
                if first > 0:  # a local layer holds what its last query sees (its window or chunk) only
                    idx = idx[idx >= first]
                stores.append(
                    DenseLayer.make(
                        self.as_cached(state.keys[layer, h : h + 1, idx]),
                        self.as_cached(state.values[layer, h : h + 1, idx]),
                        idx.view(1, -1),
                    )
                )
            self.heads.append(stores)
            self.head_sems.append([head_semantics(self.sem[layer], h, g) for h in range(n_kv)])
            if first > 0:  # a local layer: each head then holds what it held here (plus its window's growth)
                self.head_held[layer] = [store.n for store in stores]
        self.n_prompt = n

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        newest = pos + k.shape[-2] - 1
        first = self.sem[layer].visible_from(newest)
        held = self.head_held.get(layer)
        for h, store in enumerate(self.heads[layer]):
            store.append(k[h : h + 1], v[h : h + 1], pos)
            if first > 0:
                keep_from(store, first)
            room = None if held is None else max(1, held[h] + self.local_growth(layer, newest))
            if room is not None and store.n > room:  # the oldest make room (every head keeps the newest token)
                keep_from(store, int(store.positions()[0, store.n - room]))

    def _attend(self, layer: int, q: Tensor, causal_tail: int = 0) -> Tensor:
        """q [Hq, t, d] -> [Hq, t, dv]: each KV head's query group over that head's pairs."""
        g = self.info.group_size
        outs = []
        for h, store in enumerate(self.heads[layer]):
            k, v, _, _ = store.views()
            outs.append(sm.attend(q[h * g : (h + 1) * g], k, v, self.head_sems[layer][h], causal_tail=causal_tail))
        return torch.cat(outs, dim=0)

    def attend(self, layer: int, q: Tensor) -> Tensor:
        return self._attend(layer, q)

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c tokens: appended at once, one causal attention (token by token on a local layer)."""
        if self.sem[layer].is_local:
            return Compressor.feed(self, layer, q, k, v, pos)
        self.append(layer, k, v, pos)
        return self._attend(layer, q, causal_tail=q.shape[-2])

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for stores in self.heads:
            for store in stores:
                yield from store.tensors()

    def kept_positions(self, layer: int) -> Tensor | None:
        """[Hkv, m] positions; a head holding fewer than m repeats its newest position (as ``adakv`` does), so
        the rows stay rectangular and every entry is a position that head holds (a view, not held)."""
        pos = [store.views()[2][0].cpu() for store in self.heads[layer]]
        width = max(p.numel() for p in pos)
        newest = max((int(p.max()) for p in pos if p.numel()), default=0)  # for a head that holds nothing yet
        out = torch.full((len(pos), width), newest, dtype=torch.int32)
        for h, p in enumerate(pos):
            out[h, : p.numel()] = p
            if 0 < p.numel() < width:
                out[h, p.numel() :] = p.max()
        return out

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        g = self.info.group_size
        views = [store.views() for store in self.heads[layer]]
        n = 1 + max((int(p.max()) for _, _, p, _ in views if p.numel()), default=-1)
        rows = []
        for h, (k, _, pos, _) in enumerate(views):
            s = self.head_sems[layer][h]
            probs = sm.softmax(sm.logits(q[h * g : (h + 1) * g].float(), k.float(), s), s)[:, 0]
            rows.append(on_positions(probs, pos, n))
        return torch.cat(rows, dim=0)
