"""transformers ``Cache`` subclasses: one that keeps the exact prefill, one that routes decode rows, one
that runs a chunk after the exact prompt.

None stores attention state for the model itself, and none appends anything: each reports the
true number of tokens seen (for positions and mask sizes) and hands the new states straight to the
attention function, where kvlab takes the keys and values as attention sees them (the prefill's
``attention.PrefillCapture`` keeps them; ``attention.LockstepDecode`` / ``LockstepChunk`` hand each
row's to its compressor; ``prefill.ExactExtension`` attends a chunk over the exact prompt). A model
whose cache holds something else than the attention's keys and values (multi-head latent attention
caches the latent and expands it after the cache) is thereby routed like any other.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


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
    """Counts the prompt's tokens per layer; the keys and values are taken at the attention function."""

    def __init__(self, n_layers: int):
        super().__init__(layers=[_RoutedLayer() for _ in range(n_layers)])

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        cast(_RoutedLayer, self.layers[layer_idx]).seen = key_states.shape[-2]  # the layers __init__ made
        return key_states, value_states


class RoutedCache(Cache):
    """``seen`` tokens already attended per layer (held by the attention handler: the compressors, or the
    exact prompt); the new tokens' keys and values pass straight through to the attention function,
    which routes them (``attention.LockstepDecode``, ``LockstepChunk``, ``prefill.ExactExtension``).
    With rows at different positions, ``seen`` is the largest: the mask sizes fit every row, and the
    handler masks each row by itself."""

    def __init__(self, n_layers: int, seen: int):
        super().__init__(layers=[_RoutedLayer(seen) for _ in range(n_layers)])

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states
