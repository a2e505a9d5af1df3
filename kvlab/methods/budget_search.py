"""Holding a budget: how long a plan must hold it, what it allows, and the refusal of a plan that cannot.

The engine plans every method through ``planned(comp, n_prompt)``: the method's attention check
(``check_semantics``), its ``plan`` (the knobs for the budget), then ``check_budget``, which refuses
a plan whose ``budget_ratio`` passes 1 + ``TOLERANCE`` with ``BudgetRefused`` naming the smallest
budget the method honours for this prompt (``smallest_budget``, a bisection over fresh copies of the
method planned at other budgets). See docs/design.md §4.
"""

from __future__ import annotations

from kvlab.core.budgets import TOLERANCE, Budget, BudgetRefused, round_up_fraction
from kvlab.methods.base import Compressor


def planned(comp: Compressor, n_prompt: int) -> dict:
    """``comp`` planned for ``n_prompt`` prompt tokens: its knobs. Raises ``UnsupportedAttention`` when
    the method cannot compute the model's attention, ``BudgetRefused`` when its plan does not fit."""
    comp.check_semantics()
    knobs = comp.plan(n_prompt)
    check_budget(comp, n_prompt)
    return knobs


def fits_budget(comp: Compressor, n_prompt: int) -> bool:
    """After ``plan``: whether the plan holds the budget (no budget, or a ratio not predicted, always does)."""
    if comp.is_full:
        return True
    ratio = comp.budget_ratio(n_prompt)
    return ratio is None or ratio <= 1 + TOLERANCE


def check_budget(comp: Compressor, n_prompt: int) -> None:
    """Raise ``BudgetRefused`` (with the smallest budget this method honours here) if the plan does not fit."""
    if not fits_budget(comp, n_prompt):
        assert comp.budget is not None  # no budget always fits
        raise BudgetRefused(comp.name, comp.budget, n_prompt, smallest_budget(comp, n_prompt))


def fits_at(comp: Compressor, budget: Budget, n_prompt: int) -> bool:
    """Whether a fresh copy of ``comp`` (same parameters, seed and horizon) planned at ``budget`` fits it."""
    c = comp.remade(budget)
    c.plan(n_prompt)
    return fits_budget(c, n_prompt)


def smallest_budget(comp: Compressor, n_prompt: int) -> Budget:
    """The smallest budget of the asked kind (fraction, rounded up to two significant decimals; or
    token count) at which ``comp``'s plan fits this prompt."""
    assert comp.budget is not None, f"{comp.name} has no budget"
    if comp.budget.tokens is not None:
        lo, hi = comp.budget.tokens, n_prompt + comp.horizon(n_prompt)
        if not fits_at(comp, Budget(tokens=hi), n_prompt):
            return Budget(fraction=1.0)
        while hi - lo > 1:  # lo never fits, hi always does
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits_at(comp, Budget(tokens=mid), n_prompt) else (mid, hi)
        return Budget(tokens=hi)
    assert comp.budget.fraction is not None
    flo, fhi = comp.budget.fraction, 1.0
    for _ in range(20):
        fmid = (flo + fhi) / 2
        flo, fhi = (flo, fmid) if fits_at(comp, Budget(fraction=fmid), n_prompt) else (fmid, fhi)
    f = round_up_fraction(fhi)
    for _ in range(50):  # a plan's fit is not always monotone in the budget: step up until it fits
        if f >= 1.0 or fits_at(comp, Budget(fraction=f), n_prompt):
            break
        f = round_up_fraction(f * 1.01 + 1e-4)
    return Budget(fraction=min(1.0, f))


__all__ = [
    "check_budget",
    "fits_at",
    "fits_budget",
    "planned",
    "smallest_budget",
]
