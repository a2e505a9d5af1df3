"""A cache whose KV heads hold different numbers of prompt tokens: the ragged store several methods share.

A method that chooses its prompt tokens per layer and KV head with counts that differ between the heads
of a layer (Ada-KV's allocation, LU-KV's per-head budgets, DMS's threshold, DuoAttention's streaming
heads, SimLayerKV's lazy layers) derives from ``RaggedCompressor`` and returns that choice as one mask,
``keep_mask(state)`` -> [L, Hkv, n] bool. The cache holds exactly those tokens (``RaggedLayer``): per
layer, the kept prompt tokens of all heads in one flat [T, d] tensor with each head's count (an int32
per layer and KV head, counted in the bytes), and the tokens appended after compression (which every
head gets) in a dense [Hkv, m, d] store. Attention builds a transient per-head view padded to the
longest head; the padding is never part of ``tensors()`` and gets zero weight.

On a sliding-window layer a head holds only what the layer's last query sees: its picks inside the
window, topped up with the newest tokens it did not pick to the same count (at most the window). While
decoding such a layer then holds at most what it held after compression plus its window's growth.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kvlab.core import cancel
from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor, DenseLayer
from kvlab.methods.handover import PrefillState

PAD_LOGW = -1e30  # a padding slot's log-weight: weight exactly 0, finite so a block of padding alone stays finite


def topped_up(mask: Tensor, want: Tensor, first: int) -> Tensor:
    """``mask`` [H, n] (bool, no token before ``first``) with each head's newest unmarked tokens at or after
    ``first`` added until head h marks ``want[h]`` of them."""
    free = ~mask
    free[:, :first] = False
    rank = free.flip(-1).cumsum(-1).flip(-1)  # the newest free token: 1
    return mask | (free & (rank <= (want - mask.sum(-1))[:, None]))


@dataclass
class RaggedLayer:
    """One layer whose KV heads hold different numbers of prompt tokens, plus the tokens appended since.

    k: [T, d], v: [T, dv]: the kept prompt tokens of every head one after the other (head 0's first,
    each head's in position order); pos: [T] int32, their positions; counts: [Hkv] int32, how many
    each head holds (summing to T). tail: the tokens appended after compression, held by every head
    alike ([Hkv, m, d] in a ``DenseLayer``).
    """

    k: Tensor
    v: Tensor
    pos: Tensor
    counts: Tensor
    tail: DenseLayer

    @classmethod
    def kept(cls, keys: Tensor, values: Tensor, keep: Tensor) -> RaggedLayer:
        """The tokens ``keep`` [Hkv, n] (bool) of keys [Hkv, n, d] / values [Hkv, n, dv]."""
        h, n = keep.shape
        pos = torch.arange(n, dtype=torch.int32, device=keys.device).expand(h, n)
        tail = DenseLayer.make(keys[:, :0], values[:, :0], pos[:, :0])
        return cls(keys[keep], values[keep], pos[keep], keep.sum(-1).to(torch.int32), tail)

    def append(self, k: Tensor, v: Tensor, pos: int) -> None:
        """Tokens k [Hkv, c, d], v [Hkv, c, dv] at positions pos..pos+c-1, for every head."""
        self.tail.append(k, v, pos)

    def drop_before(self, first: int) -> None:
        """Forget the tokens at positions below ``first`` (a sliding-window layer's)."""
        inside = self.pos >= first
        if not bool(inside.all()):
            head = torch.repeat_interleave(torch.arange(len(self.counts), device=self.pos.device), self.counts.long())
            self.counts = torch.bincount(head[inside], minlength=len(self.counts)).to(torch.int32)
            self.k, self.v, self.pos = self.k[inside], self.v[inside], self.pos[inside]
        tail_pos = self.tail.views()[2][0]  # [m]: the same positions in every head
        if tail_pos.numel() and int(tail_pos[0]) < first:
            idx = (tail_pos >= first).nonzero().squeeze(-1)
            self.tail.keep(idx.expand(len(self.counts), -1))

    def held(self) -> int:
        """Tokens held, all heads together (prompt tokens and the tail of every head)."""
        return int(self.counts.sum()) + len(self.counts) * self.tail.n

    def drop_oldest(self, m: int) -> None:
        """Forget at least m tokens, the oldest first: prompt tokens by position, whichever heads hold them;
        once none is left, the oldest appended ones (every head's, so a multiple of the head count)."""
        t = min(m, self.pos.numel())
        if t:
            inside = torch.ones_like(self.pos, dtype=torch.bool)
            inside[torch.sort(self.pos, stable=True).indices[:t]] = False
            head = torch.repeat_interleave(torch.arange(len(self.counts), device=self.pos.device), self.counts.long())
            self.counts = torch.bincount(head[inside], minlength=len(self.counts)).to(torch.int32)
            self.k, self.v, self.pos = self.k[inside], self.v[inside], self.pos[inside]
        rest = -(-(m - t) // len(self.counts))
        if rest:
            n = self.tail.n
            self.tail.keep(torch.arange(min(rest, n), n, device=self.pos.device).expand(len(self.counts), -1))

    def read_views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """As attention reads them: ``views`` (``DenseLayer.read_views``)."""
        return self.views()

    def positions(self) -> Tensor:
        """[Hkv, w + m] int32: the positions of ``views`` (a shorter head's row padded with its newest)."""
        return self.views()[2]

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """A transient per-head view of what is held: k [Hkv, w + m, d], v, pos [Hkv, w + m], logw.

        Each head's prompt tokens padded to the longest head's w (zero keys and values, log-weight
        ``PAD_LOGW``, the newest position held), then the tail; logw None when no head is padded.
        """
        tk, tv, tpos, _ = self.tail.views()
        counts = self.counts.tolist()
        newest = int(tpos.max()) if tpos.numel() else int(self.pos.max()) if self.pos.numel() else 0
        k = pad_sequence(list(self.k.split(counts)), batch_first=True)
        v = pad_sequence(list(self.v.split(counts)), batch_first=True)
        pos = pad_sequence(list(self.pos.split(counts)), batch_first=True, padding_value=newest)
        lw = None
        if min(counts) < max(counts):
            pad = torch.arange(k.shape[1], device=k.device)[None, :] >= self.counts[:, None]
            lw = torch.zeros(pad.shape, device=k.device).masked_fill_(pad, PAD_LOGW)
            lw = torch.cat([lw, lw.new_zeros(lw.shape[0], tk.shape[1])], 1)
        return torch.cat([k, tk], 1), torch.cat([v, tv], 1), torch.cat([pos, tpos], 1), lw

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield "keys", self.k
        yield "values", self.v
        yield "positions", self.pos
        yield "head_counts", self.counts
        yield from self.tail.tensors()


class RaggedCompressor(DenseCompressor):
    """A prefill-time selection whose KV heads keep different token counts, held in ``RaggedLayer``s.

    A subclass plans its budget (``plan_tokens``) and returns its choice in ``keep_mask(state)``: [L, Hkv, n]
    bool, True where a head keeps a prompt token (None: every token). Generated tokens are all kept.
    """

    layers: list[RaggedLayer]  # type: ignore[assignment]  # the dense store's interface, ragged
    plain_feed = False  # its own append
    no_composition = "its heads hold different token counts; a composition stores every head of a layer alike"

    def keep_mask(self, state: PrefillState) -> Tensor | None:
        """After ``plan``: [L, Hkv, n] bool, the prompt tokens each layer's KV heads keep (None: all)."""
        raise NotImplementedError

    def fixed_stream_bytes(self) -> float:
        """What the base holds per layer and KV head besides the tokens, and each head's int32 count."""
        return super().fixed_stream_bytes() + 4

    def layer_plan(self, keep: Tensor) -> list[int]:
        """After ``keep_mask``: per layer, the tokens per KV head its plan gives it, which a local layer grows to
        while its queries see more than it held after compression (up to its ``reach``, ``local_reserve``): by
        default what ``keep`` [L, Hkv, n] marks, per head on average, rounded up."""
        return keep.sum(-1).float().mean(-1).ceil().long().tolist()

    def compress_tokens(self, state: PrefillState) -> None:
        n, n_layers, h = state.n_tokens, state.keys.shape[0], state.keys.shape[1]
        keep = self.keep_mask(state)
        if keep is None:
            keep = torch.ones(n_layers, h, n, dtype=torch.bool, device=state.keys.device)
        positions = torch.arange(n, device=keep.device)
        planned = self.layer_plan(keep)
        self.layers = []
        self.n_prompt, self.local_held, self.local_reserve = n, {}, {}
        for layer in range(n_layers):
            cancel.checkpoint()
            mask, first = keep[layer], self.sem[layer].visible_from(n - 1)
            if first > 0:  # a local layer holds what its last query sees: each head's picks there, topped up
                mask = topped_up(mask & (positions >= first), mask.sum(-1).clamp(max=n - first), first)
            ks, vs = self.as_cached(state.keys[layer]), self.as_cached(state.values[layer])
            self.layers.append(RaggedLayer.kept(ks, vs, mask))
            if first > 0:  # held over the heads; the growth (and its reserve) per head, as ``append`` counts it
                kept = int(mask.sum())
                self.local_held[layer] = kept
                self.local_reserve[layer] = max(0, min(planned[layer], self.reach(layer, n)) - kept // h)

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        """The new tokens go to every head; on a local layer, what leaves the window goes, and the layer then
        holds at most what it held after compression (plus its window's growth): its oldest prompt tokens,
        whichever heads hold them, make room first."""
        cache, newest = self.layers[layer], pos + k.shape[-2] - 1
        cache.append(k, v, pos)
        s = self.sem[layer]
        if s.is_local:
            cache.drop_before(s.visible_from(newest))
        if layer in self.local_held:
            h = len(cache.counts)
            over = cache.held() - (self.local_held[layer] + h * self.local_growth(layer, newest))
            if over > 0:
                cache.drop_oldest(over)

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c tokens: appended to every head at once, one causal attention (a sliding-window
        layer, whose window moves with every token, takes them one at a time)."""
        if self.sem[layer].is_local:
            return Compressor.feed(self, layer, q, k, v, pos)
        return self._append_attend_block(layer, q, k, v, pos)

    def head_counts(self) -> Tensor:
        """[L, Hkv] int32: the prompt tokens each layer's KV heads hold."""
        return torch.stack([layer.counts for layer in self.layers])


__all__ = ["RaggedCompressor", "RaggedLayer", "topped_up"]
