"""``METHOD+turboquant``, ``METHOD+polarquant``, ``METHOD+fp8``: an eviction method's kept tokens held
as one of the per-token quantizers codes them, e.g. ``snapkv+turboquant``, ``h2o+fp8``,
``snapkv+polarquant``.

The quantizers and their papers:

* TurboQuant: Zandieh, Daliri, Hadian, Mirrokni. "TurboQuant: Online Vector Quantization with
  Near-optimal Distortion Rate", arXiv:2504.19874 (ICLR 2026), https://arxiv.org/abs/2504.19874
  (``kvlab.methods.turboquant``);
* PolarQuant: Han, Kacham, Karbasi, Mirrokni, Zandieh. "PolarQuant: Quantizing KV Caches with Polar
  Transformation", arXiv:2502.02617, https://arxiv.org/abs/2502.02617 (``kvlab.methods.polarquant``);
* FP8: Micikevicius et al. "FP8 Formats for Deep Learning", arXiv:2209.05433, the e4m3 format
  serving engines store KV caches in (``kvlab.methods.fp8``).

Each codes every key and value token by token, with per-head constants at most
(``kvlab.methods.token_quant``), so what an eviction leaves (any set of single tokens) it holds as it
is: keeping a token keeps its codes, evicting it drops them. The storage holds an instance of the
quantizer itself, with no full-precision window (``residual`` 0), and uses its maths unchanged:

* ``prepare`` on the whole prompt's keys and values, as the quantizer alone does: its per-model state
  (rotations, sketches, codebooks, from the method's seed) and its per-sequence constants (TurboQuant's
  outlier channels, FP8's per-head scales) come from every prompt token, not from the kept ones;
* ``encode`` of the kept prompt tokens, from the prefill's own keys and values (not their cache-dtype
  copy), and of each generated token as it is appended: a kept token's codes are the codes the
  quantizer alone gives that token;
* attention scores the codes directly (``CodedKeys``, a ``ScoredKeys``: the quantizer's
  ``code_logits``): for TurboQuant-prod keys the unbiased estimate
  ||k|| (<Pi q, c[idx]> + sqrt(pi/2)/m gamma <S q, sign(S r)>) of Theorem 2, never a reconstructed key;
  PolarQuant's query rotated once against the dequantized rotated keys; FP8's codes times their scale.
  Values, and the keys where a view of the store asks for them (the inner method's scoring reads
  attention probabilities, not keys), are dequantized by the quantizer's own ``dequantize``.

Bytes: a kept token costs the quantizer's ``token_bytes`` (its codes, norms and per-token scalars, key
and value) plus the inner method's position (and log-weight); the per-head constants held per layer
(TurboQuant's outlier channel indices, FP8's per-head scales) are ``fixed_bytes``, paid for before
tokens. Rotations, sketches and codebooks are per-model state, shown apart (``shared_tensors``).

TurboQuant's bits (``turbo_bits``): when not given, the highest of its settings from 4 down to
``AUTO_FLOOR`` (2.5, the paper's lower KV-cache setting) at which every prompt token fits the budget;
when none does, ``AUTO_FLOOR`` and the inner method keeps as many tokens as the budget pays for.
PolarQuant runs at its paper's 4,2,2,2 bits (3.875 bits per number) and FP8 at 8, so the budget buys
tokens only.

The shared store, storage base and wrapper are in ``composed.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from kernels.tensor_ops import gather_tokens
from kvlab.core.budgets import per_token_bytes
from kvlab.core.semantics import Keys, ScoredKeys
from kvlab.methods.composed import Composition, Storage, TokenStore, composable
from kvlab.methods.dense import DenseCompressor, KeptTokens
from kvlab.methods.fp8 import FP8
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.polarquant import PAPER_BITS, PolarQuant
from kvlab.methods.token_quant import CodedLayer
from kvlab.methods.turboquant import BITS as TURBO_BITS
from kvlab.methods.turboquant import TurboQuant

AUTO_FLOOR = 2.5  # TurboQuant's lowest automatic setting: the paper's 2.5-bit KV cache
Quantizer = TurboQuant | PolarQuant | FP8


def pick_tokens(t: Tensor, idx: Tensor) -> Tensor:
    """Keep tokens ``idx`` [Hkv, m] of a code tensor [Hkv, n, ...] (token dim 1); float8 codes are moved as bytes."""
    if t.dim() == 2:
        return torch.gather(t, 1, idx)
    if t.element_size() == 1 and t.is_floating_point():
        return gather_tokens(t.view(torch.uint8), idx).view(t.dtype)
    return gather_tokens(t, idx)


@dataclass
class CodedKeys(ScoredKeys):
    """A store's coded keys as attention reads them: the quantizer's logits straight from the codes
    (``TokenQuantizer.code_logits``); qg [Hkv, R, d] (grouped, scaled queries) -> [Hkv, R, n] float32."""

    quantizer: Quantizer
    layer: int
    coded: CodedLayer
    d: int

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return torch.Size((self.coded.res_k.shape[0], self.coded.n_coded, self.d))

    def scores(self, qg: Tensor) -> Tensor:
        return self.quantizer.code_logits(self.layer, qg.float(), self.coded)


@dataclass
class CodedDenseLayer(TokenStore):
    """A ``DenseLayer`` look-alike whose keys and values are the quantizer's codes: ``coded`` is the
    quantizer's own per-layer record (codes of every kept token, its per-layer constants, no window)."""

    coded: CodedLayer
    layer: int
    storage: CodedStorage

    def dense_kv(self) -> tuple[Tensor, Tensor]:
        q = self.storage.quantizer
        return q.decoded(self.layer, self.coded, "key"), q.decoded(self.layer, self.coded, "value")

    def read_kv(self) -> tuple[Keys, Tensor]:
        q = self.storage.quantizer
        keys = CodedKeys(q, self.layer, self.coded, self.storage.info.head_dim)
        return keys, q.decoded(self.layer, self.coded, "value")

    def _append_kv(self, k: Tensor, v: Tensor) -> None:
        enc = self.storage.quantizer.encode(slice(self.layer, self.layer + 1), k[None], v[None], [self.coded.extra])
        self.coded.add_codes({name: t[0] for name, t in enc.items()})
        self.coded.n_seen += k.shape[1]

    def _keep_kv(self, idx: Tensor) -> None:
        self.coded.codes = {name: pick_tokens(t, idx) for name, t in self.coded.codes.items()}

    def _kv_tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.coded.codes.items()
        yield from self.coded.extra.items()


class CodedStorage(Storage):
    """A per-token quantizer's codes for a dense method's kept tokens. A subclass names the quantizer
    (``quantizer_class``) and maps its own parameters to the quantizer's (``quantizer_params``); ``fit``
    may choose the quantizer's setting for the budget."""

    quantizer_class: ClassVar[type[TurboQuant] | type[PolarQuant] | type[FP8]]

    def __init__(self, method: DenseCompressor, cfg: dict):
        super().__init__(method, cfg)
        self.quantizer = self.made(self.quantizer_params())
        self.state: PrefillState | None = None

    # ----- what a subclass provides ----------------------------------------------------------
    def quantizer_params(self) -> dict:
        """The quantizer's parameters for the storage's current setting."""
        raise NotImplementedError

    # ----- the quantizer ---------------------------------------------------------------------
    def made(self, params: dict) -> Quantizer:
        """A fresh quantizer with ``params`` and no window, seeded as the method (its draws start anew)."""
        q = self.quantizer_class(self.info, None, {**params, "residual": 0}, seed=self.method.seed)
        self.pick_knobs = q.pick(0)
        return q

    def fit(self, n_prompt: int) -> None:
        self.quantizer = self.made(self.quantizer_params())
        self.quantizer.check_semantics()

    def every_token_fits(self, n_prompt: int) -> bool:
        """Whether the inner method can keep every token the layers hold (the prompt, or a local layer's window;
        counted with a log-weight, as any inner method might hold one) within the budget at the storage's
        current setting. A token-count budget pays for that many tokens of the exact cache."""
        budget, info = self.method.budget, self.info
        if budget is None:
            return True
        # per layer, on average: a local layer holds what its queries see (``reach``)
        held = sum(self.method.reach(i, n_prompt) for i in range(info.n_layers)) / info.n_layers
        kept, target = held, budget.target_bytes(info, n_prompt) / (info.n_layers * info.n_kv_heads)
        if budget.tokens is not None:
            kept, target = min(held, budget.tokens), float(budget.tokens * per_token_bytes(info))
        return kept * self.method.per_token_bytes(with_logw=True) + self.fixed_bytes() <= target

    def kv_bytes(self) -> int:
        return int(self.quantizer.token_bytes())

    def fixed_bytes(self) -> float:
        return self.quantizer.fixed_bytes() / self.info.n_kv_heads

    def knobs(self) -> dict:
        d2 = self.info.head_dim + self.info.v_head_dim
        return {**self.pick_knobs, "bits_per_number": round(8 * self.kv_bytes() / d2, 4)}

    # ----- the stores ------------------------------------------------------------------------
    def prepare(self, state: PrefillState) -> None:
        """The quantizer's state from the whole prompt (fresh draws from the seed, as the quantizer alone)."""
        self.quantizer = self.made(self.quantizer_params())
        self.extra = self.quantizer.prepare(state.keys, state.values)
        self.state = state

    def stored(self, state: PrefillState, layers: list[KeptTokens]) -> list[KeptTokens]:
        try:
            return super().stored(state, layers)
        finally:
            self.state = None  # the prefill is not held past compression

    def store(self, layer: int, dense: KeptTokens) -> TokenStore:
        """The kept prompt tokens' codes, encoded from the prefill's own keys and values at their positions."""
        assert self.state is not None
        pos = dense.positions().long()
        k, v = gather_tokens(self.state.keys[layer], pos), gather_tokens(self.state.values[layer], pos)
        sl = slice(layer, layer + 1)
        enc = self.quantizer.encode(sl, k[None], v[None], self.extra[layer : layer + 1])
        hkv = k.shape[0]
        empty_k, empty_v = k.new_zeros(hkv, 0, k.shape[-1]), v.new_zeros(hkv, 0, v.shape[-1])
        coded = CodedLayer({name: t[0] for name, t in enc.items()}, empty_k, empty_v, dense.n, self.extra[layer])
        return CodedDenseLayer(dense.pos, dense.logw, coded, layer, self)

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The quantizer's per-model state (rotations, sketches, codebooks), shared by every sequence."""
        return self.quantizer.shared_tensors()


class TurboQuantStorage(CodedStorage):
    """TurboQuant: prod keys (b-1 bits + a 1-bit QJL residual) or mse keys, mse values, outlier channels at
    b + 1 bits for a fractional ``turbo_bits``; bits chosen from the budget when not given (module doc)."""

    quantizer_class = TurboQuant
    params = (
        Param(
            "turbo_bits",
            None,
            "TurboQuant's bits per number, 1-4 (a fraction f: f x head_dim outlier channels one bit more); when not "
            f"given the highest from 4 down to {AUTO_FLOOR} at which every prompt token fits the budget",
            choices=TURBO_BITS,
            kind=float,
        ),
        Param(
            "turbo_keys",
            "prod",
            "keys through TurboQuant-prod (b-1 bits + 1-bit QJL residual: unbiased logits) or -mse (b bits)",
            choices=("prod", "mse"),
        ),
    )

    def __init__(self, method: DenseCompressor, cfg: dict):
        given = cfg["turbo_bits"]
        self.bits = float(given) if given is not None else AUTO_FLOOR
        super().__init__(method, cfg)

    def quantizer_params(self) -> dict:
        return {"bits": self.bits, "keys": self.cfg["turbo_keys"]}

    def fit(self, n_prompt: int) -> None:
        """Without ``turbo_bits``: the highest setting (4 down to ``AUTO_FLOOR``) at which every prompt token
        fits; ``AUTO_FLOOR`` when none does (the inner method then evicts)."""
        given = self.cfg["turbo_bits"]
        if given is not None:
            self.bits = float(given)
            return super().fit(n_prompt)
        for bits in [b for b in TURBO_BITS if b >= AUTO_FLOOR]:  # highest first
            self.bits = bits
            super().fit(n_prompt)
            if self.every_token_fits(n_prompt):
                return
        self.bits = AUTO_FLOOR
        super().fit(n_prompt)


class PolarQuantStorage(CodedStorage):
    """PolarQuant: keys and values as 15 angles and one float16 radius per block of 16 (paper: 4,2,2,2 bits)."""

    quantizer_class = PolarQuant
    params = (
        Param(
            "polar_level_bits",
            PAPER_BITS,
            "bits of the angles of each polar level, comma-separated (paper: 4,2,2,2: 3.875 bits per number)",
        ),
        Param("polar_precondition", True, "multiply by a random rotation first (PolarQuant-R; without: PolarQuant)"),
    )

    def quantizer_params(self) -> dict:
        return {"level_bits": self.cfg["polar_level_bits"], "precondition": self.cfg["polar_precondition"]}


class FP8Storage(CodedStorage):
    """FP8: every number as e4m3 (one byte) with per-head (from the prompt's amax) or per-token scales."""

    quantizer_class = FP8
    params = (
        Param(
            "fp8_scales",
            "head",
            "one scale per layer, KV head and tensor (from the prompt's amax) or one per token",
            choices=("head", "token"),
        ),
    )

    def quantizer_params(self) -> dict:
        return {"scales": self.cfg["fp8_scales"]}


@dataclass(frozen=True)
class Kind:
    """One quantizer a composition may hold: its name suffix, title and storage."""

    suffix: str
    title: str
    storage: type[CodedStorage]
    stored_as: str  # how the summary says a kept token is held


KINDS = {
    "turboquant": Kind(
        "+turboquant",
        "TurboQuant",
        TurboQuantStorage,
        "TurboQuant codes (keys: prod, unbiased logits; values: mse; bits from the budget)",
    ),
    "polarquant": Kind(
        "+polarquant", "PolarQuant", PolarQuantStorage, "PolarQuant angles and radii (3.875 bits per number)"
    ),
    "fp8": Kind("+fp8", "FP8", FP8Storage, "e4m3 floats with per-head scales"),
}


def coded(inner: type[DenseCompressor], kind: str) -> Composition:
    """``INNER+KIND`` (``KIND`` in ``KINDS``): ``inner``'s selection, its kept tokens held as that quantizer's codes."""
    k = KINDS[kind]
    return Composition(
        inner,
        f"{inner.name}{k.suffix}",
        title=f"{inner.title} + {k.title}",
        summary=f"{inner.title}'s token selection; kept keys and values stored as {k.stored_as}.",
        own_params=k.storage.params,
        storage=k.storage,
    )


def resolve(name: str, lookup: Callable[[str], Any]) -> Composition | None:
    """``METHOD+turboquant``, ``METHOD+polarquant``, ``METHOD+fp8`` -> the composition; None for any other name."""
    for kind, k in KINDS.items():
        base, sep, rest = name.rpartition(k.suffix)
        if sep and not rest:
            inner = composable(base, lookup)
            return None if inner is None else coded(inner, kind)
    return None


__all__ = [
    "AUTO_FLOOR",
    "KINDS",
    "CodedDenseLayer",
    "CodedKeys",
    "CodedStorage",
    "FP8Storage",
    "PolarQuantStorage",
    "TurboQuantStorage",
    "coded",
    "pick_tokens",
    "resolve",
]
