"""The claim registry: every paper claim kvlab reproduces, each with an id and counted once.

A reproduction declares, in its own module (``DECLARED``), what its rows bear on:

* a **paper claim** (``paper_claim``): an id (``scissorhands:table3-comparable-to-full``), the paper's
  sentence or table cell it pins (a ``Quote``, checked against the paper's text), the paper's operating
  point (model scale, length, ratio or bits, metric), the threshold that decides it and where that
  threshold comes from (the paper, or "kvlab's, declared" with kvlab's reason), and the rule that turns
  its rows into one verdict. ``scale`` names the model scale the paper ties the claim to where kvlab
  cannot load a model of it: the claim is then "not testable at this scale", whatever the rows say, and
  the rows are shown as evidence;
* an **implementation check** (``check``): kvlab's own code verified against a proved statement or
  against what it stores (TurboQuant's bounds, QJL's estimator, PolarQuant's tensors). It is counted
  apart ("implementation verified"), never in the papers' tally;
* a **control** (``control``): a check of kvlab's own making that tells a result's cause apart (random
  signs against BalanceKV's walk). Counted apart too.

A row names the id it bears on (``Row.claim``). A row of kind claim, check or control is evidence at the
entry's operating point and carries a verdict; a context row may name an id too (a rate or a length the
paper does not claim) and carries none. ``decide`` gives each id one verdict from its rows by the rule
declared with it, and one per model where the rows come from several models.

Reproductions added later declare their own entries the same way; ``registry.declared()`` collects every
module's, and the ids must be unique.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvlab.reproduce.common import (
    CHECK,
    CLAIM,
    CONTEXT,
    CONTROL,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    NOT_TESTABLE,
    NOT_TESTABLE_SCALE,
    Claim,
    Row,
)

PAPER = "the paper"
KVLAB = "kvlab's, declared"
SOURCES = (PAPER, KVLAB)

EVERY_ROW = (
    "holds where every row at the operating point holds; does not hold where any row does not; inconclusive "
    "where any row is and none fails; not testable here where no row could be tested"
)


@dataclass(frozen=True)
class Threshold:
    """What decides a row: ``rule`` (the test, in words), ``source`` (``PAPER`` or ``KVLAB``) and ``why`` (the
    paper's justification, or kvlab's reason where the paper states no number)."""

    rule: str
    source: str
    why: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"threshold source {self.source!r}; allowed: {', '.join(SOURCES)}")


@dataclass(frozen=True)
class Point:
    """An operating point: the model (and its scale), the prompts' length, the ratio or bits, the metric."""

    model: str
    length: str
    setting: str
    metric: str

    def text(self) -> str:
        return f"{self.model}; {self.length}; {self.setting}; {self.metric}"


@dataclass(frozen=True)
class Declared:
    """One entry of the registry: a paper claim, an implementation check or a control (``kind``)."""

    id: str
    kind: str  # CLAIM, CHECK or CONTROL
    statement: str  # what is claimed or checked, in one line
    threshold: Threshold
    quote: Claim | None = None  # the paper's text it pins (claims; the proved statement a check verifies)
    point: Point | None = None  # the paper's operating point (claims)
    kvlab_point: str = ""  # where kvlab measures it, and how that differs from the paper's point
    scale: str = ""  # the model scale the paper ties the claim to, where kvlab cannot load one
    rule: str = EVERY_ROW

    def __post_init__(self) -> None:
        if self.kind not in (CLAIM, CHECK, CONTROL):
            raise ValueError(f"{self.id}: kind {self.kind!r}; allowed: {CLAIM}, {CHECK}, {CONTROL}")
        if ":" not in self.id:
            raise ValueError(f"{self.id!r}: an id reads PAPER:WHAT (e.g. scissorhands:table3-comparable-to-full)")
        if self.kind == CLAIM and (self.quote is None or self.point is None):
            raise ValueError(f"{self.id}: a paper claim needs the quote it pins and the paper's operating point")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["quote"] = None if self.quote is None else asdict(self.quote)
        out["point"] = None if self.point is None else asdict(self.point)
        return out


def paper_claim(
    id: str,
    quote: Claim,
    statement: str,
    point: Point,
    threshold: Threshold,
    kvlab_point: str,
    scale: str = "",
    rule: str = EVERY_ROW,
) -> Declared:
    return Declared(id, CLAIM, statement, threshold, quote, point, kvlab_point, scale, rule)


def check(id: str, statement: str, threshold: Threshold, quote: Claim | None = None, rule: str = EVERY_ROW):
    return Declared(id, CHECK, statement, threshold, quote, rule=rule)


def control(id: str, statement: str, threshold: Threshold, rule: str = EVERY_ROW) -> Declared:
    return Declared(id, CONTROL, statement, threshold, rule=rule)


def combine(verdicts: Iterable[str]) -> str:
    """``EVERY_ROW``: "not testable here" when no row could be tested; else "does not hold" if any row does
    not, "inconclusive" if any row is, "holds" when every tested row holds."""
    tested = [v for v in verdicts if v not in (NOT_TESTABLE, NOT_TESTABLE_SCALE)]
    if not tested:
        return NOT_TESTABLE
    for v in (DOES_NOT_HOLD, INCONCLUSIVE):
        if v in tested:
            return v
    return HOLDS


def decide(entry: Declared, rows: list[Row]) -> dict:
    """The verdict of ``entry`` from the rows that name it: overall and per model (where rows name one), the
    evidence rows (a verdict) and the context rows under it. A claim the paper ties to a scale kvlab cannot
    load is "not testable at this scale" whatever its rows say."""
    mine = [r for r in rows if r.claim == entry.id]
    evidence = [r for r in mine if r.kind != CONTEXT]
    models = list(dict.fromkeys(r.model for r in evidence if r.model))
    by_model = {m: combine(r.verdict or INCONCLUSIVE for r in evidence if r.model == m) for m in models}
    if entry.scale:
        verdict = NOT_TESTABLE_SCALE
    elif not evidence:
        verdict = NOT_TESTABLE
    else:
        verdict = combine(r.verdict or INCONCLUSIVE for r in evidence)
    return {
        "verdict": verdict,
        "by_model": by_model,
        "evidence": len(evidence),
        "context": len(mine) - len(evidence),
    }


def validate(entries: Iterable[Declared], rows: Iterable[Row], where: str = "") -> None:
    """Every row of kind claim, check or control names an entry of that kind; a context row names a declared
    id or none."""
    kinds = {e.id: e.kind for e in entries}
    for r in rows:
        if r.kind == CONTEXT:
            if r.claim and r.claim not in kinds:
                raise ValueError(f"{where}: context row {r.setting!r} names {r.claim!r}, which is not declared")
            continue
        if kinds.get(r.claim) != r.kind:
            raise ValueError(
                f"{where}: {r.kind} row {r.setting!r} names {r.claim!r}; it must name a declared {r.kind} "
                f"({', '.join(i for i, k in kinds.items() if k == r.kind) or 'none declared'})"
            )


__all__ = [
    "EVERY_ROW",
    "KVLAB",
    "PAPER",
    "Declared",
    "Point",
    "Threshold",
    "check",
    "combine",
    "control",
    "decide",
    "paper_claim",
    "validate",
]
