"""``METHOD+qjl``, e.g. ``snapkv+qjl`` or ``h2o+qjl``. QJL (Zandieh, Daliri, Han, "QJL: 1-Bit
Quantized JL Transform for KV Cache Quantization with Zero Overhead", AAAI 2025, arXiv:2406.03482)
stores each kept key as the sign bits of S k (``qjl_m`` bits, packed) plus ||k|| in float16, and each
kept value as per-token ``value_bits``-bit group codes (the reference's 2 bits by default). Its score
estimate sqrt(pi/2)/m * ||k|| * <S q, sign(S k)> is linear in q, = <q, k_hat> with
k_hat = sqrt(pi/2)/m * ||k|| * S^T sign(S k) (``qjl.dense_key_estimate``). Attention scores the bits
directly (``SketchedKeys``: m products per key and query); the store's views give k_hat, computed
from the bits on every read. Neither is stored. Optionally (``qjl_outliers`` > 0) the
largest-magnitude channels of each key are sketched separately (Sec. 4.1),
chosen per token rather than per group of 32 tokens, since eviction removes single tokens
(``split_query`` restricts each part of k_hat to its own channels, as ``qjl``'s knob). One sketch
per layer, drawn from the method's seed on a stream of its own (the inner method's random draws stay
as they are alone); like ``qjl``, its bytes count only with ``count_sketch`` (it is regenerated from
the seed). QJL's full-precision recent window and larger first-layer sketches are not used here: every
kept token is sketched, and one token costs the same in every layer, as the token budget assumes.
Without ``qjl_m`` the budget goes to tokens first (m = 2 x head_dim), and once every token the
layers hold fits (the prompt, or a local layer's window), what is left buys a larger sketch (``QJLStorage.fit``).

The shared store, storage base and wrapper are in ``composed.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kernels.qjl import make_sketch, qjl_estimate_grouped
from kernels.quant import QuantizedGroups, cat_groups, dequantize_groups
from kernels.tensor_ops import gather_tokens
from kvlab.core.semantics import Keys, ScoredKeys
from kvlab.methods.composed import (
    Composition,
    Storage,
    TokenStore,
    composable,
    gather_quantized,
    quantize_tokens,
    quantized_token_bytes,
)
from kvlab.methods.dense import DenseCompressor, KeptTokens
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param, ParamError
from kvlab.methods.qjl import M_MAX_PER_D, M_MIN, QuantizedKeys, quantize_keys

QJL_SUFFIX = "+qjl"
SKETCH_STREAM = 0x514A4C  # "QJL": the sketch's seed is the method's seed plus this


def sketch_tokens(k: Tensor, s: Tensor, s_out: Tensor, n_out: int) -> QuantizedKeys:
    """k [Hkv, n, d] -> QJL keys of one layer, outlier channels chosen per token (groups of one token)."""
    return quantize_keys(k[None], s[None], s_out[None], 1, n_out).layer(0)


def _gather_keys(kq: QuantizedKeys, idx: Tensor) -> QuantizedKeys:
    """Keep tokens ``idx`` [Hkv, m] of per-token sketched keys (empty outlier parts stay empty)."""
    pick = lambda t: gather_tokens(t, idx) if t.numel() else t  # noqa: E731
    return QuantizedKeys(pick(kq.bits), pick(kq.norms), pick(kq.out_bits), pick(kq.out_norms), pick(kq.out_idx))


@dataclass
class SketchedKeys(ScoredKeys):
    """A store's QJL keys as attention reads them: scores = <qg, k_hat> = sqrt(pi/2)/m ||k|| <S qg, sign(S k)>
    (plus the outlier sketch's), from the packed bits (``kernels.qjl.qjl_estimate_grouped``: a byte lookup
    table on the CPU, Triton on CUDA); qg [Hkv, R, d] -> [Hkv, R, n] float32."""

    keys: QuantizedKeys
    s: Tensor
    s_out: Tensor

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        hkv, n = self.keys.norms.shape
        return torch.Size((hkv, n, self.s.shape[-1]))

    def scores(self, qg: Tensor) -> Tensor:
        est = qjl_estimate_grouped(qg, self.s, self.keys.bits, self.keys.norms)
        if self.keys.out_bits.shape[-1]:
            est = est + qjl_estimate_grouped(qg, self.s_out, self.keys.out_bits, self.keys.out_norms)
        return est


@dataclass
class QJLDenseLayer(TokenStore):
    """A ``DenseLayer`` look-alike: keys as QJL sketches (read back as k_hat), values as per-token codes.

    keys: bits uint8 [Hkv, n, m/8], norms fp16 [Hkv, n] (+ per-token outlier bits / norms / channel
    indices uint8 [Hkv, n, n_out] when ``n_out``); s [m, d], s_out [m_out, d] float32, this layer's sketches.
    """

    keys: QuantizedKeys
    v: QuantizedGroups
    s: Tensor
    s_out: Tensor
    n_out: int
    split: bool  # each sketch's part of k_hat restricted to its own channels (qjl's split_query)
    value_bits: int
    value_group: int

    @classmethod
    def from_dense(
        cls, layer: KeptTokens, s: Tensor, s_out: Tensor, n_out: int, split: bool, value_bits: int, value_group: int
    ) -> QJLDenseLayer:
        k, v, _, _ = layer.views()
        keys, values = sketch_tokens(k, s, s_out, n_out), quantize_tokens(v, value_bits, value_group)
        return cls(layer.pos, layer.logw, keys, values, s, s_out, n_out, split, value_bits, value_group)

    def dense_kv(self) -> tuple[Tensor, Tensor]:
        return self.keys.estimate(self.s, self.s_out, split_group=1 if self.split else 0), dequantize_groups(self.v)

    def read_kv(self) -> tuple[Keys, Tensor]:
        """Attention scores the sketches directly (``SketchedKeys``), m products per key and query instead of
        building k_hat (m x d per key); with per-token split outliers (a query split per token) k_hat."""
        if self.n_out and self.split:
            return self.dense_kv()
        return SketchedKeys(self.keys, self.s, self.s_out), dequantize_groups(self.v)

    def _append_kv(self, k: Tensor, v: Tensor) -> None:
        self.keys = self.keys.cat(sketch_tokens(k, self.s, self.s_out, self.n_out))
        self.v = cat_groups([self.v, quantize_tokens(v, self.value_bits, self.value_group)], dim=-2)

    def _keep_kv(self, idx: Tensor) -> None:
        self.keys, self.v = _gather_keys(self.keys, idx), gather_quantized(self.v, idx)

    def _kv_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for kind, t in self.keys.tensors():
            if t.numel() or kind in ("key_bits", "key_norms"):
                yield kind, t
        for kind, t in self.v.tensors():
            yield f"value_{kind}", t


class QJLStorage(Storage):
    """QJL-sketched keys and quantized values for a dense method's kept tokens.

    The sketch size m (``qjl_m`` when given) is at least 2 x head_dim, the reference's sketch on most
    layers (256 bits for head_dim 128): 2 bits per key coordinate (+ the norm), as many as the 2-bit
    values, so that neither half of a token dominates its bytes. The estimate's standard deviation is
    at most sqrt(pi/2) ||q|| ||k|| / sqrt(m) (the second moment in Lemma 3.5's proof). When every
    prompt token fits the byte budget at that size, the rest of the budget buys a larger sketch
    (tokens first, then bits), up to ``qjl.M_MAX_PER_D`` x head_dim as in ``qjl``. On the embedded
    model, m = 2 x head_dim garbles the greedy continuation of a 619-token prompt (SnapKV keeping
    every token), while the m that fills a 0.125 budget (208-272) mostly keeps it on track.
    """

    def __init__(self, method: DenseCompressor, cfg: dict):
        super().__init__(method, cfg)
        self.name = method.name
        self.layers: list[QJLDenseLayer] = []  # the stores of the last compression, with their sketches
        m = self.cfg["qjl_m"]
        if m is None or str(m).strip().lower() in ("", "none", "auto"):
            m = None
        else:
            try:
                m = int(float(m))
            except (TypeError, ValueError):
                raise ParamError(f"{self.name}: parameter qjl_m={m!r} must be an integer or empty") from None
            if m < M_MIN or m % 8:
                raise ParamError(f"{self.name}: parameter qjl_m={m} must be a multiple of 8, at least {M_MIN}")
        self.cfg["qjl_m"] = m
        self.sketch_rows = m or 2 * self.info.head_dim  # fitted to the budget in plan() when not given
        if int(self.cfg["qjl_outliers"]) >= self.info.head_dim:
            raise ParamError(f"{self.name}: parameter qjl_outliers={self.cfg['qjl_outliers']} must be < head_dim")

    @property
    def n_out(self) -> int:
        return int(self.cfg["qjl_outliers"])

    @property
    def m_out(self) -> int:
        """The outlier sketch's size: as large as the main one, as qjl's reference (256 / 256); 0 without outliers."""
        return self.sketch_rows if self.n_out else 0

    def key_bytes(self) -> int:
        """One key: m sign bits + fp16 norm (+ the outlier sketch's bits, its norm and the channel indices)."""
        return self.sketch_rows // 8 + 2 + (self.m_out // 8 + 2 + self.n_out if self.n_out else 0)

    def kv_bytes(self) -> int:
        c = self.cfg  # values at their own head size (smaller than keys under latent attention)
        value = quantized_token_bytes(self.info.v_head_dim, int(c["value_bits"]), int(c["value_group"]))
        return self.key_bytes() + value

    def sketch_bytes(self) -> float:
        """The sketches' bytes per layer and KV head when counted (``count_sketch``), else 0."""
        if not self.cfg["count_sketch"]:
            return 0.0
        return (self.sketch_rows + self.m_out) * self.info.head_dim * 4 / self.info.n_kv_heads

    def fit(self, n_prompt: int) -> None:
        """Without ``qjl_m``: the largest sketch (multiple of 8, 2 to 16 x head_dim) that still lets every
        prompt token fit the byte budget (counted with a log-weight, so any inner method keeps them all);
        2 x head_dim when they do not all fit even then, or with a token-count budget."""
        d = self.info.head_dim
        self.sketch_rows = self.cfg["qjl_m"] or 2 * d
        budget = self.method.budget
        if self.cfg["qjl_m"] or budget is None or budget.tokens is not None:
            return
        target = budget.target_bytes(self.info, n_prompt) / (self.info.n_layers * self.info.n_kv_heads)
        per_token = self.method.per_token_bytes
        # per layer, on average: a local layer holds what its queries see (``reach``)
        held = sum(self.method.reach(i, n_prompt) for i in range(self.info.n_layers)) / self.info.n_layers
        fits = lambda: held * per_token(with_logw=True) + self.sketch_bytes() <= target  # noqa: E731
        lo, hi = 2 * d, M_MAX_PER_D * d
        if not fits():
            return
        while lo < hi:  # bytes grow with m: bisect over multiples of 8
            self.sketch_rows = (lo + hi + 8) // 16 * 8
            lo, hi = (self.sketch_rows, hi) if fits() else (lo, self.sketch_rows - 8)
        self.sketch_rows = lo

    def fixed_bytes(self) -> float:
        return self.sketch_bytes()

    def prepare(self, state: PrefillState) -> None:
        """One sketch (and outlier sketch) per layer, orthogonalized as in ``qjl``, from the seed's own stream."""
        n_layers, d = state.keys.shape[0], state.keys.shape[-1]
        gen = torch.Generator(device="cpu").manual_seed(self.method.seed + SKETCH_STREAM)
        dev = state.keys.device
        self.sketches = make_sketch(n_layers, self.sketch_rows, d, gen).to(dev)
        self.out_sketches = make_sketch(n_layers, self.m_out, d, gen).to(dev) if self.n_out else self.sketches[:, :0]

    def store(self, layer: int, dense: KeptTokens) -> TokenStore:
        c = self.cfg
        self.layers.append(
            QJLDenseLayer.from_dense(
                dense,
                s=self.sketches[layer],
                s_out=self.out_sketches[layer],
                n_out=self.n_out,
                split=bool(c["split_query"]),
                value_bits=int(c["value_bits"]),
                value_group=int(c["value_group"]),
            )
        )
        return self.layers[-1]

    def stored(self, state: PrefillState, layers: list[KeptTokens]) -> list[KeptTokens]:
        self.layers = []
        return super().stored(state, layers)

    def knobs(self) -> dict:
        c, d = self.cfg, self.info.head_dim
        return {
            "qjl_m": self.sketch_rows,
            "qjl_outliers": self.n_out,
            "qjl_m_out": self.m_out,
            "split_query": bool(c["split_query"]) and self.n_out > 0,
            "value_bits": int(c["value_bits"]),
            "value_group": int(c["value_group"]),
            "key_bits_per_coord": round(8 * self.key_bytes() / d, 3),
            "value_bits_per_coord": round(8 * (self.kv_bytes() - self.key_bytes()) / d, 3),
        }

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        if self.cfg["count_sketch"]:
            yield from self._sketches()

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The sketch matrices, one per layer, shared by every sequence (unless ``count_sketch``)."""
        if not self.cfg["count_sketch"]:
            yield from self._sketches()

    def _sketches(self) -> Iterator[tuple[str, Tensor]]:
        for layer in self.layers:  # the stores made since the last compression
            yield "sketch", layer.s
            if self.n_out:
                yield "sketch", layer.s_out


QJL_PARAMS = (
    Param(
        "qjl_m",
        None,
        "sign bits per kept key (sketch rows), a multiple of 8; when not given 2 x head_dim (the "
        "reference's size on most layers), grown up to 16 x head_dim while every prompt token still fits the budget",
    ),
    Param(
        "qjl_outliers",
        0,
        "channels of each key sketched separately as outliers (chosen per token; paper Sec. 4.1 "
        "uses head_dim / 16 per group of 32 tokens), 0 for none",
        minimum=0,
    ),
    Param(
        "split_query",
        True,
        "with qjl_outliers: each sketch's estimate uses only its own channels of the query, as qjl's "
        "split_query and the authors' score kernel (same storage, lower variance)",
    ),
    Param("value_bits", 2, "bits per value coordinate (reference: 2)", choices=(1, 2, 3, 4, 8)),
    Param("value_group", 32, "coordinates per value quantization group along head_dim (reference: 32)", minimum=1),
    Param(
        "count_sketch",
        False,
        "count the sketch matrices in each sequence's held bytes (the budget then pays for them); by default "
        "they are per-model state, one copy shared across sequences, shown apart (shared_bytes), as in qjl",
    ),
)


def qjl_keyed(inner: type[DenseCompressor]) -> Composition:
    """``INNER+qjl``: ``inner``'s selection with QJL keys and quantized values."""
    return Composition(
        inner,
        f"{inner.name}{QJL_SUFFIX}",
        title=f"{inner.title} + QJL",
        summary=f"{inner.title}'s token selection; kept keys stored as QJL 1-bit sketches (sign bits + norm), "
        "values as per-token codes (2-bit by default).",
        own_params=QJL_PARAMS,
        storage=QJLStorage,
    )


def resolve_qjl(name: str, lookup: Callable[[str], Any]) -> Composition | None:
    """``METHOD+qjl`` -> its composition; None for any other name."""
    base, sep, rest = name.rpartition(QJL_SUFFIX)
    if not sep or rest:
        return None
    inner = composable(base, lookup)
    return None if inner is None else qjl_keyed(inner)
