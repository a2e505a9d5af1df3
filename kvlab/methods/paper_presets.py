"""Each paper's own operating point, runnable by name: ``METHOD@paper`` (and ``subgen@theorem``).

kvlab's defaults are chosen for a small model and short prompts; a preset runs the method with the
settings of its paper's experiments (or, for ``subgen@theorem``, the regime of its theorem), each
setting cited to the section of the paper (or the public reference code) it comes from. A preset is
a subclass of the method made on demand (like the ``METHOD+kiviB`` compositions): the same code,
other defaults. ``--param balancekv@paper.step=algorithm2`` and the like still override them.

The settings and what each deviation of kvlab's default costs are listed on the method pages
(docs/methods/*.md, "The paper's operating point").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.core.model import ModelInfo
from kvlab.methods.base import Compressor

SEP = "@"


@dataclass(frozen=True)
class Setting:
    """One knob of a preset: its value and where in the paper (or reference code) it comes from."""

    param: str
    value: object
    where: str


@dataclass(frozen=True)
class Preset:
    method: str
    tag: str  # "paper" or "theorem"
    summary: str
    settings: tuple[Setting, ...]

    @property
    def name(self) -> str:
        return f"{self.method}{SEP}{self.tag}"

    def params(self) -> dict:
        return {s.param: s.value for s in self.settings}


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "balancekv",
            "paper",
            "BalanceKV as in its LongBench runs: T = 2 rounds of blocks of 256 (rate 0.25), 32 + 32 exact "
            "first/recent tokens shrunk to what the budget leaves",
            (
                Setting("T", 2, "Sec. 4.2: T = 2, a consistent compression rate of 0.25"),
                Setting("block_size", 256, "Sec. 4.2: b = 256"),
                Setting("n_sink", 32, "Sec. 4.2 names no window; the reference code's LongBench script keeps 32"),
                Setting("n_recent", 32, "as n_sink (reference code's LongBench script: 32)"),
                Setting("gamma", 4.0, "reference code's walk step; step=algorithm2 gives Algorithm 2's (Sec. 3)"),
            ),
        ),
        Preset(
            "scissorhands",
            "paper",
            "Scissorhands with m = 0.5 B, more budget for later layers, and Algorithm 1 run token by "
            "token over the prompt",
            (
                Setting("m_ratio", 0.5, "Sec. 4.1, Overhead Tradeoff: m = 0.5 B"),
                Setting("layer_ramp", 0.5, "Sec. 4.1, Allocating Budgets: more budget to later layers (Fig. 2)"),
                Setting("prompt", "token", "Algorithm 1: the cache grows one token at a time, compressed at B + 1"),
                Setting("threshold", "position", "Algorithm 2: low attention is below 1/t"),
            ),
        ),
        Preset(
            "subgen",
            "theorem",
            "SubGen Algorithm 1 alone in Theorem 1's regime: a fixed radius delta, clusters opened as the "
            "stream needs them (m grows with n), no exact sink or window",
            (
                Setting("delta", 16.0, "Theorem 1 / Definition 1: a fixed radius (~ the median key norm)"),
                Setting("max_clusters", "none", "Theorem 1: no cap, memory O(d (m t + s)) with m = m(n, delta)"),
                Setting("sink", 0, "Algorithm 1 holds no exact tokens"),
                Setting("recent_share", 0.0, "Algorithm 1 holds no exact tokens"),
                Setting("t", 16, "Theorem 1: t = Omega(eps^-2 e^(2 delta r) log n); 16 is a small eps^-2 log n"),
                Setting("s", 128, "Theorem 1: s = Omega(eps^-2 d); 2 d for d = 64"),
            ),
        ),
        Preset(
            "qjl",
            "paper",
            "QJL with the reference code's setting: m = 2 d (x2 on the first layers), 8-of-128 outlier "
            "channels sketched apart, 2-bit values in groups of 32, the last 128 tokens exact",
            (
                Setting("m", "2d", "Sec. 4 / reference code: m = 256 for d = 128"),
                Setting("initial_factor", 2, "reference code: m = 512 on the first 15 of 32 layers"),
                Setting("n_outliers", "d/16", "reference code: 8 outlier channels of 128 per group of 32 tokens"),
                Setting("outlier_group", 32, "reference code: groups of 32 tokens"),
                Setting("m_out_ratio", 1.0, "reference code: outlier sketch 256 for m = 256"),
                Setting("value_bits", 2, "reference code: values per token at 2 bits"),
                Setting("value_group", 32, "reference code: value groups of 32"),
                Setting("residual", 128, "reference code: the last 128 tokens at full precision"),
            ),
        ),
    )
}

_MADE: dict[str, type[Compressor]] = {}


def _value(value: object, head_dim: int) -> object:
    """A setting's value; "2d" / "d/16" are read against the model's head_dim."""
    if value == "2d":
        return 2 * head_dim
    if value == "d/16":
        return max(1, head_dim // 16)
    return value


def preset_class(name: str, lookup: Callable[[str], Any]) -> type[Compressor]:
    """The class of one preset: the method with the preset's settings as its defaults (made once)."""
    if name not in _MADE:
        preset = PRESETS[name]
        base = lookup(preset.method)
        assert isinstance(base, type) and issubclass(base, Compressor), f"{preset.method}: a preset needs a class"
        given = preset.params()
        known = {p.name for p in base.params}
        missing = sorted(set(given) - known)
        if missing:
            raise TypeError(f"{name}: {preset.method} has no parameters {missing}")

        def __init__(self: Compressor, info: ModelInfo, *args, **kwargs) -> None:
            base.__init__(self, info, *args, **kwargs)
            for s in preset.settings:  # model-relative values ("2d") once the model is known
                if s.param not in self.params_given and isinstance(s.value, str) and s.value in ("2d", "d/16"):
                    self.cfg[s.param] = _value(s.value, info.head_dim)

        made_name = f"{base.__name__}At{preset.tag.title()}"
        _MADE[name] = type(
            made_name,
            (base,),
            {
                "__init__": __init__,
                "__module__": __name__,
                "__qualname__": made_name,
                "name": name,
                "title": f"{base.title} @ {preset.tag}",
                "summary": preset.summary,
                "preset": preset,
                "params": tuple(
                    dataclasses.replace(p, default=given[p.name])
                    if p.name in given and not (isinstance(given[p.name], str) and given[p.name] in ("2d", "d/16"))
                    else p
                    for p in base.params
                ),
            },
        )
    return _MADE[name]


def resolve(name: str, lookup: Callable[[str], Any]) -> type[Compressor] | None:
    """``METHOD@tag`` -> its preset class; None for any other name."""
    return preset_class(name, lookup) if name in PRESETS else None
