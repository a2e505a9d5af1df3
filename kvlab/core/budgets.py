"""Memory budgets: a fraction of the exact cache's bytes, or a token count.

A budget is parsed from text (``"0.25"`` or ``"512t"``) and resolved against a prompt length into
a byte target. Each compressor maps the byte target onto its own knobs (see ``Compressor.plan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.core.model import ModelInfo

TOLERANCE = 0.05  # bytes held may exceed what a budget allows by this share (kvlab.measure.health, plan checks)


class BudgetError(ValueError):
    pass


class BudgetRefused(BudgetError):
    """A method cannot hold ``budget`` on an ``n_prompt``-token prompt, even at its most degraded setting.

    ``smallest`` is the smallest budget of the same kind (a fraction, or a token count) it can honour
    there (``Compressor.plan`` finds it); asking again at that budget is not refused.
    """

    def __init__(self, method: str, budget: Budget, n_prompt: int, smallest: Budget):
        self.method, self.budget, self.n_prompt, self.smallest = method, budget, n_prompt, smallest
        super().__init__(
            f"{method} cannot fit budget {budget.label} on a {n_prompt}-token prompt; "
            f"the smallest budget it can honour here is {smallest.label}"
        )


@dataclass(frozen=True)
class Budget:
    """Either ``fraction`` in (0, 1] of the exact bytes, or ``tokens`` kept per head and layer."""

    fraction: float | None = None
    tokens: int | None = None

    @classmethod
    def parse(cls, text: Budget | str | float | int) -> Budget:
        if isinstance(text, Budget):
            return text
        s = str(text).strip().lower()
        allowed = "a fraction in (0, 1] such as 0.25, or a token count such as 512t"
        if not s:
            raise BudgetError(f"empty budget; allowed: {allowed}")
        if s.endswith("t"):
            try:
                n = int(s[:-1])
            except ValueError:
                raise BudgetError(f"budget {text!r} is not valid; allowed: {allowed}") from None
            if n < 1:
                raise BudgetError(f"budget {text!r} must keep at least one token; allowed: {allowed}")
            return cls(tokens=n)
        try:
            f = float(s)
        except ValueError:
            raise BudgetError(f"budget {text!r} is not valid; allowed: {allowed}") from None
        if not 0.0 < f <= 1.0:
            raise BudgetError(f"budget {text!r} is outside (0, 1]; allowed: {allowed}")
        return cls(fraction=f)

    @property
    def label(self) -> str:
        return f"{self.tokens}t" if self.tokens is not None else f"{self.fraction:g}"

    @property
    def is_full(self) -> bool:
        return self.fraction is not None and self.fraction >= 1.0

    def fraction_of(self, n_tokens: int) -> float:
        """The budget as a fraction of the exact cache of ``n_tokens`` tokens (capped at 1)."""
        if self.tokens is not None:
            return min(1.0, self.tokens / max(1, n_tokens))
        return float(self.as_fraction)

    def target_bytes(self, info: ModelInfo, n_tokens: int) -> int:
        return int(self.fraction_of(n_tokens) * exact_bytes(info, n_tokens))

    def allowed_bytes(self, info: ModelInfo, n_prompt: int, steps: int, streaming: bool) -> float:
        """Bytes a run may hold after ``steps`` decode steps (docs/design.md, budgets).

        A streaming method holds the budget's share of every token seen (a token budget: that many
        tokens' worth); a prefill-only method its share of the prompt plus its generated tokens in full.
        """
        now = exact_bytes(info, n_prompt + steps)
        if streaming:
            return self.fraction_of(n_prompt + steps) * now
        prompt = exact_bytes(info, n_prompt)
        return self.fraction_of(n_prompt) * prompt + (now - prompt)

    def allowed_per_step(self, info: ModelInfo, n_prompt: int, steps: int, streaming: bool) -> Tensor:
        """``allowed_bytes`` after 0, 1, .., ``steps`` decode steps: float64 [steps + 1] (at least 1 each)."""
        seen = n_prompt + torch.arange(steps + 1, dtype=torch.float64)
        spans = [s.span for s in info.semantics.layers]
        held = torch.zeros_like(seen)
        for sp in spans:
            held += seen if sp is None else seen.clamp(max=sp)
        now = held * per_token_bytes(info) * info.n_kv_heads
        if streaming:
            share = (
                (self.tokens / seen).clamp(max=1.0)
                if self.tokens is not None
                else torch.full_like(seen, self.as_fraction)
            )
            return (share * now).clamp(min=1.0)
        prompt = float(exact_bytes(info, n_prompt))
        return (self.fraction_of(n_prompt) * prompt + (now - prompt)).clamp(min=1.0)

    def token_budget(self, n_tokens: int) -> int:
        """Tokens per layer and KV head a full-precision eviction cache may keep (before overheads)."""
        if self.tokens is not None:
            return min(self.tokens, n_tokens)
        return max(1, min(n_tokens, int(self.as_fraction * n_tokens)))

    @property
    def as_fraction(self) -> float:
        """``fraction``, of a budget that is not a token count (``fraction_of``: either kind)."""
        if self.fraction is None:
            raise BudgetError(f"{self!r} is not a fraction of the exact cache")
        return self.fraction


def prefill_only_peak(budget: Budget, n_prompt: int, new_tokens: int) -> float:
    """How many times its budget's share of the exact cache's peak a prefill-only method peaks at, when it
    keeps its share of ``n_prompt`` prompt tokens and ``new_tokens`` later ones whole (overheads left out):
    (f n + T) / (f (n + T)), f the budget's fraction of the prompt. 1 for a full budget."""
    f = budget.fraction_of(n_prompt)
    return (f * n_prompt + new_tokens) / (f * (n_prompt + new_tokens)) if f < 1 else 1.0


def round_up_fraction(f: float) -> float:
    """``f`` rounded up to two significant decimals (0.3012 -> 0.31, 0.0123 -> 0.013), at most 1."""
    if f >= 1.0:
        return 1.0
    places = max(2, 1 - math.floor(math.log10(max(f, 1e-9))))
    return min(1.0, math.ceil(f * 10**places - 1e-9) / 10**places)


def parse_budgets(text: str) -> list[Budget]:
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise BudgetError("no budget given; allowed: a fraction in (0, 1] such as 0.25, or a token count such as 512t")
    return [Budget.parse(p) for p in parts]


def exact_bytes(info: ModelInfo, n_tokens: int) -> int:
    """Bytes the exact cache holds: KV heads x (key + value head sizes) x dtype size x the tokens each
    layer holds, summed over layers (a sliding-window layer holds at most its window)."""
    return info.n_kv_heads * info.held_tokens(n_tokens) * (info.head_dim + info.v_head_dim) * info.dtype_bytes


def per_token_bytes(info: ModelInfo) -> int:
    """Exact-cache bytes of one token in one layer and KV head (K and V)."""
    return (info.head_dim + info.v_head_dim) * info.dtype_bytes
