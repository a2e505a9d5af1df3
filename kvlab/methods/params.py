"""A method's knobs: ``Param`` (name, default, meaning, allowed values) and ``ParamError``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ParamError(ValueError):
    """A parameter that is unknown or out of its allowed values; the message says what is allowed."""


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
        v: Any
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


__all__ = ["Param", "ParamError"]


def resolve(method: str, params: tuple[Param, ...], overrides: dict) -> dict:
    """The defaults of ``params`` with ``overrides`` applied (each coerced); an unknown name is a ``ParamError``
    naming ``method`` and what it allows."""
    known = {p.name: p for p in params}
    out = {p.name: p.default for p in params}
    for k, v in overrides.items():
        if k not in known:
            allowed = ", ".join(known) or "none"
            raise ParamError(f"{method}: unknown parameter {k!r}; allowed: {allowed}")
        out[k] = known[k].coerce(method, v) if v is not None else None
    return out
