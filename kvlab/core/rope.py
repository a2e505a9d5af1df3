"""The model's rotary position embedding (RoPE), for methods that reason about queries before RoPE.

Keys and queries reach kvlab post-RoPE (docs/design.md §8). ``Rotary`` is the model's RoPE, layer by
layer: ``layer(i)`` is layer i's ``Rotation``, which turns a vector before RoPE into the one the model
computes at a position, and back. Local and global layers may rotate with different parameters
(Gemma 3, Olmo 3: one module called with the layer's type); ``rotate``/``unrotate`` of a tensor whose
first dimension is the layers apply each layer's own. Angles come from the loaded model's own
rotary-embedding module (``model.model.rotary_emb`` for Llama-like models), called with the
positions, so every scaling type transformers implements (linear, dynamic, YaRN, Llama 3, ...) and
the attention scaling it folds into cos/sin are the model's. The pairing of dimensions is read from
the angles: the first half with the second (Llama's ``rotate_half``) or neighbours (GPT-J's
interleaved pairs). Partial rotary embeddings rotate the first dimensions only.

``ModelInfo.rope`` is None on a model whose rotary embedding kvlab cannot read (none, several
modules, angles in another form); a method that needs it refuses such a model in ``check_semantics``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

HALF = "half"  # dimension i pairs with i + r/2 (Llama, Mistral, Qwen, Gemma, Phi-3...)
INTERLEAVED = "interleaved"  # dimension 2i pairs with 2i + 1 (GPT-J style)


class Rotation:
    """One layer's RoPE as the model applies it: ``rotate`` (pre-RoPE -> post-RoPE), ``unrotate`` (the inverse).

    ``module(x, position_ids)`` (or ``module(x, position_ids, layer_type)`` when ``layer_type`` is given)
    is the model's rotary embedding, returning cos, sin [1, P, r] for r rotated dimensions (r <= head_dim);
    ``pairing`` is ``HALF`` or ``INTERLEAVED``.
    """

    def __init__(self, module: nn.Module, head_dim: int, pairing: str = HALF, layer_type: str | None = None):
        if pairing not in (HALF, INTERLEAVED):
            raise ValueError(f"unknown RoPE pairing {pairing!r}; allowed: {HALF}, {INTERLEAVED}")
        self.module, self.head_dim, self.pairing, self.layer_type = module, head_dim, pairing, layer_type

    def __deepcopy__(self, memo: dict) -> Rotation:
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
        ids = positions.reshape(1, -1).to(dev)
        cos, sin = self.module(x, ids) if self.layer_type is None else self.module(x, ids, self.layer_type)
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


class Rotary:
    """The model's RoPE, per layer: ``layer(i)`` is layer i's ``Rotation`` (None: the layer has no RoPE).

    ``rotate`` / ``unrotate`` take x [L, ..., P, d] (one entry per layer, in order) and apply each
    layer's rotation; when every layer shares one (``shared``), x may have any leading dimensions.
    """

    def __init__(self, layers: Sequence[Rotation | None]):
        self.layers = tuple(layers)
        first = self.layers[0] if self.layers else None
        self.shared = first if first is not None and all(r is first for r in self.layers) else None

    def __deepcopy__(self, memo: dict) -> Rotary:
        return self

    def layer(self, i: int) -> Rotation | None:
        """Layer i's rotation (None: that layer applies no RoPE)."""
        return self.layers[i]

    @property
    def pairing(self) -> str:
        return next(r.pairing for r in self.layers if r is not None)

    def _per_layer(self, x: Tensor, positions: Tensor, inverse: bool) -> Tensor:
        if self.shared is not None:
            return self.shared.unrotate(x, positions) if inverse else self.shared.rotate(x, positions)
        if x.shape[0] != len(self.layers):
            raise ValueError(
                f"x has {x.shape[0]} entries along its first dimension, the model {len(self.layers)} layers"
            )
        out = []
        for r, xi in zip(self.layers, x):
            out.append(xi if r is None else (r.unrotate(xi, positions) if inverse else r.rotate(xi, positions)))
        return torch.stack(out)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [L, ..., P, d] before RoPE at ``positions`` [P] -> as each layer rotates it (x's dtype)."""
        return self._per_layer(x, positions, inverse=False)

    def unrotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [L, ..., P, d] after each layer's RoPE at ``positions`` [P] -> before it."""
        return self._per_layer(x, positions, inverse=True)


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


def model_rotary(model: nn.Module, head_dim: int, n_layers: int) -> Rotary | None:
    """The ``Rotary`` of a loaded causal LM's ``n_layers`` layers, or None when it has no rotary embedding
    kvlab can read (none, several rotary modules, angles it cannot read). A module called with a layer
    type (Gemma 3, Olmo 3) gives each layer the rotation of its ``config.layer_types`` entry."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    module = getattr(decoder, "rotary_emb", None)
    if not isinstance(module, nn.Module):
        found = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1].startswith("rotary")]
        if len(found) != 1:
            return None
        module = found[0]
    if "layer_type" not in inspect.signature(module.forward).parameters:
        one = _rotation(module, head_dim, None)
        return None if one is None else Rotary([one] * n_layers)
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) < n_layers:
        return None
    by_type = {t: _rotation(module, head_dim, t) for t in sorted(set(types[:n_layers]))}
    if any(r is None for r in by_type.values()):
        return None
    return Rotary([by_type[t] for t in types[:n_layers]])


def _rotation(module: nn.Module, head_dim: int, layer_type: str | None) -> Rotation | None:
    """The ``Rotation`` of ``module`` (for ``layer_type``), or None when its angles cannot be read."""
    try:
        probe = Rotation(module, head_dim, layer_type=layer_type)
        cos, _ = probe.cos_sin(torch.arange(1, 3))
    except Exception:  # noqa: BLE001 - a module that is not called (x, position_ids[, layer_type]) -> cos, sin
        return None
    if cos.dim() != 2 or cos.shape[-1] > head_dim:
        return None
    pairing = _pairing(cos)
    return None if pairing is None else Rotation(module, head_dim, pairing, layer_type)


__all__ = ["HALF", "INTERLEAVED", "Rotary", "Rotation", "model_rotary"]
