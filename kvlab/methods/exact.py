"""The exact (uncompressed) cache: every token's key and value in the cache dtype. The reference.

The cache dtype is 16-bit by default (float16 on the CPU, the model's 16-bit dtype on a GPU), as
papers and deployments count a KV cache; keys and values are upcast for attention. With
``--cache-dtype float32`` on a float32 model the exact cache is transformers' own attention and
generates the same tokens as ``generate``; with float16 storage its teacher-forced KL against
``generate``'s logits is ~1e-6 nats per step on the embedded model (tests bound it by 1e-4).
"""

from __future__ import annotations

from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillState


class Exact(DenseCompressor):
    name = "exact"
    title = "Exact cache"
    group = "reference"
    positions_implicit = True  # 0..n-1
    summary = "Keeps every key and value (16-bit by default); the reference every method is measured against."

    def select(self, state: PrefillState):
        return [None] * state.keys.shape[0]

    def budget_ratio(self, n_prompt: int) -> float | None:
        """Not predicted: the reference keeps every token whatever budget it is given (never refused)."""
        return None
