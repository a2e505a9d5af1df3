"""The next token from a row's logits: greedy, or sampled with temperature, top-k and top-p."""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.engine.specs import GenerationSettings


def next_token(logits: Tensor, gen: GenerationSettings, generator: torch.Generator) -> int:
    """The next token from ``logits`` [V]: greedy, or sampled with temperature, top-k and top-p."""
    if not gen.do_sample:
        return int(torch.argmax(logits))
    x = logits.float() / gen.temperature
    if gen.top_k > 0:
        kth = torch.topk(x, min(gen.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if gen.top_p < 1:
        sp, si = torch.sort(probs, descending=True)
        drop = torch.cumsum(sp, -1) - sp > gen.top_p
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


__all__ = ["next_token"]
