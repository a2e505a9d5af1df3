"""The registry of compression methods, by name: an explicit list of the classes each method file
defines and of the wrappers listed with them (``snapkv+kivi2``, ``ada-snapkv``: ``wrapped.Wrapper``),
and the resolvers that build named variants on demand (``h2o+kivi4``, ``snapkv+polarquant``,
``ada-knorm``, ``decoding-keydiff``, ``qjl@paper``). Nothing registers itself on import; a new method is
added to ``METHODS`` here.

``register``/``unregister`` add and remove a class at run time (a user's own method, a test's).
"""

from __future__ import annotations

from collections.abc import Callable

from kvlab.methods.adakv import adaptive
from kvlab.methods.adakv import resolve as resolve_adaptive
from kvlab.methods.balancekv import BalanceKV, BalanceKVStream
from kvlab.methods.base import Compressor
from kvlab.methods.cam import CaM
from kvlab.methods.capkv import CapKV
from kvlab.methods.chunkkv import chunked_scorer
from kvlab.methods.chunkkv import resolve as resolve_chunked
from kvlab.methods.compactor import Compactor
from kvlab.methods.criticalkv import critical
from kvlab.methods.criticalkv import resolve as resolve_critical
from kvlab.methods.curdkv import CurDKV
from kvlab.methods.dapq import DapQ
from kvlab.methods.decoding import decoding
from kvlab.methods.decoding import resolve as resolve_decoding
from kvlab.methods.dms import resolve as resolve_dms
from kvlab.methods.dms import thresholded
from kvlab.methods.dropkv import DropKV
from kvlab.methods.duoattention import DuoAttention
from kvlab.methods.engine_flags import ENGINE_METHODS
from kvlab.methods.exact import Exact
from kvlab.methods.expected_attention import ExpectedAttention
from kvlab.methods.fp8 import FP8
from kvlab.methods.ggml_cache import GGMLCache
from kvlab.methods.h2o import H2O
from kvlab.methods.keydiff import KeyDiff
from kvlab.methods.kivi import KIVI
from kvlab.methods.knorm import KNorm
from kvlab.methods.kvzip import KVzip
from kvlab.methods.lagkv import LagKV
from kvlab.methods.leverage import LeverageScore
from kvlab.methods.lukv import profiled
from kvlab.methods.lukv import resolve as resolve_profiled
from kvlab.methods.paper_presets import resolve as resolve_preset
from kvlab.methods.polarquant import PolarQuant
from kvlab.methods.pyramidkv import PyramidKV
from kvlab.methods.qjl import QJL
from kvlab.methods.scissorhands import Scissorhands
from kvlab.methods.simlayerkv import SimLayerKV
from kvlab.methods.snapkv import SnapKV
from kvlab.methods.streaming import StreamingLLM
from kvlab.methods.subgen import SubGen, SubGenKCenter, SubGenKCenterWeighted
from kvlab.methods.tova import TOVA
from kvlab.methods.turboquant import TurboQuant
from kvlab.methods.uniform import Uniform
from kvlab.methods.vllm_turboquant import VLLMTurboQuant
from kvlab.methods.with_kivi import quantized
from kvlab.methods.with_kivi import resolve as resolve_kivi
from kvlab.methods.with_qjl import qjl_keyed, resolve_qjl
from kvlab.methods.with_token_quant import coded
from kvlab.methods.with_token_quant import resolve as resolve_coded
from kvlab.methods.wrapped import Wrapper

# a method as the registry holds it: its class, or a wrapper holding another method (``wrapped.Wrapper``)
Method = type[Compressor] | Wrapper
Lookup = Callable[[str], Method]

# Every method the page and the CLI list, and the compositions listed with them.
METHODS: tuple[Method, ...] = (
    Exact,
    Uniform,
    StreamingLLM,
    H2O,
    SnapKV,
    PyramidKV,
    KIVI,
    QJL,
    SubGen,
    SubGenKCenter,
    SubGenKCenterWeighted,
    BalanceKV,
    BalanceKVStream,
    Scissorhands,
    ExpectedAttention,
    KeyDiff,
    KNorm,
    KVzip,
    TOVA,
    CaM,
    CapKV,
    LeverageScore,
    Compactor,
    CurDKV,
    LagKV,
    DropKV,
    DapQ,
    FP8,
    TurboQuant,
    PolarQuant,
    VLLMTurboQuant,
    GGMLCache,
    *ENGINE_METHODS,  # the engines' flags: vLLM's TurboQuant presets, llama.cpp's cache types
    adaptive(SnapKV),  # the AdaKV paper's own pairing
    adaptive(ExpectedAttention, epsilon=1e-2),  # kvpress's benchmarked Expected Attention (AdaKVPress, epsilon 1e-2)
    quantized(Scissorhands, 4),  # the Scissorhands paper's own combination (Table 4)
    quantized(SnapKV, 2),
    qjl_keyed(SnapKV),
    qjl_keyed(H2O),
    coded(SnapKV, "turboquant"),
    coded(H2O, "fp8"),
    decoding(SnapKV),  # kvpress's DecodingPress over its standard scorer
    decoding(KNorm),  # the same over a scorer of keys alone (no queries held; its kept tokens match kvpress's)
    critical(SnapKV),  # the paper's and kvpress's pairing (kvpress's critical_snapkv)
    chunked_scorer(SnapKV),  # the paper's pairing, at its chunk size 10 (kvpress benchmarks 20)
    chunked_scorer(SnapKV, gated=True),  # kvpress's EntropyGatedChunkKVPress over SnapKV, at its defaults
    SimLayerKV,
    DuoAttention,
    profiled(
        ExpectedAttention, epsilon=2e-2
    ),  # kvpress's benchmarked LU-KV (its lukv: Expected Attention, epsilon 2e-2)
    thresholded(SnapKV),  # kvpress benchmarks DMS with its trained KVzap scorers only; SnapKV's votes instead
)

# name -> method or None, for names that are not listed: compositions, adaptive heads, paper presets
RESOLVERS: tuple[Callable[[str, Lookup], Method | None], ...] = (
    resolve_kivi,
    resolve_qjl,
    resolve_coded,
    resolve_adaptive,
    resolve_decoding,
    resolve_critical,
    resolve_chunked,
    resolve_profiled,
    resolve_dms,
    resolve_preset,
)

_REGISTRY: dict[str, Method] = {}


class UnknownMethodError(ValueError):
    pass


def register(cls: Method) -> Method:
    """Add ``cls`` under its name (a name taken by another method is an error)."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] != cls:
        raise TypeError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the method ``name`` (no error when it is not there)."""
    _REGISTRY.pop(name, None)


for _cls in METHODS:
    register(_cls)

_ORDER = {"reference": 0, "paper": 1, "baseline": 2, "recent": 3, "quantizer": 4}


def names() -> list[str]:
    return sorted(_REGISTRY, key=lambda n: (_ORDER.get(_REGISTRY[n].group, 9), n))


def get(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        for fn in RESOLVERS:
            cls = fn(name, get)
            if cls is not None:
                return cls
        raise UnknownMethodError(f"unknown method {name!r}; allowed: {', '.join(names())}") from None


def methods() -> dict[str, Method]:
    return {n: _REGISTRY[n] for n in names()}
