"""Keys and values at different bit widths: the ``kbits`` / ``vbits`` knobs every quantizer with a bit width
shares, and how a planner picks the pair when only a byte budget is given.

A quantizer lists the widths it has (``widths``: TurboQuant 1-4 with its outlier settings, KIVI 2-4, ggml's
q8_0 / q5_0 / q4_0 as 8 / 5 / 4, vLLM's 8 / 4 / 3 keys and 4 / 3 values). The pairs a plan may take:

* ``bits`` given: both sides at ``bits``, unless ``kbits`` or ``vbits`` names a side's own;
* ``kbits`` and ``vbits`` given: that pair; one of them given: it, with every width of the other side;
* none given: every pair the ``split`` knob allows: ``equal`` (kbits = vbits, the papers' setting), ``keys``
  (kbits >= vbits), ``values`` (kbits <= vbits) or ``auto`` (any).

``choose`` then takes, among the pairs whose cache holds the budget, the one that holds the most bytes (the
best use of the budget); between pairs holding the same bytes, the one nearest an equal split, then the one
with more bits on the keys. So where a symmetric width fills the budget as well as any split, the plan keeps
it; a split is chosen only where it fills the budget better (a budget between two symmetric widths). Nothing
fits: the pair that holds the fewest bytes (the engine then refuses the budget, naming the smallest it holds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.methods.params import Param, ParamError

SPLITS = ("auto", "equal", "keys", "values")
Pair = tuple[float, float]  # (key bits, value bits)


def split_param(default: str = "auto") -> Param:
    return Param(
        "split",
        default,
        "which (key bits, value bits) pairs the budget may choose when neither is given: auto (any; the pair "
        "filling the budget best, ties to the equal split, then to the keys), equal, keys (kbits >= vbits) or "
        "values (kbits <= vbits)",
        choices=SPLITS,
    )


def side_params(widths: Sequence[float], kind: type = float, what: str = "bits per number") -> tuple[Param, Param]:
    """The ``kbits`` and ``vbits`` knobs over ``widths`` (None: chosen from the budget)."""
    shown = ", ".join(f"{w:g}" for w in widths)
    return (
        Param(
            "kbits", None, f"keys' {what} ({shown}); chosen from the budget when not given", tuple(widths), kind=kind
        ),
        Param(
            "vbits", None, f"values' {what} ({shown}); chosen from the budget when not given", tuple(widths), kind=kind
        ),
    )


def candidates(
    key_widths: Sequence[float],
    value_widths: Sequence[float],
    bits: float | None,
    kbits: float | None,
    vbits: float | None,
    split: str,
    method: str = "",
) -> list[Pair]:
    """The (key bits, value bits) pairs a plan may take, highest key bits first."""
    if split not in SPLITS:
        raise ParamError(f"{method}: split={split!r} is not one of {', '.join(SPLITS)}")
    if bits is not None:
        kbits = bits if kbits is None else kbits
        vbits = bits if vbits is None else vbits
    ks = [kbits] if kbits is not None else list(key_widths)
    vs = [vbits] if vbits is not None else list(value_widths)
    pairs = [(k, v) for k in ks for v in vs]
    if kbits is None and vbits is None:
        keep: dict[str, Callable[[Pair], bool]] = {
            "auto": lambda p: True,
            "equal": lambda p: p[0] == p[1],
            "keys": lambda p: p[0] >= p[1],
            "values": lambda p: p[0] <= p[1],
        }
        pairs = [p for p in pairs if keep[split](p)]
    if not pairs:
        raise ParamError(f"{method}: no (key bits, value bits) pair is allowed by split={split}")
    return sorted(pairs, key=lambda p: (-p[0], -p[1]))


def choose(pairs: Sequence[Pair], fits: Callable[[Pair], bool], size: Callable[[Pair], float]) -> tuple[Pair, bool]:
    """(the pair to plan with, whether it fits): the fitting pair of most bytes (``size``), ties to the equal
    split, then to the keys; none fitting, the pair of fewest bytes."""
    sized = [(size(p), p) for p in pairs]

    def rank(item: tuple[float, Pair]) -> tuple:
        s, (k, v) = item
        return (round(s, 6), -abs(k - v), k)

    fitting = [item for item in sized if fits(item[1])]
    if fitting:
        return max(fitting, key=rank)[1], True
    return min(sized, key=lambda item: (item[0], -item[1][0]))[1], False


__all__ = ["SPLITS", "Pair", "candidates", "choose", "side_params", "split_param"]
