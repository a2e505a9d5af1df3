"""QJL: 1-bit quantized Johnson-Lindenstrauss keys, group-quantized values, a full-precision window.

Zandieh, Daliri, Han. "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
Overhead", arXiv:2406.03482 (AAAI 2025). Implemented here:

* Definition 3.1 / Algorithm 1: each key k is stored as sign(S k) (m bits, packed) plus ||k||
  (float16); the score of a query q is estimated as sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>,
  unbiased by Lemma 3.2 (ESTIMATESCORES, lines 6-7: one softmax over the estimates).
* Sec. 4.1 "Orthogonalized JL transform": S is Gaussian with its rows orthogonalized by QR, in
  blocks of d rows, each block scaled by sqrt(d) (as the authors' public code does).
* Sec. 4.1 "Outliers": per group of ``outlier_group`` tokens, the ``n_outliers`` channels with the
  largest norm over the group are sketched by a second, independent quantizer (``S_out``,
  ``m_out`` rows) and the remaining channels by S; the score is the sum of both estimates.
* From the public reference code (docs/design.md §6): the score kernel restricts the query to each
  part's channels (``split_query``, on by default, in the Triton path too); the outlier sketch is
  as large as the later layers' main sketch (``m_out`` = m: 256 for m = 256, also beside the first
  layers' 512); values quantized per token in groups of ``value_group`` coordinates at
  ``value_bits`` (scale + min in float16); the most recent ``residual`` tokens kept at full
  precision (in the cache dtype) and flushed into the quantized store ``outlier_group`` tokens at a
  time; the first layers get a larger sketch (m x ``initial_factor``).
* The paper's configuration (m = 2 x head_dim, 2-bit values in groups of 32, 128 recent tokens,
  about 3 bits per number) is what the planner picks at the budget of its bytes
  (``QJL.paper_fraction(n)``); other budgets scale m and the value bits.

Deviations from the reference, and why: one window serves keys and values (the reference keeps
< 128 keys and 128 values: one flush unit less to track); outliers are picked per group of
``outlier_group`` tokens from the group's own keys (as the reference) but the flush unit is that
same group; ``n_outliers`` defaults to head_dim / 16 (the reference's 8 for head_dim 128); the
number of first layers with the larger sketch scales with the model (15 of 32 layers); below the
paper's budget the planner trades m and value bits (the paper reports only its configuration); on
the CPU the split-query score products run in bfloat16 by default (``products``: S q rounded, signs
exact; the reference kernels compute in the model's 16-bit dtype too).

Storage format (shared with the Triton kernels, see docs/methods/qjl.md): sign bits uint8 [Hkv, n, m/8]
LSB first (bit 1 = S k >= 0), norms float16 [Hkv, n], S float32 [m, d] per layer, outlier channel
indices uint8 [Hkv, n_groups, n_outliers], values packed by ``kernels.quant.pack_codes``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import qjl_estimate_grouped, qjl_estimate_split_pair
from kernels.qjl import make_sketch, outlier_channels, outlier_mask
from kernels.quant import (
    QuantizedGroups,
    cat_groups,
    pack_signs,
    packed_bytes,
    quantize_groups,
    unpack_signs,
    weighted_token_sum,
)
from kernels.tensor_ops import group_queries, ungroup
from kvlab.core import cancel
from kvlab.core import semantics as sm
from kvlab.core.budgets import per_token_bytes
from kvlab.core.semantics import grouped_softmax
from kvlab.methods.base import Compressor
from kvlab.methods.budget_search import fits_budget
from kvlab.methods.handover import PrefillState
from kvlab.methods.kivi import first_group_held, local_quantized_held, streaming_allowed
from kvlab.methods.params import Param, ParamError

SQRT_HALF_PI = math.sqrt(math.pi / 2)
M_MIN = 8  # smallest sketch: one byte of sign bits per key
M_MAX_PER_D = 16  # largest automatic sketch, in multiples of head_dim
RESIDUAL_SHARE = 0.25  # at most this share of the byte budget goes to the full-precision window


# ----- the sketch and the estimator -----------------------------------------------------------
def sketch_keys(k: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Algorithm 1, line 3: k [L, H, n, d], S [L, m, d] -> (sign bits uint8 [L, H, n, m/8], norms fp16 [L, H, n])."""
    proj = torch.matmul(k.float(), s.unsqueeze(1).transpose(-1, -2))
    return pack_signs(proj), k.float().norm(dim=-1).half()


def estimate_scores(q: Tensor, s: Tensor, bits: Tensor, norms: Tensor) -> Tensor:
    """ESTIMATESCORES line 6: sqrt(pi/2)/m * ||k|| * <S q, sign(S k)> for every query head and key.

    q: [Hq, t, d]; s: [m, d]; bits: [Hkv, n, m/8]; norms: [Hkv, n]. Returns [Hq, t, n] float32.
    """
    m = s.shape[0]
    sq = group_queries(torch.matmul(q.float(), s.t()), bits.shape[0])  # [Hkv, g*t, m]
    dots = torch.matmul(sq, unpack_signs(bits, m).transpose(-1, -2))  # [Hkv, g*t, n]
    return ungroup(dots * (norms.float().unsqueeze(-2) * (SQRT_HALF_PI / m)), q.shape[0])


def estimate_scores_split(
    q: Tensor, s: Tensor, bits: Tensor, norms: Tensor, out_idx: Tensor, group: int, outliers: bool
) -> Tensor:
    """The estimate with the query restricted to the channels the sketch encoded (``split_query``).

    <q, k_part> = <q_part, k_part>, so projecting only q's inlier (or outlier) channels keeps the
    estimate unbiased while its variance drops from ~||q||^2 ||k_part||^2 to ~||q_part||^2 ||k_part||^2.
    The channel split changes per token group, so the projection is made per group.
    q: [Hq, t, d]; bits: [Hkv, n, m/8]; norms: [Hkv, n]; out_idx: uint8 [Hkv, n/group, n_out]; returns [Hq, t, n].
    """
    m, hkv, d = s.shape[0], bits.shape[0], q.shape[-1]
    mask = torch.zeros(*out_idx.shape[:-1], d, dtype=torch.bool, device=q.device)
    mask.scatter_(-1, out_idx.long(), True)  # [Hkv, ng, d]
    keep = mask if outliers else ~mask
    q_part = group_queries(q.float(), hkv).unsqueeze(1) * keep.unsqueeze(-2)  # [Hkv, ng, g*t, d]
    signs = unpack_signs(bits, m).reshape(hkv, mask.shape[1], group, m)  # [Hkv, ng, group, m]
    dots = torch.matmul(torch.matmul(q_part, s.t()), signs.transpose(-1, -2))  # [Hkv, ng, g*t, group]
    dots = dots.permute(0, 2, 1, 3).reshape(hkv, -1, bits.shape[1])
    return ungroup(dots * (norms.float().unsqueeze(-2) * (SQRT_HALF_PI / m)), q.shape[0])


def dense_key_estimate(s: Tensor, bits: Tensor, norms: Tensor) -> Tensor:
    """The linear form of the estimator: k_hat = sqrt(pi/2)/m * ||k|| * S^T sign(S k), [..., n, d]."""
    m = s.shape[-2]
    return torch.matmul(unpack_signs(bits, m), s) * (norms.float().unsqueeze(-1) * (SQRT_HALF_PI / m))


def quantize_keys(k: Tensor, s: Tensor, s_out: Tensor, group: int, n_out: int) -> QuantizedKeys:
    """Algorithm 1's sketched keys with Sec. 4.1's outliers: k [L, H, n, d], S [L, m, d], S_out [L, m_out, d].

    n is a multiple of ``group``; the ``n_out`` outlier channels of each group of ``group`` tokens are
    sketched by S_out, the rest by S. With ``n_out`` = 0 every channel goes through S and the outlier
    parts are empty (S_out unused). Used by ``QJL`` and by the ``METHOD+qjl`` compositions.
    """
    kf = k.float()
    if not n_out:
        bits, norms = sketch_keys(kf, s)
        idx = torch.zeros(*k.shape[:-2], k.shape[-2] // group, 0, dtype=torch.uint8, device=k.device)
        return QuantizedKeys(bits, norms, bits[..., :0], norms[..., :0], idx)
    idx = outlier_channels(k, group, n_out)
    mask = outlier_mask(idx, k.shape[-1], group)
    bits, norms = sketch_keys(kf.masked_fill(mask, 0.0), s)
    out_bits, out_norms = sketch_keys(kf.masked_fill(~mask, 0.0), s_out)
    return QuantizedKeys(bits, norms, out_bits, out_norms, idx)


# ----- the quantized store of one layer -------------------------------------------------------
@dataclass
class QuantizedKeys:
    """Sketched keys: inlier part by S, outlier part by S_out. Shapes per layer as in the module doc."""

    bits: Tensor  # uint8 [Hkv, n, m/8]
    norms: Tensor  # fp16 [Hkv, n]
    out_bits: Tensor  # uint8 [Hkv, n, m_out/8]
    out_norms: Tensor  # fp16 [Hkv, n]
    out_idx: Tensor  # uint8 [Hkv, n_groups, n_outliers]

    def layer(self, j: int) -> QuantizedKeys:
        """Slice j of keys quantized with a leading (layer) dim, without that dim."""
        return QuantizedKeys(*(t[j] for t in (self.bits, self.norms, self.out_bits, self.out_norms, self.out_idx)))

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield "key_bits", self.bits
        yield "key_norms", self.norms
        yield "outlier_bits", self.out_bits
        yield "outlier_norms", self.out_norms
        yield "outlier_indices", self.out_idx

    def estimate(self, s: Tensor, s_out: Tensor, split_group: int = 0) -> Tensor:
        """k_hat [Hkv, n, d] such that <q, k_hat> is the score estimate: inlier plus outlier ``dense_key_estimate``.

        With ``split_group`` (the tokens per outlier group) each part keeps only its own channels, so
        that <q, k_hat> is the ``split_query`` estimate (``estimate_scores_split``, inliers + outliers).
        """
        k = dense_key_estimate(s, self.bits, self.norms)
        if not self.out_bits.shape[-1]:
            return k
        k_out = dense_key_estimate(s_out, self.out_bits, self.out_norms)
        if split_group:
            return torch.where(outlier_mask(self.out_idx, k.shape[-1], split_group), k_out, k)
        return k + k_out

    def cat(self, other: QuantizedKeys) -> QuantizedKeys:
        return QuantizedKeys(
            torch.cat([self.bits, other.bits], -2),
            torch.cat([self.norms, other.norms], -1),
            torch.cat([self.out_bits, other.out_bits], -2),
            torch.cat([self.out_norms, other.out_norms], -1),
            torch.cat([self.out_idx, other.out_idx], -2),
        )


@dataclass
class QJLSegment:
    """Quantized tokens stored together: sketched keys and their group-quantized values (n tokens).

    A segment is never changed once made: a flush makes a new one (``cat``), so a forked cache can
    hold its parent's segments themselves, and one lockstep call can score them for every row that
    holds them (``QJL.attend_many``).
    """

    keys: QuantizedKeys
    values: QuantizedGroups

    @property
    def n(self) -> int:
        return self.keys.bits.shape[-2]

    def cat(self, other: QJLSegment) -> QJLSegment:
        return QJLSegment(self.keys.cat(other.keys), cat_groups([self.values, other.values], dim=-2))

    def without_first(self, c: int, group: int) -> QJLSegment:
        """A copy without its first ``c`` tokens (whole outlier groups of ``group`` tokens)."""
        k, v = self.keys, self.values
        keys = QuantizedKeys(
            k.bits[:, c:].clone(),
            k.norms[:, c:].clone(),
            k.out_bits[:, c:].clone(),
            k.out_norms[:, c:].clone(),
            k.out_idx[:, c // group :].clone(),
        )
        values = QuantizedGroups(
            v.codes[:, c:].clone(), v.scale[:, c:].clone(), v.minimum[:, c:].clone(), v.bits, v.group, v.dim, v.length
        )
        return QJLSegment(keys, values)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.keys.tensors()
        for kind, t in self.values.tensors():
            yield f"value_{kind}", t


@dataclass
class QJLLayer:
    """One layer: the sketches, the quantized tokens and the full-precision recent window.

    ``segments`` hold the oldest ``n_quantized`` tokens in order (after the first ``dropped``: the
    outlier groups a local layer dropped once they left its window, ``QJL._trim``); res_k/res_v
    [Hkv, r, d] the r most recent. The first ``shared`` segments are also held by a fork of this
    cache (``__deepcopy__``): a flush starts a segment of its own after them instead of extending
    them. Every tensor here is replaced, never written in place, so a fork shares them all until it
    writes its own.
    """

    s: Tensor  # float32 [m, d]
    s_out: Tensor  # float32 [m_out, d]
    segments: list[QJLSegment]
    res_k: Tensor
    res_v: Tensor
    n_seen: int
    shared: int = 0
    dropped: int = 0

    @property
    def n_quantized(self) -> int:
        return sum(seg.n for seg in self.segments)

    @property
    def keys(self) -> QuantizedKeys | None:
        """All quantized keys as one ``QuantizedKeys`` (a copy when there are several segments)."""
        return _merged(self.segments).keys if self.segments else None

    @property
    def values(self) -> QuantizedGroups | None:
        return _merged(self.segments).values if self.segments else None

    def add(self, seg: QJLSegment) -> None:
        """Store newly quantized tokens after the others."""
        if len(self.segments) > self.shared:
            self.segments[-1] = self.segments[-1].cat(seg)
        else:
            self.segments.append(seg)

    def __deepcopy__(self, memo: dict) -> QJLLayer:
        """A fork: the same tensors, its own list of segments; from now on neither extends the shared ones."""
        self.shared = len(self.segments)
        segments = list(self.segments)
        twin = QJLLayer(self.s, self.s_out, segments, self.res_k, self.res_v, self.n_seen, self.shared, self.dropped)
        memo[id(self)] = twin
        return twin


def _merged(segments: list[QJLSegment]) -> QJLSegment:
    return functools.reduce(QJLSegment.cat, segments)


@dataclass
class QJLPlan:
    """The knobs chosen for a budget, and the bytes they imply per layer and KV head."""

    m: list[int]  # per layer
    m_out: list[int]
    value_bits: int
    residual: int
    key_bytes_per_token: float  # mean over layers, quantized tokens
    value_bytes_per_token: float
    target_bytes: float | None
    planned_bytes: float

    def knobs(self, d: int) -> dict:
        return {
            "m": self.m[-1],
            "m_initial": self.m[0],
            "m_out": self.m_out[-1],
            "m_out_initial": self.m_out[0],
            "value_bits": self.value_bits,
            "residual": self.residual,
            "key_bits_per_coord": round(8 * self.key_bytes_per_token / d, 3),
            "value_bits_per_coord": round(8 * self.value_bytes_per_token / d, 3),
            "fits_budget": self.target_bytes is None or self.planned_bytes <= self.target_bytes,
        }


class QJL(Compressor):
    name = "qjl"
    title = "QJL"
    group = "paper"
    paper = (
        "Zandieh, Daliri, Han. QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero "
        "Overhead. arXiv:2406.03482 (AAAI 2025), https://arxiv.org/abs/2406.03482"
    )
    summary = (
        "Keys as sign bits of a random (orthogonalized) projection plus their norm, with outlier channels "
        "sketched separately; values group-quantized; a recent window at full precision."
    )
    streaming = True
    params = (
        Param(
            "m",
            None,
            "sketch size (sign bits per key) on the later layers, a multiple of 8; from the budget "
            "when not given (paper: 2 x head_dim)",
            minimum=M_MIN,
            kind=int,
        ),
        Param("initial_factor", 2, "the first layers use m x this (reference: 512 vs 256)", minimum=1),
        Param(
            "initial_layers",
            None,
            "how many first layers use the larger sketch (reference: 15 of 32 layers, "
            "scaled to the model when not given)",
            minimum=0,
            kind=int,
        ),
        Param(
            "m_out_ratio",
            1.0,
            "outlier sketch size as a fraction of the later layers' m, on every layer (reference: 256 / 256)",
            minimum=0.0,
        ),
        Param(
            "n_outliers",
            None,
            "outlier channels per token group, 0 for none (reference: 8 for head_dim 128; "
            "head_dim / 16 when not given)",
            minimum=0,
            kind=int,
        ),
        Param("outlier_group", 32, "tokens per outlier group; also the flush unit of the window", minimum=1),
        Param(
            "value_bits",
            None,
            "bits per value coordinate: 1, 2, 3, 4 or 8 (reference: 2); from the budget when not given",
            choices=(None, 1, 2, 3, 4, 8),
            kind=int,
        ),
        Param("value_group", 32, "coordinates per value quantization group (reference: 32)", minimum=1),
        Param(
            "residual",
            None,
            "recent tokens kept at full precision at most (reference: 128); from the budget when not given",
            minimum=1,
            kind=int,
        ),
        Param("orthogonalize", True, "orthogonalize the sketch rows by QR in blocks of head_dim (Sec. 4.1)"),
        Param(
            "split_query",
            True,
            "estimate each part's score with the query restricted to that part's channels, as the authors' "
            "score kernel does (same storage, lower variance); off: the full query against both sketches",
        ),
        Param(
            "products",
            "bfloat16",
            "dtype of the split-query score products on the CPU: bfloat16 (S q rounded to 8 significant bits, "
            "signs exact; about half the time of float32) or float32",
            choices=("bfloat16", "float32"),
        ),
        Param(
            "count_sketch",
            False,
            "count the sketch matrices in each sequence's held bytes (the budget then pays for them); by default "
            "they are per-model state, one copy shared across sequences, shown apart (shared_bytes)",
        ),
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.cfg["m"] is not None and self.cfg["m"] % 8:
            raise ParamError(f"qjl: parameter m={self.cfg['m']} must be a multiple of 8 (bits are packed in bytes)")

    # ----- planning ----------------------------------------------------------------------------
    def _layer_m(self, m: int) -> tuple[list[int], list[int]]:
        n_layers = self.info.n_layers
        n_init = self.cfg["initial_layers"]
        if n_init is None:
            n_init = round(n_layers * 15 / 32)
        ms = [m * (self.cfg["initial_factor"] if i < n_init else 1) for i in range(n_layers)]
        m_out = self.n_out and max(M_MIN, _round8(m * self.cfg["m_out_ratio"]))
        return ms, [m_out] * n_layers

    @property
    def n_out(self) -> int:
        n = self.cfg["n_outliers"]
        return self._default_n_out() if n is None else min(int(n), self.info.head_dim)

    def _default_n_out(self) -> int:
        return max(1, self.info.head_dim // 16)

    def _key_bytes(self, ms: list[int], m_outs: list[int]) -> float:
        """Bytes per quantized token, mean over layers: bits + fp16 norm per sketch + its share of indices."""
        per_layer = [m // 8 + 2 + (mo // 8 + 2 if self.n_out else 0) for m, mo in zip(ms, m_outs)]
        return sum(per_layer) / len(per_layer) + self.n_out / self.cfg["outlier_group"]

    def _value_bytes(self, bits: int) -> float:
        """Bytes of one quantized value (the value head size: smaller than the key's under latent attention)."""
        d, g = self.info.v_head_dim, self.cfg["value_group"]
        n_groups = -(-d // g)  # a group longer than the head is padded (``quantize_groups``)
        return n_groups * (packed_bytes(g, bits) + 4)

    def _sketch_bytes(self, ms: list[int], m_outs: list[int]) -> float:
        """Sketch bytes per KV head (all layers' S and S_out, float32, shared by the heads of a layer)."""
        if not self.cfg["count_sketch"]:
            return 0.0
        total = sum((m + mo) * self.info.head_dim * 4 for m, mo in zip(ms, m_outs))
        return total / self.info.n_kv_heads / self.info.n_layers

    def _bytes(self, n: int, m: int, bits: int, residual: int) -> tuple[float, float, float, list, list]:
        """Worst-case bytes per layer and KV head for n tokens (the window full), and its parts."""
        ms, m_outs = self._layer_m(m)
        kb, vb = self._key_bytes(ms, m_outs), self._value_bytes(bits)
        r = min(n, residual)
        total = r * per_token_bytes(self.info) + (n - r) * (kb + vb) + self._sketch_bytes(ms, m_outs)
        return total, kb, vb, ms, m_outs

    full: bool  # set by plan: no budget, nothing compressed

    def plan(self, n_prompt: int) -> dict:
        self.full = self.is_full
        d = self.info.head_dim
        if self.full or self.budget is None:  # (no budget: full)
            m, bits, residual, target = self.cfg["m"] or 2 * d, self.cfg["value_bits"] or 2, None, None
        else:
            target = self.budget.target_bytes(self.info, n_prompt) / (self.info.n_layers * self.info.n_kv_heads)
            m, bits, residual = self._fit(n_prompt, target)
        total, kb, vb, ms, m_outs = self._bytes(n_prompt, m, bits, residual or n_prompt)
        if (
            self.info.semantics.has_local and not self.full and residual is not None
        ):  # a local layer holds what its window still sees
            streams = self.info.n_layers * self.info.n_kv_heads
            total = float(self._local_held(n_prompt, m, bits, residual, 0)[0]) * self.info.n_kv_heads / streams
        self.qplan = QJLPlan(ms, m_outs, bits, residual or 0, kb, vb, target, total)
        if self.full:  # no budget: every token stays exact, nothing is sketched
            return {"uncompressed": True, "residual": n_prompt}
        knobs = self.qplan.knobs(d)
        knobs["fits_budget"] = fits_budget(self, n_prompt)
        if self.cfg["outlier_group"] != self.defaults()["outlier_group"]:
            knobs["outlier_group"] = self.cfg["outlier_group"]
        if self.n_out != self._default_n_out():
            knobs["n_outliers"] = self.n_out
        return knobs

    def _fit(self, n: int, target: float) -> tuple[int, int, int]:
        """(m, value bits, window) that hold the budget up to the horizon. When even m = 8 and 1-bit values
        do not, the knobs not given degrade in turn: the flush group (and with it the smallest window)
        halves down to 1 token, then the outlier sketch is dropped. Nothing fits: the last try (refused)."""
        given = self.params_given
        groups = [self.cfg["outlier_group"]]
        while "outlier_group" not in given and groups[-1] > 1:
            groups.append(groups[-1] // 2)
        outliers = [self.cfg["n_outliers"]] + ([0] if "n_outliers" not in given and self.n_out else [])
        for n_out in outliers:
            for group in groups:
                self.cfg["n_outliers"], self.cfg["outlier_group"] = n_out, group
                residual = max(group, self.cfg["residual"] or self._auto_residual(target))  # >= one flush group
                m, bits = self._fit_m_bits(n, residual)
                if self._worst_ratio(n, m, bits, residual) <= 1.0:
                    return m, bits, residual
        return m, bits, residual

    def _worst_ratio(self, n: int, m: int, bits: int, residual: int) -> float:
        """Held over allowed bytes, at prefill and at the horizon: with the window full, the held bytes grow
        by one quantized token a step, so the ratio is largest at one end."""
        streams = self.info.n_layers * self.info.n_kv_heads
        h = self.horizon(n)
        assert self.budget is not None  # a compressing plan's
        if self.info.semantics.has_local:
            return self._local_worst_ratio(n, m, bits, residual, h)
        allowed = [max(1.0, self.budget.allowed_bytes(self.info, n, j, True)) for j in (0, h)]
        return max(streams * self._bytes(n + j, m, bits, residual)[0] / a for j, a in zip((0, h), allowed))

    def _local_worst_ratio(self, n: int, m: int, bits: int, residual: int, h: int) -> float:
        """``_worst_ratio`` on a model with local layers, at every step from prefill to ``h``."""
        assert self.budget is not None
        held = self._local_held(n, m, bits, residual, h)
        return float((held / streaming_allowed(self.info, self.budget, n, h)).max())

    def _local_held(self, n: int, m: int, bits: int, residual: int, h: int) -> Tensor:
        """Bytes held over all layers after prefill and each decode step up to ``h`` (float64 [h + 1]) on a
        model with local layers: a local layer holds its full-precision window as it is at that step
        (between residual - group + 1 and residual tokens) and only the outlier groups not yet wholly out
        of its window (``_trim``); a global layer as ``_bytes`` counts it."""
        info, g = self.info, self.cfg["outlier_group"]
        ms, m_outs = self._layer_m(m)
        vb, sketch = self._value_bytes(bits), self._sketch_bytes(ms, m_outs)
        steps = torch.arange(h + 1, dtype=torch.int64)
        seen = n + steps
        t = n - max(0, -(-(n - residual) // g) * g) + steps  # full-precision tokens, before the flushes
        recent = torch.where(t <= residual, t, residual - g + 1 + (t - residual - 1) % g)
        held = torch.zeros(h + 1, dtype=torch.float64)
        for sem, mi, mo in zip(info.semantics.layers, ms, m_outs):
            kb = self._key_bytes([mi], [mo])
            if sem.is_local:
                held += recent * per_token_bytes(info) + local_quantized_held(sem, seen, recent, g) * (kb + vb)
            else:
                r = seen.clamp(max=residual)
                held += r * per_token_bytes(info) + (seen - r) * (kb + vb)
            held += sketch
        return held * info.n_kv_heads

    def budget_ratio(self, n_prompt: int) -> float | None:
        p = self.qplan
        return self._worst_ratio(n_prompt, p.m[-1], p.value_bits, p.residual)

    PAPER_CONFIG = {"m_per_d": 2, "value_bits": 2, "value_group": 32, "residual": 128}

    def paper_fraction(self, n_prompt: int) -> float:
        """The budget (fraction of the exact cache) at which the planner picks the paper's
        configuration for an ``n_prompt``-token prompt: m = 2 x head_dim, 2-bit values in groups of
        32, 128 recent tokens (with this method's other knobs at their values)."""
        p = self.PAPER_CONFIG
        if self.cfg["value_group"] != p["value_group"]:
            raise ParamError(f"qjl: the paper's configuration has value_group={p['value_group']}")
        m, residual = p["m_per_d"] * self.info.head_dim, max(self.cfg["outlier_group"], p["residual"])
        per_stream = self._bytes(n_prompt, m, p["value_bits"], residual)[0]
        return min(1.0, per_stream * (1 + 1e-6) / (n_prompt * per_token_bytes(self.info)))

    def _auto_residual(self, target: float) -> int:
        """Largest multiple of the flush group, at most the reference's 128, using at most a quarter of the budget."""
        group = self.cfg["outlier_group"]
        fit = int(target * RESIDUAL_SHARE // per_token_bytes(self.info)) // group * group
        return max(group, min(max(128, group), fit))

    def _fit_m_bits(self, n: int, residual: int) -> tuple[int, int]:
        """Pick the value width and the largest m that fit the budget (``_worst_ratio`` <= 1).

        Key-score noise dominates the attention error (it scales as ||q|| ||k|| / sqrt(m)), so values
        get 8 bits only when m >= 8 d still fits, 4 bits when m >= 4 d fits, else 2 bits (the reference),
        and 1 bit only when even m = 16 does not fit with 2.
        """
        d, m_fixed, b_fixed = self.info.head_dim, self.cfg["m"], self.cfg["value_bits"]
        choices = [(b_fixed, 0)] if b_fixed is not None else [(8, 8 * d), (4, 4 * d), (2, 2 * M_MIN), (1, 0)]
        for bits, m_needed in choices:
            if m_fixed is not None:
                if self._worst_ratio(n, m_fixed, bits, residual) <= 1.0 or m_needed == 0:
                    return m_fixed, bits
                continue
            m = self._largest_m(n, bits, residual)
            if m >= m_needed:
                return min(m, M_MAX_PER_D * d), bits
        raise AssertionError("unreachable: the last choice accepts any m")

    def _largest_m(self, n: int, bits: int, residual: int) -> int:
        lo, hi = M_MIN, 64 * self.info.head_dim
        if self._worst_ratio(n, lo, bits, residual) > 1.0:
            return lo
        while lo < hi:  # bytes grow with m: bisect over multiples of 8
            mid = _round8((lo + hi + 8) // 2)
            lo, hi = (mid, hi) if self._worst_ratio(n, mid, bits, residual) <= 1.0 else (lo, mid - 8)
        return lo

    # ----- compression -----------------------------------------------------------------------
    def compress(self, state: PrefillState) -> None:
        keys, values = state.keys, state.values
        n_layers, _, n, d = keys.shape
        p = self.qplan
        self.layers = []
        sketches = self._make_sketches(d, keys.device)
        residual = n if self.full else p.residual
        n_q = max(0, -(-(n - residual) // self.cfg["outlier_group"]) * self.cfg["outlier_group"])
        stores = self._quantize_all(keys[..., :n_q, :], values[..., :n_q, :], sketches) if n_q else None
        for layer in range(n_layers):
            segments = [] if stores is None else [QJLSegment(*stores[layer])]
            s, s_out = sketches[layer]
            res_k, res_v = self.as_cached(keys[layer, :, n_q:]), self.as_cached(values[layer, :, n_q:])
            self.layers.append(QJLLayer(s, s_out, segments, res_k, res_v, n))
            self._trim(layer)

    def _make_sketches(self, d: int, device) -> list[tuple[Tensor, Tensor]]:
        """Per layer (S, S_out), generated in batches of layers sharing a size, from the seed."""
        p, orth = self.qplan, self.cfg["orthogonalize"]
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for m, m_out in sorted(set(zip(p.m, p.m_out))):
            layers = [i for i in range(len(p.m)) if (p.m[i], p.m_out[i]) == (m, m_out)]
            s = make_sketch(len(layers), m, d, self.generator, orth).to(device)
            s_out = make_sketch(len(layers), max(m_out, M_MIN), d, self.generator, orth).to(device)
            out.update({layer: (s[j], s_out[j]) for j, layer in enumerate(layers)})
        return [out[i] for i in range(len(p.m))]

    def _quantize_all(self, k: Tensor, v: Tensor, sketches) -> list[tuple[QuantizedKeys, QuantizedGroups]]:
        """Quantize k, v [L, Hkv, n, d] (n a multiple of the outlier group), one layer at a time.

        Per layer the projections stay cache-sized (~12 MB at 1.9k tokens, m = 560) instead of one
        ~360 MB tensor for all layers: half the time at 1.9k tokens, the same bits.
        """
        out = []
        for layer, (s, s_out) in enumerate(sketches):
            cancel.checkpoint()
            kq = self._quantize_keys(k[layer : layer + 1], s[None], s_out[None])
            vq = quantize_groups(v[layer : layer + 1], self.qplan.value_bits, self.cfg["value_group"], dim=-1)
            out.append((kq.layer(0), _index_groups(vq, 0)))
        return out

    def _quantize_keys(self, k: Tensor, s: Tensor, s_out: Tensor) -> QuantizedKeys:
        """k [L, H, n, d] -> QuantizedKeys with a leading layer dim; S [L, m, d], S_out [L, m_out, d]."""
        return quantize_keys(k, s, s_out, self.cfg["outlier_group"], self.n_out)

    # ----- decoding ------------------------------------------------------------------------------
    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        st = self.layers[layer]
        self._extend_window(st, k, v)
        if not self.full and st.res_k.shape[-2] > self.qplan.residual:
            self._flush(st)
        self._trim(layer)

    def _trim(self, layer: int) -> None:
        """On a local layer, drop the quantized outlier groups whose every token has left the newest
        query's window (or chunk); the full-precision window is kept whole. Nothing on a global layer."""
        sem, st, g = self.sem[layer], self.layers[layer], self.cfg["outlier_group"]
        if not sem.is_local or not st.segments:
            return
        first = int(first_group_held(sem, torch.tensor(st.n_seen - 1), g))
        cut = min(first, st.n_seen - st.res_k.shape[-2]) - st.dropped
        if cut <= 0:
            return
        st.dropped += cut
        kept, whole = [], 0
        for seg in st.segments:
            if cut >= seg.n:
                cut -= seg.n
                whole += 1
                continue
            kept.append(seg.without_first(cut, g) if cut else seg)
            cut = 0
        st.segments, st.shared = kept, max(0, st.shared - whole)

    def _extend_window(self, st: QJLLayer, k: Tensor, v: Tensor) -> None:
        """Append k, v [Hkv, c, d] to the full-precision window (no flush)."""
        st.res_k = torch.cat([st.res_k, k.to(st.res_k.dtype)], -2)
        st.res_v = torch.cat([st.res_v, v.to(st.res_v.dtype)], -2)
        st.n_seen += k.shape[-2]

    def _flush(self, st: QJLLayer) -> None:
        """Move the oldest outlier group of the window into the quantized store."""
        g = self.cfg["outlier_group"]
        kq = self._quantize_keys(st.res_k[None, :, :g], st.s[None], st.s_out[None])
        vq = quantize_groups(st.res_v[None, :, :g], self.qplan.value_bits, self.cfg["value_group"], dim=-1)
        st.add(QJLSegment(kq.layer(0), _index_groups(vq, 0)))
        st.res_k, st.res_v = st.res_k[:, g:].clone(), st.res_v[:, g:].clone()

    def feed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        """A chunk of c tokens, exactly as c ``append`` + ``attend`` steps: q [Hq, c, d], k/v [Hkv, c, d] -> [Hq, c, d].

        The chunk is cut where an append would flush: the tokens before that point join the window
        together and attend in one call, causally among themselves (every quantized token and the
        older window are visible to all of them); the token that flushes takes the per-token path.
        """
        st, c = self.layers[layer], q.shape[-2]
        outs, i = [], 0
        while i < c:
            j = c if self.full else min(c, i + self.qplan.residual - st.res_k.shape[-2])  # appends without a flush
            if j > i:
                self._extend_window(st, k[:, i:j], v[:, i:j])
                outs.append(self.attend(layer, q[:, i:j], causal_tail=j - i))
                self._trim(layer)
            else:
                self.append(layer, k[:, i : i + 1], v[:, i : i + 1], pos + i)
                outs.append(self.attend(layer, q[:, i : i + 1]))
                j = i + 1
            i = j
        return torch.cat(outs, dim=-2)

    def attend(self, layer: int, q: Tensor, causal_tail: int = 0) -> Tensor:
        """One softmax over estimated scores (quantized tokens) and exact scores (window). q [Hq, t, d].

        ``causal_tail`` = t: the t queries are the window's last t tokens, each seeing none after
        its own (``kvlab.core.semantics.attend``'s convention). Computed per KV group (the group's
        query heads as rows). The quantized values are never dequantized as a whole: their
        probability-weighted sum is read from the codes (``weighted_token_sum``).
        """
        st = self.layers[layer]
        # [Hkv, g*t, n]: the layer's soft-cap, window and sinks on the estimates (``semantics.grouped_softmax``)
        probs = grouped_softmax(self._logits(st, q, causal_tail), self.sem[layer], q.shape[0], st.n_seen, q.shape[-2])
        out = torch.matmul(probs[..., st.n_quantized :], st.res_v.float())
        for seg, lo in zip(st.segments, _starts(st.segments)):
            out = out + weighted_token_sum(probs[..., lo : lo + seg.n], seg.values)
        return ungroup(out, q.shape[0]).to(q.dtype)

    @staticmethod
    def attend_many(comps: list[QJL], layer: int, q: Tensor) -> list[Tensor]:
        """``attend`` of several rows in one call: q [R, Hq, 1, d], row i through ``comps[i]`` -> R x [Hq, 1, d].

        A segment held by several rows (forks of one compressed context: the questions asked after
        compression) is read once for all of them: its score estimates take all their queries in one
        product, and its values one probability-weighted sum. The maths is ``attend``'s, row by row.
        """
        layers = [c.layers[layer] for c in comps]
        hkv, hq = layers[0].res_k.shape[0], q.shape[1]
        qg = [group_queries(q[i].float() * c.scaling, hkv) for i, c in enumerate(comps)]  # [Hkv, g, d] each
        holders = _holders(layers)
        scores: dict[tuple[int, int], Tensor] = {}
        for seg, rows in holders:
            first = rows[0]
            est = comps[first]._segment_scores(layers[first], seg, torch.cat([qg[i] for i in rows], 1))
            scores.update(zip(((i, id(seg)) for i in rows), est.chunk(len(rows), dim=1)))
        outs, probs = [], []
        for i, st in enumerate(layers):
            window = torch.matmul(qg[i], st.res_k.float().transpose(-1, -2))
            p = torch.cat([*(scores[i, id(seg)] for seg in st.segments), window], -1)
            p = grouped_softmax(p, comps[i].sem[layer], hq, st.n_seen)
            probs.append(p)
            outs.append(torch.matmul(p[..., st.n_quantized :], st.res_v.float()))
        starts = [dict(zip(map(id, st.segments), _starts(st.segments))) for st in layers]  # row -> segment -> first
        for seg, rows in holders:
            parts = [probs[i][..., starts[i][id(seg)] :][..., : seg.n] for i in rows]
            summed = weighted_token_sum(torch.cat(parts, 1), seg.values).chunk(len(rows), dim=1)
            for i, s in zip(rows, summed):
                outs[i] = outs[i] + s
        return [ungroup(o, hq).to(q.dtype) for o in outs]

    def _logits(self, st: QJLLayer, q: Tensor, causal_tail: int = 0) -> Tensor:
        """Scaled logits per KV group: estimates for the quantized tokens, then the exact window: q [Hq, t, d] ->
        [Hkv, g*t, n_quantized + window], with the window's last ``causal_tail`` keys masked causally."""
        hkv = st.res_k.shape[0]
        qg = group_queries(q.float() * self.scaling, hkv)  # [Hkv, g*t, d]; the estimates are linear in q
        logits = torch.matmul(qg, st.res_k.float().transpose(-1, -2))
        if causal_tail > 1:  # rows are (query head, query) pairs: mask per head
            sm.mask_future(logits.view(hkv, -1, causal_tail, logits.shape[-1]), causal_tail)
        if st.segments:
            logits = torch.cat([*(self._segment_scores(st, seg, qg) for seg in st.segments), logits], -1)
        return logits

    def _segment_scores(self, st: QJLLayer, seg: QJLSegment, qg: Tensor) -> Tensor:
        """Estimated scores of a segment's keys, inliers plus outliers: qg [Hkv, R, d] -> [Hkv, R, seg.n].

        Triton on CUDA (split or not), the same maths in torch elsewhere."""
        kq, has_out = seg.keys, seg.keys.out_bits.shape[-1] > 0
        if self.cfg["split_query"] and has_out:
            g = self.cfg["outlier_group"]
            outliers = (st.s_out, kq.out_bits, kq.out_norms, kq.out_idx)
            products = getattr(torch, self.cfg["products"])
            return qjl_estimate_split_pair(qg, st.s, kq.bits, kq.norms, *outliers, g, products)
        est = qjl_estimate_grouped(qg, st.s, kq.bits, kq.norms)  # Triton on CUDA, estimate_scores' maths elsewhere
        if has_out:
            est = est + qjl_estimate_grouped(qg, st.s_out, kq.out_bits, kq.out_norms)
        return est

    # ----- bytes ----------------------------------------------------------------------------------
    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for st in self.layers:
            for seg in st.segments:
                yield from seg.tensors()
            yield "residual_keys", st.res_k
            yield "residual_values", st.res_v
        if self.cfg["count_sketch"]:
            yield from self._sketches()

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The sketch matrices S (and S_out), one per layer, shared by every sequence (unless ``count_sketch``)."""
        if not self.cfg["count_sketch"]:
            yield from self._sketches()

    def _sketches(self) -> Iterator[tuple[str, Tensor]]:
        for st in self.layers:
            yield "sketch", st.s
            if self.n_out:
                yield "sketch", st.s_out

    def bits_per_coordinate(self) -> dict[str, float]:
        """Bits per stored coordinate measured from the tensors held (quantized tokens vs window)."""
        by = self.nbytes_by_kind()
        d, hkv = self.info.head_dim, self.info.n_kv_heads
        n_q = sum(st.n_quantized for st in self.layers) * hkv
        key_kinds = ("key_bits", "key_norms", "outlier_bits", "outlier_norms", "outlier_indices")
        val_kinds = ("value_codes", "value_scales", "value_zero_points")
        kb, vb = sum(by.get(k, 0) for k in key_kinds), sum(by.get(k, 0) for k in val_kinds)
        total_coords = sum(st.n_seen for st in self.layers) * hkv * d * 2
        return {
            "keys": 8 * kb / max(1, n_q * d),
            "values": 8 * vb / max(1, n_q * d),
            "overall": 8 * self.nbytes() / max(1, total_coords),
        }

    def kept_positions(self, layer: int) -> Tensor | None:
        st = self.layers[layer]
        r = st.res_k.shape[-2]
        pos = torch.arange(st.n_seen - r, st.n_seen, dtype=torch.int32, device=st.res_k.device)
        return pos.expand(st.res_k.shape[0], r)

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """The softmax ``attend`` takes: sketched score estimates (quantized tokens, positions
        0..n_quantized-1), exact scores (the recent window, the positions after); 0 for the groups a
        local layer dropped. q [Hq, 1, d] -> [Hq, n]."""
        st = self.layers[layer]
        w = ungroup(grouped_softmax(self._logits(st, q), self.sem[layer], q.shape[0], st.n_seen), q.shape[0])[:, 0]
        return torch.nn.functional.pad(w, (st.dropped, 0)) if st.dropped else w


def _starts(segments: list[QJLSegment]) -> list[int]:
    """Each segment's first token among the quantized ones."""
    out, lo = [], 0
    for seg in segments:
        out.append(lo)
        lo += seg.n
    return out


def _holders(layers: list[QJLLayer]) -> list[tuple[QJLSegment, list[int]]]:
    """Every segment held by any of ``layers`` (one row each), with the rows that hold it, in first-seen order."""
    rows: dict[int, tuple[QJLSegment, list[int]]] = {}
    for i, st in enumerate(layers):
        for seg in st.segments:
            rows.setdefault(id(seg), (seg, []))[1].append(i)
    return list(rows.values())


def _round8(x: float) -> int:
    return max(M_MIN, int(x) // 8 * 8)


def _index_groups(q: QuantizedGroups, j: int) -> QuantizedGroups:
    """Drop the leading (layer) dim of a QuantizedGroups built over [L, ...]."""
    return QuantizedGroups(q.codes[j], q.scale[j], q.minimum[j], q.bits, q.group, q.dim - 1, q.length)


__all__ = [
    "QJL",
    "QuantizedKeys",
    "dense_key_estimate",
    "estimate_scores",
    "estimate_scores_split",
    "quantize_keys",
    "sketch_keys",
]
