"""The compressor contract: what every KV-cache method implements, and the dense store most share.

A compressor is one method at one budget for one run. The engine calls, in order:

1. ``plan(n_prompt)`` — map the budget onto the method's knobs (returned, and shown with results);
   when even the method's most degraded setting cannot hold the budget for this prompt, ``plan``
   raises ``BudgetRefused`` naming the smallest budget it can honour (see ``Compressor.check_budget``);
2. ``compress(state)`` — build the compressed cache from the shared exact prefill (all layers at
   once: ``state.keys`` is ``[L, Hkv, n, d]``);
3. per decode step and layer: ``append(layer, k, v, pos)`` with the new token's key/value
   ``[Hkv, 1, d]`` (post-RoPE), then ``attend(layer, q)`` with the query ``[Hq, 1, d]``, returning
   the attention output ``[Hq, 1, d]``. Streaming methods evict inside these calls.
   A question asked after compression (the query-agnostic protocol) comes as one chunk of c
   tokens per layer: ``feed(layer, q, k, v, pos)`` (q ``[Hq, c, d]``, k/v ``[Hkv, c, d]`` at true
   positions pos..pos+c-1) returns ``[Hq, c, d]``, exactly what feeding the c tokens one by one
   through ``append`` + ``attend`` gives (the default does just that).
4. ``tensors()`` at any time lists every tensor the method holds; bytes are counted from them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvlab import semantics as sm
from kvlab.budgets import TOLERANCE, Budget, BudgetRefused, round_up_fraction
from kvlab.models import ModelInfo
from kvlab.ops import causal_window_probs, tensor_bytes
from kvlab.semantics import ModelSemantics


def _bytes_by_kind(tensors: Iterator[tuple[str, Tensor]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, t in tensors:
        out[kind] = out.get(kind, 0) + tensor_bytes(t)
    return out


class ParamError(ValueError):
    pass


@dataclass(frozen=True)
class Param:
    """One knob of a method: its paper name, default and meaning."""

    name: str
    default: Any
    help: str
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    kind: type | None = None  # the value's type when the default (e.g. None: "from the budget") does not say it

    def coerce(self, method: str, value: Any) -> Any:
        """``value`` as this knob's type, checked against its choices and range (ParamError if not).

        A knob whose default is None ("chosen from the budget") also takes "", "none" or None back."""
        if self.default is None and (value is None or str(value).strip().lower() in ("", "none", "auto")):
            return None
        kind = self.kind or type(self.default)
        try:
            if kind is bool:
                v = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
            elif kind is int:
                fv = float(value)
                if fv != int(fv):
                    raise ValueError
                v = int(fv)
            elif kind is float:
                v = float(value)
            else:
                v = value if self.default is None else kind(value)
        except (TypeError, ValueError):
            raise ParamError(f"{method}: parameter {self.name}={value!r} must be {kind.__name__}") from None
        if self.choices is not None and v not in self.choices:
            raise ParamError(f"{method}: parameter {self.name}={v!r} is not one of {', '.join(map(str, self.choices))}")
        if self.minimum is not None and v < self.minimum or self.maximum is not None and v > self.maximum:
            raise ParamError(f"{method}: parameter {self.name}={v!r} must be in [{self.minimum}, {self.maximum}]")
        return v


@dataclass
class PrefillState:
    """What one exact prefill hands to every compressor.

    keys, values: [L, Hkv, n, d] post-RoPE; queries: [L, Hq, w, d], the last w prompt queries
    (post-RoPE); acc_attn: [L, Hq, n] attention each key received summed over all prompt queries
    (only when a method asked for it).
    """

    keys: Tensor
    values: Tensor
    queries: Tensor
    scaling: float
    acc_attn: Tensor | None = None
    semantics: ModelSemantics | None = None  # per layer: window, soft-cap, sinks (None: plain attention)

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[-2]

    def window_probs(self, w: int | None = None) -> Tensor:
        """Causal attention of the last ``w`` prompt queries over the prompt: [L, Hq, w, n]."""
        q = self.queries if w is None else self.queries[..., -w:, :]
        return causal_window_probs(q, self.keys, self.semantics or self.scaling)


DEFAULT_HORIZON = 4096  # decode steps a plan holds its budget for when the engine did not say (max_new_tokens' cap)


def _budget_checked(plan):
    """``plan`` followed by ``check_budget`` (once, in the outermost ``plan`` of a ``super().plan()`` chain)."""

    @functools.wraps(plan)
    def checked(self, n_prompt: int) -> dict:
        if getattr(self, "_planning", False):
            return plan(self, n_prompt)
        self.check_semantics()
        self._planning = True
        try:
            knobs = plan(self, n_prompt)
        finally:
            self._planning = False
        self.check_budget(n_prompt)
        return knobs

    return checked


class Compressor:
    """Base class of every method. Subclasses set the class attributes and override the hooks.

    Every subclass's ``plan`` is wrapped so that, once it has chosen the knobs, ``check_budget``
    refuses a plan that cannot hold the budget (``budget_ratio`` above 1 + ``TOLERANCE``).
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    group: ClassVar[str] = "baseline"  # "paper" for the four papers' methods, "reference" for exact
    paper: ClassVar[str] = ""  # citation with link
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()
    streaming: ClassVar[bool] = False  # holds its budget while decoding (else generated tokens are kept)
    needs_acc_attn: ClassVar[bool] = False

    decode_steps: int | None = None  # decode steps the plan must hold its budget for (the engine sets it)
    # why this method cannot hold a sliding-window layer ("" : it can; it is then refused on such models)
    no_local_layers: ClassVar[str] = ""
    # why this method needs values of the key's head size ("": it does not; refused on models where they differ)
    no_value_head_size: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "plan" in cls.__dict__:
            cls.plan = _budget_checked(cls.__dict__["plan"])

    def __init__(self, info: ModelInfo, budget: Budget | None = None, params: dict | None = None, seed: int = 0):
        self.info = info
        self.budget = budget
        self.params_given = dict(params or {})
        self.cfg = self.resolve_params(params or {})
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.sem = info.semantics  # per layer: scaling, window, soft-cap, sinks (``kvlab.semantics``)
        self.scaling = self.sem[0].scaling
        self.cache_dtype = info.torch_cache_dtype  # full-precision K/V are stored in this (16-bit by default)

    @property
    def is_full(self) -> bool:
        """No budget, or a budget of the whole exact cache: the method keeps everything."""
        return self.budget is None or self.budget.is_full

    def as_cached(self, x: Tensor) -> Tensor:
        """``x`` as the cache stores full-precision keys and values: contiguous, in the cache dtype."""
        return x.to(self.cache_dtype).contiguous()

    # ----- configuration -------------------------------------------------------------------
    @classmethod
    def defaults(cls) -> dict:
        return {p.name: p.default for p in cls.params}

    @classmethod
    def resolve_params(cls, overrides: dict) -> dict:
        known = {p.name: p for p in cls.params}
        out = cls.defaults()
        for k, v in overrides.items():
            if k not in known:
                allowed = ", ".join(known) or "none"
                raise ParamError(f"{cls.name}: unknown parameter {k!r}; allowed: {allowed}")
            out[k] = known[k].coerce(cls.name, v) if v is not None else None
        return out

    def query_window(self) -> int:
        """How many of the prompt's last queries ``compress`` needs (0: none)."""
        return 0

    def window_observer(self, n_prompt: int):
        """An ``attention.WindowObserver`` that reads the prefill's attention of the last prompt
        queries as the prefill computes it (so ``compress`` need not recompute it); None: none."""
        return None

    def plan(self, n_prompt: int) -> dict:
        """Map the budget onto knobs (updating ``self.cfg``); return the knobs chosen.

        A method degrades its knobs (smaller window, sketch, ...) until the plan fits the budget;
        what cannot fit even then is refused (``BudgetRefused``, raised by ``check_budget``)."""
        return {}

    def check_semantics(self) -> None:
        """Raise ``UnsupportedAttention`` (one line) when this method cannot compute the model's attention."""
        if self.no_local_layers and self.sem.has_local:
            raise sm.UnsupportedAttention(
                f"{self.name} cannot run on a model with sliding-window layers: {self.no_local_layers}"
            )
        if self.no_value_head_size and self.sem.v_dim != self.sem[0].k_dim:
            raise sm.UnsupportedAttention(
                f"{self.name} cannot run on a model whose value heads differ in size from its key heads: "
                f"{self.no_value_head_size}"
            )

    # ----- holding the budget ---------------------------------------------------------------
    def horizon(self, n_prompt: int) -> int:
        """Decode steps the plan must hold its budget for: ``decode_steps``, else up to the model's context."""
        steps = DEFAULT_HORIZON if self.decode_steps is None else self.decode_steps
        return max(0, min(steps, self.info.max_positions - n_prompt))

    def allowed(self, n_prompt: int, steps: int = 0) -> float:
        """Bytes the budget allows after ``steps`` decode steps (``Budget.allowed_bytes``)."""
        return self.budget.allowed_bytes(self.info, n_prompt, steps, self.streaming)

    def budget_ratio(self, n_prompt: int) -> float | None:
        """After ``plan``: the largest ratio of the bytes the plan will hold to the bytes its budget
        allows, after prefill and at any decode step up to ``horizon`` (None: not predicted)."""
        return None

    def fits_budget(self, n_prompt: int) -> bool:
        if self.is_full:
            return True
        ratio = self.budget_ratio(n_prompt)
        return ratio is None or ratio <= 1 + TOLERANCE

    def check_budget(self, n_prompt: int) -> None:
        """Raise ``BudgetRefused`` (with the smallest budget this method honours here) if the plan does not fit."""
        if not self.fits_budget(n_prompt):
            raise BudgetRefused(self.name, self.budget, n_prompt, self.smallest_budget(n_prompt))

    def _fits_at(self, budget: Budget, n_prompt: int) -> bool:
        """Whether a fresh copy of this method (same parameters) planned at ``budget`` fits it."""
        c = type(self)(self.info, budget, self.params_given, seed=self.seed)
        c.decode_steps, c._planning = self.decode_steps, True  # plan without the check (no recursion)
        c.plan(n_prompt)
        return c.fits_budget(n_prompt)

    def smallest_budget(self, n_prompt: int) -> Budget:
        """The smallest budget of the asked kind (fraction, rounded up to two significant decimals; or
        token count) at which this method's plan fits this prompt."""
        if self.budget.tokens is not None:
            lo, hi = self.budget.tokens, n_prompt + self.horizon(n_prompt)
            if not self._fits_at(Budget(tokens=hi), n_prompt):
                return Budget(fraction=1.0)
            while hi - lo > 1:  # lo never fits, hi always does
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._fits_at(Budget(tokens=mid), n_prompt) else (mid, hi)
            return Budget(tokens=hi)
        lo, hi = self.budget.fraction, 1.0
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self._fits_at(Budget(fraction=mid), n_prompt) else (mid, hi)
        f = round_up_fraction(hi)
        for _ in range(50):  # a plan's fit is not always monotone in the budget: step up until it fits
            if f >= 1.0 or self._fits_at(Budget(fraction=f), n_prompt):
                break
            f = round_up_fraction(f * 1.01 + 1e-4)
        return Budget(fraction=min(1.0, f))

    # ----- the cache ----------------------------------------------------------------------
    def compress(self, state: PrefillState) -> None:
        raise NotImplementedError

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        raise NotImplementedError

    def attend(self, layer: int, q: Tensor) -> Tensor:
        raise NotImplementedError

    wants_probs: bool = False  # hand this step's attention to ``after_attend`` (dense caches)

    def after_attend(self, layer: int, probs: Tensor) -> None:
        """Hook for streaming eviction: ``probs`` [Hq, 1, n] is this step's attention over the cache."""

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c new tokens, causal inside the chunk: q [Hq, c, d], k/v [Hkv, c, d] -> out [Hq, c, d].

        Token i is appended at true position ``pos + i``, then its query attends: the same calls, in
        the same order, as c decode steps, so streaming eviction and running scores stay exact.
        """
        outs = []
        for i in range(q.shape[-2]):
            self.append(layer, k[:, i : i + 1], v[:, i : i + 1], pos + i)
            outs.append(self.attend(layer, q[:, i : i + 1]))
        return torch.cat(outs, dim=-2)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor this cache holds, as (kind, tensor); bytes are counted from these."""
        raise NotImplementedError

    def kept_positions(self, layer: int) -> Tensor | None:
        """Token positions this layer keeps at full resolution, [Hkv, n] (None if not position-based)."""
        return None

    # ----- measurement --------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for _, t in self.tensors())

    def nbytes_by_kind(self) -> dict[str, int]:
        return _bytes_by_kind(self.tensors())

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Per-model state that one copy of serves every sequence (QJL's random sketches), as (kind, tensor).

        Not part of ``tensors``/``nbytes`` (the bytes a sequence holds) unless the method is told to count
        it per sequence; shown apart as "shared across sequences"."""
        return iter(())

    def shared_nbytes_by_kind(self) -> dict[str, int]:
        return _bytes_by_kind(self.shared_tensors())

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """The method's own attention weights for one query, by token position (for the attention maps).

        q [Hq, 1, d] (post-RoPE). Returns [Hq, n] over positions 0..n-1 (every token seen so far; 0
        where nothing stands for a position), each row summing to 1; None when the cache has no
        per-token estimate.
        """
        return None


__all__ = ["Compressor", "Param", "ParamError", "PrefillState"]
