"""The model's rotary position embedding (RoPE), for methods that reason about queries before RoPE.

Keys and queries reach kvlab post-RoPE (docs/design.md §8). ``Rotary`` turns a vector before RoPE
into the one the model computes at a position, and back. Its angles come from the loaded model's own
rotary-embedding module (``model.model.rotary_emb`` for Llama-like models), called with the
positions, so every scaling type transformers implements (linear, dynamic, YaRN, Llama 3, ...) and
the attention scaling it folds into cos/sin are the model's. The pairing of dimensions is read from
the angles: the first half with the second (Llama's ``rotate_half``) or neighbours (GPT-J's
interleaved pairs). Partial rotary embeddings rotate the first dimensions only.

``ModelInfo.rope`` is None on a model with no single such module (no RoPE, or RoPE that differs per
layer type); a method that needs it refuses such a model in ``check_semantics``.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

HALF = "half"  # dimension i pairs with i + r/2 (Llama, Mistral, Qwen, Gemma, Phi-3...)
INTERLEAVED = "interleaved"  # dimension 2i pairs with 2i + 1 (GPT-J style)


class Rotary:
    """RoPE as the model applies it: ``rotate`` (pre-RoPE -> post-RoPE), ``unrotate`` (the inverse).

    ``module(x, position_ids)`` is the model's rotary embedding, returning cos, sin [1, P, r] for r
    rotated dimensions (r <= head_dim); ``pairing`` is ``HALF`` or ``INTERLEAVED``.
    """

    def __init__(self, module: nn.Module, head_dim: int, pairing: str = HALF):
        if pairing not in (HALF, INTERLEAVED):
            raise ValueError(f"unknown RoPE pairing {pairing!r}; allowed: {HALF}, {INTERLEAVED}")
        self.module, self.head_dim, self.pairing = module, head_dim, pairing

    def __deepcopy__(self, memo: dict) -> Rotary:
        return self  # the model's own module: every copy of a ModelInfo shares it

    @property
    def device(self) -> torch.device:
        buf = next(iter(self.module.buffers()), None)
        return buf.device if buf is not None else torch.device("cpu")

    @torch.no_grad()
    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [P, r] float32 of the positions [P] (the model's angles, attention scaling included)."""
        dev = self.device
        x = torch.zeros(1, dtype=torch.float32, device=dev)
        cos, sin = self.module(x, positions.reshape(1, -1).to(dev))
        return cos[0].float(), sin[0].float()

    def _turn(self, x: Tensor) -> Tensor:
        """The quarter turn of each pair: (a, b) -> (-b, a)."""
        if self.pairing == HALF:
            h = x.shape[-1] // 2
            return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def _apply(self, x: Tensor, positions: Tensor, inverse: bool) -> Tensor:
        cos, sin = (t.to(x.device) for t in self.cos_sin(positions))
        r = cos.shape[-1]
        head, rest = x[..., :r].float(), x[..., r:]
        if inverse:  # (C - S J) / (C^2 + S^2) undoes C + S J (C, S equal on both members of a pair)
            out = (head * cos - self._turn(head) * sin) / (cos * cos + sin * sin)
        else:
            out = head * cos + self._turn(head) * sin
        out = out.to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [..., P, d] before RoPE at ``positions`` [P] -> as the model rotates it (x's dtype)."""
        return self._apply(x, positions, inverse=False)

    def unrotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [..., P, d] after RoPE at ``positions`` [P] -> before it (the inverse of ``rotate``)."""
        return self._apply(x, positions, inverse=True)


def _pairing(cos: Tensor) -> str | None:
    """How the angles [P, r] pair dimensions: equal halves (``HALF``), equal neighbours, or neither (None)."""
    r = cos.shape[-1]
    if r % 2:
        return None
    if torch.allclose(cos[..., : r // 2], cos[..., r // 2 :]):
        return HALF
    if torch.allclose(cos[..., 0::2], cos[..., 1::2]):
        return INTERLEAVED
    return None


def model_rotary(model: nn.Module, head_dim: int) -> Rotary | None:
    """The ``Rotary`` of a loaded causal LM, or None when it has no single rotary embedding that every
    layer shares (no RoPE, per-layer-type RoPE, several rotary modules) or its angles cannot be read."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    module = getattr(decoder, "rotary_emb", None)
    if not isinstance(module, nn.Module):
        found = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1].startswith("rotary")]
        if len(found) != 1:
            return None
        module = found[0]
    if "layer_type" in inspect.signature(module.forward).parameters:
        return None  # angles that differ per layer type (local and global layers): not one rotary
    try:
        probe = Rotary(module, head_dim)
        cos, _ = probe.cos_sin(torch.arange(1, 3))
    except Exception:  # noqa: BLE001 - a module that is not called (x, position_ids) -> cos, sin
        return None
    if cos.dim() != 2 or cos.shape[-1] > head_dim:
        return None
    pairing = _pairing(cos)
    return None if pairing is None else Rotary(module, head_dim, pairing)


__all__ = ["HALF", "INTERLEAVED", "Rotary", "model_rotary"]
