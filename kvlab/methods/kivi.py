"""KIVI: asymmetric low-bit quantization of the KV cache — keys per channel, values per token.

Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu. "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", ICML 2024, https://arxiv.org/abs/2402.02750 — Sec. 3 and Algorithm 1: keys have
outlier *channels*, so they are quantized per channel, in groups of ``group`` consecutive tokens;
values are quantized per token, in groups of ``group`` channels along head_dim; both with a
min/scale (asymmetric) code of ``bits`` bits. The most recent tokens stay in full precision (the
residual) and are quantized ``group`` tokens at a time as decoding pushes them out.

Here the residual holds between ``residual`` and ``residual + group - 1`` tokens (keys and values
alike): when it reaches ``residual + group`` tokens, its oldest ``group`` are quantized. Storage is
packed codes (``kernels.quant``; 3-bit codes packed 8 in 3 bytes), float16 scales and minimums, and the
full-precision residual; positions are implicit (every token is kept). The budget picks the
highest bit-width whose quantized cache fits, then the longest residual that still fits, both
held at every decode step (the residual grows by up to ``group - 1`` full-precision tokens between
flushes); a group left at its default shrinks to 16 or 8 on prompts too short for anything else.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.quant import (
    QuantizedGroups,
    cat_groups,
    dequantize_groups,
    packed_bytes,
    quantize_groups,
    weighted_token_sum,
)
from kernels.tensor_ops import group_queries, ungroup
from kvlab.core.budgets import exact_bytes
from kvlab.core.model import ModelInfo
from kvlab.core.semantics import LayerSemantics, grouped_softmax
from kvlab.methods.base import Compressor
from kvlab.methods.bit_split import candidates, choose, side_params, split_param
from kvlab.methods.budget_search import fits_budget
from kvlab.methods.dense import _Growable
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param, ParamError

KIVI_BITS = (4, 3, 2)  # highest first: the budget solver tries them in this order
Bits = int | tuple[float, float]  # one width for keys and values, or (key bits, value bits)


def kv_bits(bits: Bits) -> tuple[int, int]:
    """(key bits, value bits) of ``bits``: one width for both, or a pair."""
    if isinstance(bits, (tuple, list)):
        return int(bits[0]), int(bits[1])
    return int(bits), int(bits)


def shown_bits(bits: Bits) -> Bits:
    """A width as plans report it: one int when keys and values share it, else the pair."""
    kb, vb = kv_bits(bits)
    return kb if kb == vb else (kb, vb)


def extend_groups(a: QuantizedGroups | None, b: QuantizedGroups) -> QuantizedGroups:
    """Append ``b``'s groups after ``a``'s along the quantized dim (``a`` must hold whole groups)."""
    if a is None:
        return b
    assert a.length % a.group == 0 and (a.bits, a.group, a.dim) == (b.bits, b.group, b.dim)
    return QuantizedGroups(
        torch.cat([a.codes, b.codes], -2),
        torch.cat([a.scale, b.scale], -1),
        torch.cat([a.minimum, b.minimum], -1),
        a.bits,
        a.group,
        a.dim,
        a.length + b.length,
    )


def quantize_kv(
    k: Tensor, v: Tensor, bits: Bits, group: int, value_group: int | None = None
) -> tuple[QuantizedGroups, QuantizedGroups]:
    """KIVI's asymmetric pair for k, v [..., n, d] (n a multiple of ``group``): keys grouped along
    tokens (per channel), values grouped along head_dim (per token), in groups of ``value_group``
    channels (None: ``group``), at most head_dim; ``bits`` one width or (key bits, value bits)."""
    kb, vb = kv_bits(bits)
    return quantize_groups(k, kb, group, dim=-2), quantize_groups(v, vb, min(value_group or group, v.shape[-1]), dim=-1)


def split_layers(q: QuantizedGroups) -> list[QuantizedGroups]:
    """A tensor quantized with a leading layer dim -> one ``QuantizedGroups`` per layer."""
    return [
        QuantizedGroups(c, s, m, q.bits, q.group, q.dim - 1, q.length) for c, s, m in zip(q.codes, q.scale, q.minimum)
    ]


def quantized_len(n: int, residual: int, group: int) -> int:
    """Tokens in the quantized part when ``n`` are held: whole groups beyond the residual."""
    return max(0, (n - residual) // group) * group


def kivi_held(info: ModelInfo, nq: int, r: int, bits: Bits, group: int, value_group: int | None = None) -> int:
    """Bytes ``KIVI`` holds with ``nq`` quantized tokens (whole groups) and ``r`` full-precision ones."""
    return info.n_layers * info.n_kv_heads * kivi_stream_bytes(info, nq, r, bits, group, value_group)


def kivi_stream_bytes(info: ModelInfo, nq, r, bits: Bits, group: int, value_group: int | None = None):
    """``kivi_held`` of one layer and KV head (``nq``, ``r``: ints, or integer tensors of them). Keys and values
    at their own head sizes (multi-head latent attention: values smaller than keys)."""
    d, dv = info.head_dim, info.v_head_dim
    kb, vb = kv_bits(bits)
    gv = min(value_group or group, dv)
    key = d * (nq // group) * (packed_bytes(group, kb) + 4)  # packed codes + fp16 scale + fp16 min per group
    val = nq * (-(-dv // gv)) * (packed_bytes(gv, vb) + 4)
    return key + val + r * (d + dv) * info.dtype_bytes


def first_group_held(sem: LayerSemantics, newest: Tensor, group: int) -> Tensor:
    """The first position a local layer still holds in its quantized store when its newest token is at
    ``newest`` (an integer tensor of positions): the start of the group of ``group`` positions (groups
    start at multiples of ``group``) that holds the first key the newest query sees
    (``LayerSemantics.visible_from``); every group before it has left the window whole."""
    first = torch.zeros_like(newest)
    if sem.window is not None:
        first = torch.maximum(first, newest - sem.window + 1)
    if sem.chunk is not None:
        first = torch.maximum(first, newest - newest % sem.chunk)
    return first // group * group


def local_quantized_held(sem: LayerSemantics, seen: Tensor, recent: Tensor, group: int) -> Tensor:
    """Quantized tokens a local layer holds with ``seen`` tokens seen, the latest ``recent`` of them in
    full precision and the ones before in whole groups of ``group`` from position 0 (integer tensors):
    the groups not yet wholly out of the newest query's window or chunk."""
    end = seen - recent
    return (end - first_group_held(sem, seen - 1, group)).clamp(min=0)


def kivi_bytes(info: ModelInfo, n: int, bits: Bits, group: int, residual: int) -> int:
    """The bytes ``KIVI`` will hold for ``n`` tokens (for planning; the run counts its tensors)."""
    nq = quantized_len(n, residual, group)
    return kivi_held(info, nq, n - nq, bits, group)


def residual_after(n: int, residual: int, group: int, steps: int) -> int:
    """Full-precision tokens held ``steps`` decode steps after compressing ``n``: the residual grows by
    one a step and drops by ``group`` when it reaches ``residual + group``."""
    t = n - quantized_len(n, residual, group) + steps
    return t if t < residual + group else residual + (t - residual) % group


def kivi_worst_ratio(
    info: ModelInfo, budget, n: int, bits: Bits, group: int, residual: int, horizon: int, value_group: int | None = None
) -> float:
    """The largest ratio of held to allowed bytes from prefill to ``horizon`` decode steps (streaming).

    Between flushes the held bytes grow by a full token a step, faster than any budget's allowance, so
    the ratio peaks at prefill, just before a flush (the first or the last one) or at the horizon.
    On a model with local layers every step is counted (``kivi_local_worst_ratio``)."""
    if info.semantics.has_local:
        return kivi_local_worst_ratio(info, budget, n, bits, group, residual, horizon, value_group)
    first = residual + group - 1 - (n - quantized_len(n, residual, group))
    steps = {0, horizon}
    if first <= horizon:
        steps |= {first, first + (horizon - first) // group * group}
    worst = 0.0
    for j in steps:
        r = residual_after(n, residual, group, j)
        held = kivi_held(info, n + j - r, r, bits, group, value_group)
        worst = max(worst, held / max(1.0, budget.allowed_bytes(info, n, j, True)))
    return worst


def kivi_local_worst_ratio(
    info: ModelInfo, budget, n: int, bits: Bits, group: int, residual: int, horizon: int, value_group: int | None
) -> float:
    """``kivi_worst_ratio`` on a model with local layers, at every step from prefill to ``horizon``: a
    local layer drops its quantized groups once they have left the window whole (``KiviLayer.trim``),
    so what it holds rises and falls with the window's position against the groups."""
    held = kivi_local_held(info, n, bits, group, residual, horizon, value_group)
    return float((held / streaming_allowed(info, budget, n, horizon)).max())


def kivi_local_held(
    info: ModelInfo, n: int, bits: Bits, group: int, residual: int, horizon: int, value_group: int | None = None
) -> Tensor:
    """The bytes ``KIVI`` holds after prefill and each decode step up to ``horizon`` (int64 [horizon + 1]),
    a local layer without its quantized groups that left the window whole (global layers: ``kivi_held``)."""
    steps = torch.arange(horizon + 1, dtype=torch.int64)
    seen = n + steps
    t = n - quantized_len(n, residual, group) + steps  # full-precision tokens, before the flushes
    recent = torch.where(t < residual + group, t, residual + (t - residual) % group)
    quantized = seen - recent
    held = torch.zeros_like(steps)
    for sem in info.semantics.layers:
        nq = local_quantized_held(sem, seen, recent, group) if sem.is_local else quantized
        held = held + kivi_stream_bytes(info, nq, recent, bits, group, value_group)
    return held * info.n_kv_heads


_ALLOWED: dict[tuple, tuple[ModelInfo, Tensor]] = {}  # (id(info), budget, n, horizon) -> (info, allowed per step)


def streaming_allowed(info: ModelInfo, budget, n: int, horizon: int) -> Tensor:
    """Bytes a streaming method may hold at each step 0..``horizon`` (at least 1), float64; the latest
    few are kept, as a plan's search asks for the same ones many times."""
    key = (id(info), budget, n, horizon)
    hit = _ALLOWED.get(key)
    if hit is None or hit[0] is not info:
        allowed = [max(1.0, budget.allowed_bytes(info, n, j, True)) for j in range(horizon + 1)]
        if len(_ALLOWED) >= 8:
            _ALLOWED.clear()
        hit = _ALLOWED[key] = (info, torch.tensor(allowed, dtype=torch.float64))
    return hit[1]


def solve_kivi(
    info: ModelInfo,
    n: int,
    budget,
    group: int,
    bits: Bits | None,
    residual: int | None,
    horizon: int,
    value_group: int | None = None,
    pairs: list[tuple[int, int]] | None = None,
):
    """(bits, residual) for ``budget`` on an ``n``-token prompt, held for ``horizon`` decode steps: the
    width that fits with no residual and holds the most bytes (``bit_split.choose``: ``bits`` given, that one;
    else among ``pairs`` of (key bits, value bits), by default the equal ones), then the longest residual that
    still fits (unless given). The bits come back as ``shown_bits`` gives them. Returns None when nothing fits
    (the caller refuses or degrades the group)."""

    def fits(b: Bits, r: int) -> bool:
        return kivi_worst_ratio(info, budget, n, b, group, r, horizon, value_group) <= 1.0

    if bits is not None:
        options = [kv_bits(bits)]
    else:
        options = [(int(k), int(v)) for k, v in pairs] if pairs is not None else [(b, b) for b in KIVI_BITS]
    r0 = residual if residual is not None else 0
    chosen, ok = choose(
        options, lambda p: fits(p, r0), lambda p: float(kivi_stream_bytes(info, group, 0, p, group, value_group))
    )
    if not ok:
        return None
    b = shown_bits(chosen)
    if residual is not None:
        return b, residual
    lo, hi = 0, n  # bytes grow with the residual: binary search the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(b, mid) else (lo, mid - 1)
    return b, lo


@dataclass
class KiviLayer:
    """One layer: quantized keys (per channel) and values (per token) of the oldest tokens, then
    the full-precision residual [Hkv, r, d]. ``seen``: the tokens seen; ``dropped``: the oldest of
    them no longer held (a local layer's quantized groups that left its window, ``trim``)."""

    kq: QuantizedGroups | None
    vq: QuantizedGroups | None
    rk: _Growable
    rv: _Growable
    seen: int = 0
    dropped: int = 0

    def __deepcopy__(self, memo: dict) -> KiviLayer:
        """A fork: the quantized part itself (a flush replaces it, never writes it), its own residual."""
        rk, rv = copy.deepcopy(self.rk, memo), copy.deepcopy(self.rv, memo)
        twin = KiviLayer(self.kq, self.vq, rk, rv, self.seen, self.dropped)
        memo[id(self)] = twin
        return twin

    def trim(self, sem: LayerSemantics, group: int) -> None:
        """On a local layer, drop the quantized groups whose every token has left the newest query's
        window (or chunk); the residual is kept whole. Nothing changes on a global layer."""
        if not sem.is_local or self.kq is None or self.vq is None:
            return
        newest = torch.tensor(self.seen - 1)
        first = min(int(first_group_held(sem, newest, group)), self.seen - self.rk.n)  # quantized tokens end there
        cut = first - self.dropped
        if cut <= 0:
            return
        kq, vq = self.kq, self.vq
        if cut >= kq.length:
            self.kq = self.vq = None
        else:
            g = cut // group
            self.kq = QuantizedGroups(
                kq.codes[..., g:, :].clone(),
                kq.scale[..., g:].clone(),
                kq.minimum[..., g:].clone(),
                kq.bits,
                kq.group,
                kq.dim,
                kq.length - cut,
            )
            self.vq = QuantizedGroups(
                vq.codes[:, cut:].clone(),
                vq.scale[:, cut:].clone(),
                vq.minimum[:, cut:].clone(),
                vq.bits,
                vq.group,
                vq.dim,
                vq.length,
            )
        self.dropped = first

    def quantized(self) -> tuple[QuantizedGroups, QuantizedGroups] | None:
        """The quantized (keys, values), None while nothing is quantized (a flush makes both)."""
        if self.kq is None or self.vq is None:
            return None
        return self.kq, self.vq

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """Keys and values of every token held, float32 [Hkv, n, d] (quantized part first). The codes are
        dequantized in float32, not in the residual's 16-bit cache dtype (that would round them a second
        time); the residual is widened, which is lossless."""
        k, v = self.rk.view().float(), self.rv.view().float()
        quantized = self.quantized()
        if quantized is None:
            return k, v
        kq, vq = quantized
        return torch.cat([dequantize_groups(kq), k], -2), torch.cat([dequantize_groups(vq), v], -2)

    def flush(self, bits: Bits, group: int, value_group: int | None = None) -> None:
        """Quantize the residual's oldest ``group`` tokens."""
        k, v = self.rk.view(), self.rv.view()
        kq, vq = quantize_kv(k[..., :group, :], v[..., :group, :], bits, group, value_group)
        self.kq = extend_groups(self.kq, kq)  # keys: more groups along tokens
        self.vq = vq if self.vq is None else cat_groups([self.vq, vq], dim=-2)  # values: more token rows
        self.rk, self.rv = _Growable(k[..., group:, :].clone()), _Growable(v[..., group:, :].clone())

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name, q in (("keys", self.kq), ("values", self.vq)):
            if q is not None:
                for kind, t in q.tensors():
                    yield f"{name}_{kind}", t
        yield "residual_keys", self.rk.view()
        yield "residual_values", self.rv.view()


class KIVI(Compressor):
    name = "kivi"
    title = "KIVI"
    group = "baseline"
    paper = "Liu et al., KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache, ICML 2024 (arXiv:2402.02750)"
    summary = "Quantizes keys per channel and values per token to 2-4 bits; recent tokens stay full precision."
    streaming = True  # holds its bits-per-token while decoding (the residual is flushed in groups)
    params = (
        Param(
            "bits",
            None,
            "bits per code: 2, 3 or 4 (KIVI-2 / KIVI-4 in the paper; chosen from the budget when not given)",
        ),
        Param(
            "group",
            32,
            "group size: tokens per key group (per channel), channels per value group (per token)",
            minimum=1,
        ),
        Param(
            "residual", None, "recent tokens kept in full precision (paper: 128; chosen from the budget when not given)"
        ),
        *side_params(KIVI_BITS, int, "bits per code"),
        split_param("equal"),
    )

    def plan(self, n_prompt: int) -> dict:
        c, info = self.cfg, self.info
        given = None if c["bits"] is None else kv_bits(c["bits"])
        if given is not None and not set(given) <= set(KIVI_BITS):
            raise ParamError(f"kivi: parameter bits={c['bits']} is not one of 2, 3, 4")
        self.pairs = candidates(
            KIVI_BITS, KIVI_BITS, None, given[0] if given else c["kbits"], given[1] if given else c["vbits"], c["split"]
        )
        bits: Bits | None = shown_bits(self.pairs[0]) if len(self.pairs) == 1 else None
        residual = None if c["residual"] is None else max(0, int(c["residual"]))
        self.group_size = int(c["group"])
        self.value_group: int | None = None  # None: the key group (at most head_dim)
        if self.is_full:
            self.bits, self.residual = shown_bits(self.pairs[0]), n_prompt if residual is None else residual
        else:
            self.bits, self.residual, self.group_size, self.value_group = self._fit(n_prompt, bits, residual)
        if info.semantics.has_local:  # a local layer holds the groups its window still sees
            held = kivi_local_held(info, n_prompt, self.bits, self.group_size, self.residual, 0, self.value_group)
            predicted = int(held[0])
        else:
            predicted = kivi_bytes(info, n_prompt, self.bits, self.group_size, self.residual)
        shown = {} if self.value_group is None else {"value_group": min(self.value_group, info.v_head_dim)}
        kb, vb = kv_bits(self.bits)
        return {
            "bits": self.bits,
            "kbits": kb,
            "vbits": vb,
            "group": self.group_size,
            **shown,
            "residual": self.residual,
            "quantized_tokens": quantized_len(n_prompt, self.residual, self.group_size),
            "planned_fraction": round(predicted / exact_bytes(info, n_prompt), 4),
            "fits_budget": self.is_full or fits_budget(self, n_prompt),
        }

    def _fit(self, n: int, bits: Bits | None, residual: int | None) -> tuple[Bits, int, int, int | None]:
        """(bits, residual, group, value group) that hold the budget up to the horizon. A group not given
        shrinks (32 -> 16 -> 8) when nothing fits at the given one: short prompts then quantize at all, at a
        higher cost per token in scales and minimums. On a model with local layers, where a window holds
        few tokens and the residual's up to group - 1 full-precision tokens weigh most, the key group then
        shrinks alone (values stay in groups of the given size), and every group is tried: the residual moves
        the bytes a whole group at a time on every layer, so at the given group the plan can fall far under its
        budget; the highest bits, then the best fill, win. Nothing fits: the smallest setting (refused)."""
        given = self.group_size
        shrunk = [g for g in (16, 8) if g < given] if "group" not in self.params_given else []
        groups: list[tuple[int, int | None]] = [(g, None) for g in [given, *shrunk]]
        local = self.info.semantics.has_local
        if local:
            groups += [(g, given) for g in shrunk]
        pairs = [(int(k), int(v)) for k, v in self.pairs]
        best: tuple[tuple[int, float], tuple[Bits, int, int, int | None]] | None = None
        for g, vg in groups:
            fit = solve_kivi(self.info, n, self.budget, g, bits, residual, self.horizon(n), vg, pairs)
            if fit is None:
                continue
            if not local:
                return (*fit, g, vg)
            fill = kivi_worst_ratio(self.info, self.budget, n, fit[0], g, fit[1], self.horizon(n), vg)
            rank = (sum(kv_bits(fit[0])), round(fill, 2))  # ties keep the larger group (tried first)
            if best is None or rank > best[0]:
                best = (rank, (*fit, g, vg))
        if best is not None:
            return best[1]
        return bits if bits is not None else shown_bits(min(pairs, key=sum)), residual or 0, given, None

    def budget_ratio(self, n_prompt: int) -> float | None:
        return kivi_worst_ratio(
            self.info,
            self.budget,
            n_prompt,
            self.bits,
            self.group_size,
            self.residual,
            self.horizon(n_prompt),
            self.value_group,
        )

    def compress(self, state: PrefillState) -> None:
        n, g = state.n_tokens, self.group_size
        nq = quantized_len(n, self.residual, g)
        keys, values = state.keys, state.values
        kqs: list[QuantizedGroups | None]
        vqs: list[QuantizedGroups | None]
        if nq:
            kq, vq = quantize_kv(keys[..., :nq, :], values[..., :nq, :], self.bits, g, self.value_group)
            kqs, vqs = [*split_layers(kq)], [*split_layers(vq)]
        else:
            kqs = vqs = [None] * keys.shape[0]
        self.layers = [
            KiviLayer(
                kqs[i],
                vqs[i],
                _Growable(self.as_cached(keys[i, :, nq:])),
                _Growable(self.as_cached(values[i, :, nq:])),
                n,
            )
            for i in range(keys.shape[0])
        ]
        for i, layer in enumerate(self.layers):
            layer.trim(self.sem[i], g)

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        cache = self.layers[layer]
        cache.rk.append(k)
        cache.rv.append(v)
        cache.seen += k.shape[-2]
        if cache.rk.n >= self.residual + self.group_size:
            cache.flush(self.bits, self.group_size, self.value_group)
        cache.trim(self.sem[layer], self.group_size)

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """Softmax attention over the dequantized keys; the quantized values' probability-weighted
        sum is read from their codes (``weighted_token_sum``), never dequantized whole. q [Hq, t, d]."""
        st = self.layers[layer]
        rk, rv = st.rk.view(), st.rv.view()
        quantized = st.quantized()
        k = rk.float()  # float32
        if quantized is not None:
            k = torch.cat([dequantize_groups(quantized[0]), k], -2)
        hkv, sem = rk.shape[0], self.sem[layer]
        # every token is held in order: the layer's soft-cap, window and sinks (``semantics.grouped_softmax``)
        logits = group_queries(q.float() * sem.scaling, hkv) @ k.transpose(-1, -2)
        pg = grouped_softmax(logits, sem, q.shape[0], st.seen)
        if quantized is None:
            return ungroup(torch.matmul(pg, rv.float()), q.shape[0]).to(q.dtype)
        nq = k.shape[-2] - rk.shape[-2]
        out = weighted_token_sum(pg[..., :nq], quantized[1]) + torch.matmul(pg[..., nq:], rv.float())
        return ungroup(out, q.shape[0]).to(q.dtype)

    @staticmethod
    def attend_many(comps: list[KIVI], layer: int, q: Tensor) -> list[Tensor]:
        """``attend`` of several rows in one call: q [R, Hq, 1, d], row i through ``comps[i]`` -> R x [Hq, 1, d].

        Rows that hold the same quantized part (forks of one compressed context: the questions asked
        after compression) dequantize its keys once and score them with all their queries in one
        product; its values' probability-weighted sum is one call for all of them. The maths is
        ``attend``'s, row by row (the quantized and residual keys scored apart, not concatenated).
        """
        layers, hq = [c.layers[layer] for c in comps], q.shape[1]
        outs: dict[int, Tensor] = {}  # row -> its output
        # id of the quantized keys -> (the first row's quantized keys and values, the rows holding them)
        sharing: dict[int, tuple[tuple[QuantizedGroups, QuantizedGroups], list[int]]] = {}
        for i, st in enumerate(layers):
            held = st.quantized()
            if held is None:
                outs[i] = comps[i].attend(layer, q[i])
            else:
                sharing.setdefault(id(held[0]), (held, []))[1].append(i)
        for (kq, vq), rows in sharing.values():
            keys = dequantize_groups(kq)  # [Hkv, nq, d] float32
            hkv, nq = keys.shape[0], keys.shape[-2]
            qg = [group_queries(q[i].float() * comps[i].sem[layer].scaling, hkv) for i in rows]  # [Hkv, g, d] each
            quantized = torch.matmul(torch.cat(qg, 1), keys.transpose(-1, -2)).chunk(len(rows), dim=1)
            probs = []
            for i, qi, lq in zip(rows, qg, quantized):
                recent = torch.matmul(qi, layers[i].rk.view().float().transpose(-1, -2))
                p = grouped_softmax(torch.cat([lq, recent], -1), comps[i].sem[layer], hq, layers[i].seen)
                probs.append(p)  # [Hkv, g, n]
            summed = weighted_token_sum(torch.cat([p[..., :nq] for p in probs], 1), vq).chunk(len(rows), dim=1)
            for i, p, s in zip(rows, probs, summed):
                out = s + torch.matmul(p[..., nq:], layers[i].rv.view().float())
                outs[i] = ungroup(out, hq).to(q.dtype)
        return [outs[i] for i in range(len(comps))]

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for layer in self.layers:
            yield from layer.tensors()

    def kept_positions(self, layer: int) -> Tensor | None:
        """[Hkv, r] positions of the full-precision residual (the newest tokens; the older ones are codes)."""
        st = self.layers[layer]
        r = st.rk.n
        return torch.arange(st.seen - r, st.seen, dtype=torch.int32).expand(self.info.n_kv_heads, r)

    def estimated_weights(self, layer: int, q: Tensor) -> Tensor | None:
        """Softmax over the dequantized keys (every token held, in order; 0 for the groups a local layer
        dropped). q [Hq, 1, d] -> [Hq, n]."""
        st = self.layers[layer]
        k, _ = st.dequantized()
        sem = self.sem[layer]
        logits = group_queries(q.float() * sem.scaling, k.shape[0]) @ k.transpose(-1, -2)
        w = ungroup(grouped_softmax(logits, sem, q.shape[0], st.seen), q.shape[0])[:, 0]
        return torch.nn.functional.pad(w, (st.dropped, 0)) if st.dropped else w
