"""What each head keeps: per run, layer and KV head, which token positions the cache holds, and how.

``RetentionProbe`` takes kept-position snapshots of every run's cache at a bounded number of points: right
after compression, after a question fed to a compressed context (query-agnostic), at up to ``snapshots``
decode steps spread evenly over the generation (for the methods that change their cache while decoding:
``streaming``, which evict, merge or quantize as they go), and once at the end of each run. A snapshot
holds, for every seen position, two bits per (layer, KV head):

* **held**: the cache holds the position in some form (``kept_positions`` of a dense cache; every position
  a layer's queries can see for a cache that codes every token: QJL, KIVI, the token quantizers, SubGen);
* **full**: it holds it at full precision (a dense cache's kept tokens unless a composition stores them as
  codes; a quantizer's recent residual; SubGen's exact sink and recent tokens).

The views (``kvlab.report.retention_map``) tell apart from these: evicted (not held), summarized (not held
exactly, but standing in what is kept: clusters, merged values, sample weights; ``Compressor.summarizes``),
quantized (held, not at full precision; shaded by the measured bits per number), and among the tokens held
at full precision, the sink (the run from the first position) and the window (the run up to the newest).

Each snapshot also records the measured bits per number of the quantized tokens: the bytes the cache holds
(``nbytes``, from its tensors) less its full-precision tokens' bytes, over the numbers it holds as codes
(scales, norms and positions included); None when it holds none.

The masks are packed 8 positions to a byte, compressed (zlib) and base64-encoded: a 4k-token prompt on a
30-layer, 3-KV-head model takes 46 KB per snapshot before compression (bench/README.md, "What each head
keeps").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvlab.core.bitmask import pack, unpack
from kvlab.engine.probe import Probe
from kvlab.methods import Compressor
from kvlab.methods.dense import DenseCompressor

VERSION = 1


@dataclass
class RetentionSettings:
    """How many decode-step snapshots a run that changes while decoding gets (besides the one after
    compression and the one at its end)."""

    snapshots: int = 8


def snapshot_steps(max_new_tokens: int, snapshots: int) -> set[int]:
    """Decode steps to snapshot: up to ``snapshots`` of 1 .. max_new_tokens - 1, spread evenly (the last among them)."""
    last = max(0, max_new_tokens - 1)
    if last == 0 or snapshots <= 0:
        return set()
    k = min(snapshots, last)
    return {math.ceil(i * last / k) for i in range(1, k + 1)}


def _mask(positions: Tensor | None, hkv: int, seen: int) -> np.ndarray:
    """[Hkv, seen] bool: True where ``positions`` [Hkv, m] names a position (None: none)."""
    out = torch.zeros(hkv, seen, dtype=torch.bool)
    if positions is not None and positions.numel():
        p = positions.reshape(positions.shape[0], -1).long().cpu()
        p = p.clamp(0, max(0, seen - 1))
        out[: p.shape[0]].scatter_(1, p, True)
    return out.numpy()


def layer_masks(comp: Compressor, layer: int, seen: int) -> tuple[np.ndarray, np.ndarray]:
    """(held, full) of one layer: [Hkv, seen] bool each (see the module's docstring)."""
    hkv = comp.info.n_kv_heads
    kept = comp.kept_positions(layer)
    if isinstance(comp, DenseCompressor):
        held = _mask(kept, hkv, seen)
        coded = comp.held_in() is not None  # a composition: its kept tokens are stored as codes
        return held, np.zeros_like(held) if coded else held
    held = np.zeros((hkv, seen), dtype=bool)
    held[:, comp.sem[layer].visible_from(seen - 1) if seen else 0 :] = True
    return held, _mask(kept, hkv, seen) & held


def masks(comp: Compressor, seen: int) -> tuple[np.ndarray, np.ndarray]:
    """(held, full) over every layer: [L, Hkv, seen] bool each."""
    per = [layer_masks(comp, layer, seen) for layer in range(comp.info.n_layers)]
    return np.stack([h for h, _ in per]), np.stack([f for _, f in per])


def quantized_bits(comp: Compressor, held: np.ndarray, full: np.ndarray) -> float | None:
    """Bits per number of the tokens held as codes: (bytes held - the full-precision tokens' bytes) * 8 over
    the numbers coded; None when no token is held as codes."""
    coded = int((held & ~full).sum())
    if not coded:
        return None
    per_token = comp.sem[0].k_dim + comp.sem.v_dim  # numbers of one token's key and value
    full_bytes = int(full.sum()) * per_token * comp.cache_dtype.itemsize
    return round(8 * max(0, comp.nbytes() - full_bytes) / (coded * per_token), 3)


def snapshot(comp: Compressor, step: int, seen: int, stage: str) -> dict:
    """One snapshot of ``comp``'s cache: its step, the positions seen, the two masks, the coded tokens' bits."""
    held, full = masks(comp, seen)
    return {
        "step": step,
        "stage": stage,  # "compressed", "question" or "decode"
        "seen": seen,
        "held": pack(held),
        "full": pack(full),
        "held_tokens": int(held.sum()),
        "full_tokens": int(full.sum()),
        "bits": quantized_bits(comp, held, full),
    }


class RetentionProbe(Probe):
    """Kept-position snapshots of every run (``extras["retention"]``): after compression, after a question,
    at up to ``snapshots`` decode steps for runs whose cache changes while decoding, and at each run's end."""

    sees_chunks = True  # a question fed after compression: how many tokens it adds
    forkable = True  # stateless until ``on_prefill``; only on_prefill, on_chunk, on_step and finish

    def __init__(self, settings: RetentionSettings | None = None, max_new_tokens: int = 32):
        self.cfg = settings or RetentionSettings()
        self.steps = snapshot_steps(max_new_tokens, self.cfg.snapshots)

    def on_prefill(self, state, logits: Tensor, compressors: list[Compressor]) -> None:
        self.comps = list(compressors)
        self.n = int(state.n_tokens)
        self.fed = self.n  # tokens in every cache before the first decode step
        self.shots: list[list[dict]] = [[] for _ in self.comps]
        self.last: list[int] = [0] * len(self.comps)
        for i in range(len(self.comps)):
            self._take(i, 0, self.n, "compressed")

    def on_chunk(self, layer: int, rows: list[int], pos: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        if layer == 0:
            self.fed = pos + q.shape[-2]

    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None:
        seen = self.fed + step
        for i in rows:
            self.last[i] = step
            comp = self.comps[i]
            if step == 0 and self.fed > self.n:  # a question fed after compression (query-agnostic)
                self._take(i, 0, seen, "question")
            elif step in self.steps and comp.streaming:
                self._take(i, step, seen, "decode")

    def _take(self, i: int, step: int, seen: int, stage: str) -> None:
        """Run i's snapshot, unless its cache cannot say what it holds (a run that failed): then none."""
        try:
            self.shots[i].append(snapshot(self.comps[i], step, seen, stage))
        except Exception:  # noqa: BLE001 - a failed run's cache: its card says why; the map leaves it out
            self.shots[i] = []

    def finish(self, runs) -> None:
        for i, r in enumerate(runs):
            if i >= len(self.comps):
                break
            comp, step = self.comps[i], self.last[i]
            seen = self.fed + step
            if self.shots[i] and self.shots[i][-1]["seen"] != seen:  # the end state, unless already taken
                self._take(i, step, seen, "decode")
            if not self.shots[i]:
                continue
            r.extras["retention"] = {
                "version": VERSION,
                "layers": comp.info.n_layers,
                "kv_heads": comp.info.n_kv_heads,
                "prompt_tokens": self.n,
                "streaming": bool(comp.streaming),
                "summarizes": bool(getattr(comp, "summarizes", False)),
                "snapshots": self.shots[i],
            }
        self.comps = []


__all__ = [
    "RetentionProbe",
    "RetentionSettings",
    "layer_masks",
    "masks",
    "pack",
    "snapshot",
    "snapshot_steps",
    "unpack",
]
