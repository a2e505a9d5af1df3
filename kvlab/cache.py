"""transformers ``Cache`` subclasses: one that keeps the exact prefill, one that routes decode rows.

Neither stores attention state for the model itself: the prefill cache keeps the exact K/V of
the prompt for the compressors; the lockstep cache hands each row's new K/V to that row's
compressor, and the kvlab attention function then reads from the compressors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab import faults
from kvlab.few_rows import torch_functions_plain


class _RoutedLayer(CacheLayerMixin):
    """A layer that reports the true number of tokens seen (for positions and mask sizes)."""

    def __init__(self, seen: int = 0):
        super().__init__()
        self.seen = seen
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError  # routed by the owning cache

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class PrefillCache(Cache):
    """Keeps the exact post-RoPE K/V of the prompt per layer: [1, Hkv, n, d]."""

    def __init__(self, n_layers: int):
        super().__init__(layers=[_RoutedLayer() for _ in range(n_layers)])
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        self.layers[layer_idx].seen = key_states.shape[-2]
        return key_states, value_states

    def stacked(self) -> tuple[Tensor, Tensor]:
        """[L, Hkv, n, d] keys and values of the single prompt."""
        return torch.stack([k[0] for k in self.keys]), torch.stack([v[0] for v in self.values])


class LockstepCache(Cache):
    """Batch row i -> compressors[i]; row i's new token is appended at true position ``seen[i]``
    (``seen`` an int: the same position for every row).

    ``chunk``: the forward feeds several tokens per row (a question asked after compression); the
    cache then appends nothing and hands the new K/V on to the attention function, whose chunk
    handler (``attention.LockstepChunk``) appends and attends token by token inside each compressor.
    """

    def __init__(self, compressors: list, n_layers: int, seen: int | Sequence[int], chunk: bool = False):
        self.positions = [seen] * len(compressors) if isinstance(seen, int) else list(seen)
        super().__init__(layers=[_RoutedLayer(max(self.positions, default=0)) for _ in range(n_layers)])
        self.compressors = compressors
        self.chunk = chunk

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.chunk:
            return key_states, value_states
        with torch_functions_plain():
            for row, comp in enumerate(self.compressors):
                faults.append(row, comp, layer_idx, key_states[row], value_states[row], self.positions[row])
        return key_states, value_states
