"""The model's rotary position embedding (RoPE), for methods that reason about queries before RoPE.

Keys and queries reach kvlab post-RoPE (docs/design.md §8). ``Rotary`` is the model's RoPE, layer by
layer: ``layer(i)`` is layer i's ``Rotation``, which turns a vector before RoPE into the one the model
computes at a position, and back. Local and global layers may rotate with different parameters
(Gemma 3, Olmo 3: one module called with the layer's type); ``rotate``/``unrotate`` of a tensor whose
first dimension is the layers apply each layer's own. Angles come from the loaded model's own
rotary-embedding module (``model.model.rotary_emb`` for Llama-like models), called with the
positions, so every scaling type transformers implements (linear, dynamic, YaRN, Llama 3, ...) and
the attention scaling it folds into cos/sin are the model's; complex angles (``torch.polar``: DeepSeek-V2,
Llama 4) are read as the cos and sin of neighbouring pairs. The pairing of dimensions is read from
the angles: the first half with the second (Llama's ``rotate_half``) or neighbours (GPT-J's
interleaved pairs). Partial rotary embeddings rotate the first dimensions, multi-head latent attention
the last ones (after its unrotated part); which, and the pairing, are checked against the model's own
keys of one token at two positions (``SameToken``). A layer whose attention applies no RoPE (Llama 4,
SmolLM3) has none. ``Rotary.factor_switches`` finds the sequence lengths where the angles of every
position change (Phi-3's longrope), which a run must not cross.

``ModelInfo.rope`` is None on a model whose rotary embedding kvlab cannot read (none, several
modules, angles in another form, a placement its keys contradict); a method that needs it refuses
such a model in ``check_semantics``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

HALF = "half"  # dimension i pairs with i + r/2 (Llama, Mistral, Qwen, Gemma, Phi-3...)
INTERLEAVED = "interleaved"  # dimension 2i pairs with 2i + 1 (GPT-J style)


class Rotation:
    """One layer's RoPE as the model applies it: ``rotate`` (pre-RoPE -> post-RoPE), ``unrotate`` (the inverse).

    ``module(x, position_ids)`` (or ``module(x, position_ids, layer_type)`` when ``layer_type`` is given)
    is the model's rotary embedding, returning cos, sin [1, P, r] for r rotated dimensions (r <= head_dim),
    or complex angles [1, P, r/2] (``torch.polar``: DeepSeek-V2, Llama 4), which rotate neighbouring pairs;
    ``pairing`` is ``HALF`` or ``INTERLEAVED``; ``offset``: the first rotated dimension (the rotated ones are
    ``offset .. offset + r - 1``: 0 on most models, the dimensions after the unrotated part in multi-head
    latent attention, DeepSeek-V2/V3).
    """

    def __init__(
        self,
        module: nn.Module,
        head_dim: int,
        pairing: str = HALF,
        layer_type: str | None = None,
        offset: int = 0,
    ):
        if pairing not in (HALF, INTERLEAVED):
            raise ValueError(f"unknown RoPE pairing {pairing!r}; allowed: {HALF}, {INTERLEAVED}")
        self.module, self.head_dim, self.pairing, self.layer_type = module, head_dim, pairing, layer_type
        self.offset = offset

    def __deepcopy__(self, memo: dict) -> Rotation:
        return self  # the model's own module: every copy of a ModelInfo shares it

    def placed(self, pairing: str, offset: int) -> Rotation:
        """The same module's angles, with another pairing or first rotated dimension."""
        return Rotation(self.module, self.head_dim, pairing, self.layer_type, offset)

    @property
    def device(self) -> torch.device:
        buf = next(iter(self.module.buffers()), None)
        return buf.device if buf is not None else torch.device("cpu")

    @torch.no_grad()
    def cos_sin(self, positions: Tensor, length: int | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin [P, r] float32 of the positions [P] (the model's angles, attention scaling included).

        ``length``: the angles of a sequence of that many tokens (a RoPE whose factors depend on the sequence
        length, Phi-3's longrope, picks them by the largest position it is called with); None: of a sequence
        that ends at the largest of ``positions``."""
        return angles(self.module, positions, length, self.layer_type, self.device)

    def _turn(self, x: Tensor) -> Tensor:
        """The quarter turn of each pair: (a, b) -> (-b, a)."""
        if self.pairing == HALF:
            h = x.shape[-1] // 2
            return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def _apply(self, x: Tensor, positions: Tensor, inverse: bool, length: int | None) -> Tensor:
        cos, sin = (t.to(x.device) for t in self.cos_sin(positions, length))
        lo, hi = self.offset, self.offset + cos.shape[-1]
        head = x[..., lo:hi].float()
        if inverse:  # (C - S J) / (C^2 + S^2) undoes C + S J (C, S equal on both members of a pair)
            out = (head * cos - self._turn(head) * sin) / (cos * cos + sin * sin)
        else:
            out = head * cos + self._turn(head) * sin
        out = out.to(x.dtype)
        parts = [p for p in (x[..., :lo], out, x[..., hi:]) if p.shape[-1]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def rotate(self, x: Tensor, positions: Tensor, length: int | None = None) -> Tensor:
        """x [..., P, d] before RoPE at ``positions`` [P] -> as the model rotates it (x's dtype); ``length``
        as in ``cos_sin``."""
        return self._apply(x, positions, False, length)

    def unrotate(self, x: Tensor, positions: Tensor, length: int | None = None) -> Tensor:
        """x [..., P, d] after RoPE at ``positions`` [P] -> before it (the inverse of ``rotate``)."""
        return self._apply(x, positions, True, length)


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

    def factor_switches(self, longest: int) -> tuple[int, ...]:
        """The sequence lengths L < ``longest`` past which the model's RoPE changes the angles of positions it
        has already rotated (between L and L + 1 tokens; Phi-3's longrope: ``original_max_position_embeddings``),
        over every layer's rotation, ascending; () when the angles never depend on the sequence length."""
        found: set[int] = set()
        for r in {id(r): r for r in self.layers if r is not None}.values():
            found.update(_switches(r, longest))
        return tuple(sorted(found))


@torch.no_grad()
def angles(
    module: nn.Module, positions: Tensor, length: int | None, layer_type: str | None, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos, sin [P, r] float32 that ``module`` (a model's rotary embedding) gives ``positions`` [P] in a sequence
    of ``length`` tokens (None: ending at the largest position): the module is called with position ``length
    - 1`` too. Complex angles [.., P, r/2] (``torch.polar``) become the cos and sin of each neighbouring pair."""
    x = torch.zeros(1, dtype=torch.float32, device=device)
    pos = positions.reshape(-1).to(device)
    p = pos.numel()
    if length is not None and (p == 0 or int(pos.max()) != length - 1):
        pos = torch.cat([pos, torch.tensor([length - 1], dtype=pos.dtype, device=device)])
    ids = pos.reshape(1, -1)
    out = module(x, ids) if layer_type is None else module(x, ids, layer_type)
    if isinstance(out, Tensor):
        if not out.is_complex():
            raise TypeError("a rotary embedding returning one real tensor")
        z = out.reshape(-1, *out.shape[-2:])[0, :p]
        return z.real.float().repeat_interleave(2, -1), z.imag.float().repeat_interleave(2, -1)
    cos, sin = out
    return cos.reshape(-1, *cos.shape[-2:])[0, :p].float(), sin.reshape(-1, *sin.shape[-2:])[0, :p].float()


def _switches(rotation: Rotation, longest: int, most: int = 8) -> list[int]:
    """``Rotary.factor_switches`` of one rotation, found by bisection on a copy of its module (a module whose
    factors depend on the length keeps state, which the model's own calls must not inherit)."""
    module = copy.deepcopy(rotation.module)
    one = torch.ones(1, dtype=torch.long)

    def at(length: int) -> Tensor:
        return torch.cat(angles(module, one, length, rotation.layer_type, rotation.device), -1).cpu()

    def same(a: Tensor, b: Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-7)

    found: list[int] = []
    lo, end = 2, at(longest)
    while lo < longest and len(found) < most:
        ref = at(lo)
        if same(ref, end):
            break
        a, b = lo, longest  # at(a) is ref, at(b) is not
        while b - a > 1:
            m = (a + b) // 2
            a, b = (m, b) if same(at(m), ref) else (a, m)
        found.append(a)
        lo = b
    return found


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


@dataclass(frozen=True)
class SameToken:
    """One token's keys at two positions in the model's first layer (whose input is the token alone, so the
    keys differ by RoPE only): ``first`` / ``second`` [.., d] at ``positions`` in a sequence of ``length``
    tokens. ``model_rotary`` checks the rotation it reads against them."""

    first: Tensor
    second: Tensor
    positions: tuple[int, int]
    length: int


def model_rotary(model: nn.Module, head_dim: int, n_layers: int, sample: SameToken | None = None) -> Rotary | None:
    """The ``Rotary`` of a loaded causal LM's ``n_layers`` layers, or None when it has no rotary embedding
    kvlab can read (none, several rotary modules, angles it cannot read, a placement its keys contradict).

    A module called with a layer type (Gemma 3, Olmo 3) gives each layer the rotation of its
    ``config.layer_types`` entry; a layer whose attention applies no RoPE (``use_rope`` off, or
    ``config.no_rope_layers``: Llama 4, SmolLM3) gets None. Which dimensions are rotated (the first ones, or
    those after multi-head latent attention's unrotated part) and how they pair are checked against
    ``sample`` (the first layer's keys of one token at two positions) when given: the placement that turns
    one into the other is kept, and a rotation none reproduces is not read."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    module = getattr(decoder, "rotary_emb", None)
    if not isinstance(module, nn.Module):
        found = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1].startswith("rotary")]
        if len(found) != 1:
            return None
        module = found[0]
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    if "layer_type" not in inspect.signature(module.forward).parameters:
        one = _rotation(module, head_dim, None)
        if one is None:
            return None
        rotations: list[Rotation | None] = [one] * n_layers
    else:
        types = list(getattr(text, "layer_types", None) or [])
        if len(types) < n_layers:
            return None
        by_type = {t: _rotation(module, head_dim, t) for t in sorted(set(types[:n_layers]))}
        if any(r is None for r in by_type.values()):
            return None
        rotations = [by_type[t] for t in types[:n_layers]]
    without = _rope_free_layers(model, text, n_layers)
    rotations = [None if i in without else r for i, r in enumerate(rotations)]
    if all(r is None for r in rotations):
        return None
    placed = _placement(rotations, head_dim, text, sample if 0 not in without else None)
    if placed is None:
        return None
    moved = {id(r): r.placed(*placed) for r in rotations if r is not None}  # one object per distinct rotation
    return Rotary([None if r is None else moved[id(r)] for r in rotations])


def _rope_free_layers(model: nn.Module, config, n_layers: int) -> set[int]:
    """Layers whose attention applies no RoPE: an attention module with ``use_rope`` off, or a 0 in
    ``config.no_rope_layers`` (Llama 4, SmolLM3: 1 marks a layer with RoPE)."""
    out = set()
    for m in model.modules():
        layer = getattr(m, "layer_idx", None)
        if isinstance(layer, int) and layer < n_layers and getattr(m, "use_rope", True) in (False, 0):
            out.add(layer)
    flags = getattr(config, "no_rope_layers", None)
    if isinstance(flags, (list, tuple)):
        out.update(i for i, f in enumerate(flags[:n_layers]) if not f)
    return out


def _placement(
    rotations: Sequence[Rotation | None], head_dim: int, config, sample: SameToken | None
) -> tuple[str, int] | None:
    """(pairing, first rotated dimension) of the model's rotations: the one that turns ``sample.first`` into
    ``sample.second`` (None: none does), or without a sample the pairing read from the angles and the first
    dimensions (those after ``qk_nope_head_dim`` where the config splits the key head so)."""
    first = next(r for r in rotations if r is not None)
    r = first.cos_sin(torch.arange(1, 3))[0].shape[-1]
    nope = getattr(config, "qk_nope_head_dim", None)
    start = nope if isinstance(nope, int) and nope + r == head_dim else 0
    if sample is None:
        return first.pairing, start
    offsets = dict.fromkeys([start, 0, head_dim - r])
    pairings = dict.fromkeys([first.pairing, HALF, INTERLEAVED])
    a, b = sample.positions
    pa, pb = torch.tensor([a]), torch.tensor([b])
    scale = float(sample.second.float().abs().max().clamp_min(1e-6))
    best: tuple[float, tuple[str, int]] | None = None
    for off in offsets:
        for pairing in pairings:
            rot = first.placed(pairing, off)
            pre = rot.unrotate(sample.first.float().unsqueeze(-2), pa, sample.length)
            err = float((rot.rotate(pre, pb, sample.length).squeeze(-2) - sample.second.float()).abs().max()) / scale
            if best is None or err < best[0]:
                best = (err, (pairing, off))
    assert best is not None
    return best[1] if best[0] <= SAMPLE_TOLERANCE else None


SAMPLE_TOLERANCE = 2e-2  # largest |difference| / largest |key| of a rotation read against the model's keys (16-bit)


def _rotation(module: nn.Module, head_dim: int, layer_type: str | None) -> Rotation | None:
    """The ``Rotation`` of ``module`` (for ``layer_type``), or None when its angles cannot be read."""
    probe = Rotation(module, head_dim, layer_type=layer_type)
    x, ids = torch.zeros(1, device=probe.device), torch.arange(1, 3, device=probe.device).reshape(1, -1)
    try:
        raw = module(x, ids) if layer_type is None else module(x, ids, layer_type)
        cos, _ = probe.cos_sin(torch.arange(1, 3))
    except Exception:  # noqa: BLE001 - a module that is not called (x, position_ids[, layer_type]) -> angles
        return None
    if cos.dim() != 2 or cos.shape[-1] > head_dim:
        return None
    pairing = INTERLEAVED if isinstance(raw, Tensor) else _pairing(cos)  # complex angles pair neighbours
    return None if pairing is None else Rotation(module, head_dim, pairing, layer_type)


__all__ = ["HALF", "INTERLEAVED", "Rotary", "Rotation", "SameToken", "angles", "model_rotary"]
