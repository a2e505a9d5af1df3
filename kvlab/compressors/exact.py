"""The exact (uncompressed) cache: every token's key and value at full precision. The reference."""

from __future__ import annotations

from kvlab.compressors.base import DenseCompressor, PrefillState
from kvlab.compressors.registry import register


@register
class Exact(DenseCompressor):
    name = "exact"
    title = "Exact cache"
    group = "reference"
    positions_implicit = True  # 0..n-1
    summary = "Keeps every key and value at full precision; the reference every method is measured against."

    def select(self, state: PrefillState):
        return [None] * state.keys.shape[0]
