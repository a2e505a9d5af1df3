"""The tests a row applies, each with the smallest n at which it can pass.

* ``direction_row``: is ``a`` above ``b`` on the same prompts? ``kvlab.core.statistics.paired_difference``
  (the exact McNemar test for right-or-wrong scores, the paired t interval or bootstrap otherwise): holds
  where the paired interval of a - b lies above zero, does not hold where it lies below, inconclusive
  otherwise. It can pass from 6 prompts for right-or-wrong scores (all six differing one way), 2 otherwise.
* ``bound_row``: does an estimate lie below (or above) a limit? Holds where its whole interval is on the
  claimed side, does not hold where it is wholly on the other, inconclusive where it reaches the limit or
  there is no interval.

A row whose n is below the test's smallest n is "inconclusive by design" (``Row`` says so).
"""

from __future__ import annotations

from kvlab.core.statistics import (
    MIN_N_CONTINUOUS,
    Estimate,
    is_binary,
    min_n_mcnemar,
    min_n_paired_within,
    paired_difference,
)
from kvlab.reproduce.common import CLAIM, CONTEXT, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Row, estimate_fields


def spread(est: Estimate | None) -> dict:
    """``Row`` keywords n and interval of ``est``, and (in ``note``) why it has no interval where it has none."""
    out = estimate_fields(est)
    if est is not None and est.low is None and est.note:
        out["note"] = est.note
    return out


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def direction_row(
    setting: str,
    paper: str,
    a: list[float],
    b: list[float],
    names: tuple[str, str],
    claim: str,
    kind: str = CLAIM,
    model: str = "",
    scale: float = 1.0,
    note: str = "",
    lead: str = "",
) -> Row:
    """``names[0]`` above ``names[1]``, paired over the same prompts (``a``, ``b``): a row of ``kind`` under
    ``claim``. ``lead`` comes before the measured difference in the kvlab column; ``scale`` prints it (e.g.
    100 for points)."""
    d = paired_difference(a, b, names=names)
    assert d is not None, "a paired row needs prompts"
    binary = is_binary(a, b)
    min_n = min_n_mcnemar() if binary else MIN_N_CONTINUOUS
    est = d.difference
    measured = _join(lead, f"{names[0]} - {names[1]} {est.text(scale, 3)}")
    fields = spread(est)
    why = fields.pop("note", "")
    if d.verdict == f"{names[0]} higher":
        verdict = HOLDS
    elif d.verdict == f"{names[1]} higher":
        verdict = DOES_NOT_HOLD
    else:
        verdict = INCONCLUSIVE
    test = "exact McNemar" if binary else ("paired t" if est.method == "student-t" else "paired bootstrap")
    if kind == CONTEXT:  # no verdict: what the data say goes in the note
        test = f"{test}: {d.verdict}"
    return Row(
        setting,
        paper,
        measured,
        verdict=verdict,
        kind=kind,
        note=_join(note, why, test),
        claim=claim,
        model=model,
        min_n=min_n,
        **fields,
    )


def bound_row(
    setting: str,
    paper: str,
    est: Estimate | None,
    limit: float,
    below: bool,
    claim: str,
    kind: str = CLAIM,
    model: str = "",
    measured: str = "",
    note: str = "",
    min_n: int | None = None,
    what: str = "",
) -> Row:
    """``est`` wholly below ``limit`` (``below``) or wholly above it: holds; wholly on the other side: does
    not hold; otherwise inconclusive. ``measured`` goes before the estimate in the kvlab column, ``what`` names
    the estimate there. ``min_n`` defaults to 2 (a t interval); give ``min_n_paired_within(limit)`` for a
    paired right-or-wrong difference."""
    if est is None:
        return Row(setting, paper, measured or "-", verdict=INCONCLUSIVE, kind=kind, note=_join(note, "no data"),
                   claim=claim, model=model)  # fmt: skip
    fields = spread(est)
    why = fields.pop("note", "")
    side = "below" if below else "above"
    text = _join(measured, f"{what} {est.text(digits=3)}".strip())
    if est.low is None or est.high is None:
        verdict = INCONCLUSIVE
    elif (est.high < limit) if below else (est.low > limit):
        verdict, why = HOLDS, _join(why, f"the interval lies {side} {limit:g}")
    elif (est.low > limit) if below else (est.high < limit):
        verdict, why = DOES_NOT_HOLD, _join(why, f"the interval lies {'above' if below else 'below'} {limit:g}")
    else:
        verdict, why = INCONCLUSIVE, _join(why, f"the interval reaches {limit:g}")
    return Row(
        setting,
        paper,
        text,
        verdict=verdict,
        kind=kind,
        note=_join(note, why),
        claim=claim,
        model=model,
        min_n=MIN_N_CONTINUOUS if min_n is None else min_n,
        **fields,
    )


def within_row(
    setting: str,
    paper: str,
    reference: list[float],
    other: list[float],
    names: tuple[str, str],
    margin: float,
    claim: str,
    kind: str = CLAIM,
    model: str = "",
    lead: str = "",
    note: str = "",
) -> Row:
    """``names[1]`` no worse than ``names[0]`` by ``margin`` or more, paired: the interval of reference - other
    wholly below ``margin``. For right-or-wrong scores it can pass from ``min_n_paired_within(margin)``
    prompts (17 for 0.2: every prompt in agreement)."""
    d = paired_difference(reference, other, names=names)
    est = d.difference if d is not None else None
    binary = bool(reference) and is_binary(reference, other)
    return bound_row(
        setting,
        paper,
        est,
        margin,
        True,
        claim,
        kind,
        model,
        lead,
        _join(note, "exact McNemar interval" if binary else ""),
        min_n_paired_within(margin) if binary else None,
        f"{names[0]} - {names[1]}",
    )


__all__ = ["bound_row", "direction_row", "spread", "within_row"]
