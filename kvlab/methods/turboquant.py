"""TurboQuant: a random rotation, then a Lloyd-Max scalar code per coordinate; a 1-bit QJL sketch of
the residual makes the keys' inner products unbiased.

Zandieh, Daliri, Hadian, Mirrokni. "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv:2504.19874 (ICLR 2026), https://arxiv.org/abs/2504.19874. Implemented here:

* Algorithm 1 (TurboQuant-mse), for values: a vector x is stored as its norm (float16) and, for the
  unit vector u = x / ||x||, the index of the nearest centroid of every coordinate of Pi u, where Pi
  is a Haar-random rotation (QR of a Gaussian matrix, one per layer, tensor and channel set). The
  centroids minimise the expected squared error for the density of one coordinate of a uniform
  point on the unit sphere of dimension m, f(x) ~ (1 - x^2)^((m - 3) / 2) on [-1, 1] (Lemma 1):
  the continuous 1-D k-means problem of Eq. (4), solved here by Lloyd-Max iterations on that
  density (``beta_codebook``, computed for the dimension in use and cached; no table is copied).
  Reconstruction: ||x|| Pi^T c[idx].
* Algorithm 2 (TurboQuant-prod), for keys: b-1 bits of Algorithm 1, then QJL (Definition 1: S with
  i.i.d. N(0, 1) entries, m x m) on the residual r = u - Pi^T c[idx], stored as sign(S r) (m bits)
  and gamma = ||r|| (float16). A query's logit is the unbiased estimate of Theorem 2,
  ||k|| (<Pi q, c[idx]> + sqrt(pi/2)/m gamma <S q, sign(S r)>): no key is ever reconstructed. The
  QJL part reuses QJL's pieces: the sign packing (``kernels.quant.pack_signs``), the Gaussian sketch
  (``kernels.qjl.make_sketch``, not orthogonalized, as Definition 1) and its score estimator. The
  logits and the values' weighted sum are computed by ``kernels.turboquant`` straight from the codes
  (Triton on CUDA, its torch reference elsewhere). With b = 1 the mse part is empty and the
  key is QJL of the unit key itself (gamma = 1, not stored).
* Sec. 4.3, outlier channels: the channels are split into an outlier set and the rest, and two
  independent instances (their own rotations, sketches, codebooks and norms) quantize them, the
  outliers with one bit more. The paper's "2.5-bit" setting gives 32 of 128 channels 3 bits and 96
  channels 2 bits; the 3.5-bit split is not given. Here ``bits`` = b + f: f x d channels get b + 1
  bits, the rest b (f in {0, 1/4, 1/2}); the paper's printed 2.5-bit split is ``bits=2.25``, half the
  channels at 3 bits is ``bits=2.5``, and ``bits=3.5`` is half at 4. The outlier channels are picked
  per layer and KV head from the prompt (largest norm over its tokens; the paper does not say how),
  and held per sequence (uint8 indices).
* Streaming, as the paper runs it (Sec. 4.3: generated tokens are quantized too); keys with
  TurboQuant-prod and values with TurboQuant-mse (the paper's KV experiments do not say which
  variant each side uses: prod where the paper's analysis needs inner products, mse where vectors
  are summed).

Bytes: the packed codes (``kernels.quant.pack_codes``: 3-bit codes cost 3 bits), the packed sign
bits, the float16 norms (and residual norms) per token, KV head and channel set, and the outlier
indices. The rotations, sketches and codebooks are per-model state, shown apart (``shared_tensors``).

The budget picks the largest ``bits`` whose cache fits (1 to 4 bits per number, the outlier
settings between); the budget left over keeps the most recent tokens in the cache dtype (the paper
keeps none: ``residual=0``). At budget 1.0 nothing is quantized: the exact cache.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.formats import TurboQuantCodes
from kernels.qjl import make_sketch
from kernels.quant import pack_codes, pack_signs, packed_bytes, unpack_signs
from kernels.turboquant import centroid_rows, turboquant_logits, turboquant_values
from kvlab.methods.bit_split import candidates, side_params, split_param
from kvlab.methods.params import Param, ParamError
from kvlab.methods.token_quant import CodedLayer, Codes, TokenQuantizer

BITS = (4.0, 3.5, 3.25, 3.0, 2.5, 2.25, 2.0, 1.5, 1.25, 1.0)  # highest first: the planner's order
SQRT_HALF_PI = math.sqrt(math.pi / 2)
GRID = 1 << 16  # points of the quadrature grid the codebooks are solved on


# ----- Lloyd-Max codebooks ---------------------------------------------------------------------
def lloyd_max(x: np.ndarray, cdf: np.ndarray, moment: np.ndarray, levels: int, tol: float = 1e-13, iters: int = 20000):
    """Optimal scalar quantizer (Lloyd-Max) of a density on [x[0], x[-1]], given on a sorted grid x by its
    cumulative mass ``cdf`` (0 -> 1) and cumulative first moment ``moment``: (centroids, boundaries).

    Alternates the two optimality conditions until the centroids move less than ``tol``: boundaries at
    the midpoints of neighbouring centroids, each centroid the mean of the density over its cell."""
    c = np.interp((np.arange(levels) + 0.5) / levels, cdf, x)  # start at the quantiles
    for _ in range(iters):
        edges = np.concatenate([[x[0]], (c[1:] + c[:-1]) / 2, [x[-1]]])
        f, m = np.interp(edges, x, cdf), np.interp(edges, x, moment)
        mass = np.diff(f)
        new = np.where(mass > 0, np.diff(m) / np.maximum(mass, 1e-300), c)
        moved = np.abs(new - c).max()
        c = new
        if moved < tol:
            break
    return c, (c[1:] + c[:-1]) / 2


def cumulative_moments(x: np.ndarray, w: np.ndarray, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative mass and first moment (trapezoid rule) of weights w on the grid x, normalised."""
    mass = np.concatenate([[0.0], np.cumsum((w[1:] + w[:-1]) / 2 * dt)])
    xw = x * w
    moment = np.concatenate([[0.0], np.cumsum((xw[1:] + xw[:-1]) / 2 * dt)])
    return mass / mass[-1], moment / mass[-1]


@functools.lru_cache(maxsize=64)
def beta_codebook(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Centroids [2^bits] and boundaries of the Lloyd-Max quantizer of one coordinate of a uniform point
    on the unit sphere of dimension ``dim`` (density ~ (1 - x^2)^((dim - 3) / 2) on [-1, 1]), float64.

    Solved on x = sin(t), t uniform on [-pi/2, pi/2], where the density becomes cos(t)^(dim - 2): smooth
    for every dim >= 2 (dim 2's arcsine density is unbounded at +-1 in x)."""
    if dim < 2:
        raise ValueError(f"a TurboQuant instance needs at least 2 channels, not {dim}")
    t = np.linspace(-np.pi / 2, np.pi / 2, GRID + 1)
    x = np.sin(t)
    cdf, moment = cumulative_moments(x, np.cos(t) ** (dim - 2), t[1] - t[0])
    return lloyd_max(x, cdf, moment, 1 << bits)


def codebook_mse(dim: int, bits: int) -> float:
    """D_mse of TurboQuant-mse on unit vectors of dimension ``dim``: dim x the codebook's expected squared
    error, E[x^2] - sum_i P(cell i) c_i^2 with E[x^2] = 1 / dim (Theorem 1's proof)."""
    c, b = beta_codebook(dim, bits)
    t = np.linspace(-np.pi / 2, np.pi / 2, GRID + 1)
    cdf, _ = cumulative_moments(np.sin(t), np.cos(t) ** (dim - 2), t[1] - t[0])
    p = np.diff(np.interp(np.concatenate([[-1.0], b, [1.0]]), np.sin(t), cdf))
    return float(dim * (1.0 / dim - (p * c**2).sum()))


# ----- one TurboQuant instance: a channel set of one tensor ----------------------------------------
@dataclass
class Instance:
    """TurboQuant over ``m`` channels at ``bits`` bits per channel: prod (keys) or mse (values)."""

    prefix: str  # names of its tensors ("key", "outlier_key", "value", "outlier_value")
    m: int
    bits: int
    prod: bool
    rotation: Tensor  # [L, m, m] float32, Haar
    sketch: Tensor | None  # [L, m, m] float32, i.i.d. N(0, 1) (prod)
    centroids: Tensor  # [2^code_bits] float32
    boundaries: Tensor  # [2^code_bits - 1] float32

    @property
    def code_bits(self) -> int:
        return self.bits - 1 if self.prod else self.bits

    def token_bytes(self) -> int:
        """Bytes one token of this instance holds: codes, signs, norm, residual norm."""
        out = 2 + (packed_bytes(self.m, self.code_bits) if self.code_bits else 0)
        if self.prod:
            out += packed_bytes(self.m, 1) + (2 if self.code_bits else 0)
        return out

    def encode(self, layers: slice, x: Tensor) -> Codes:
        """x [L', Hkv, c, m] -> this instance's tensors [L', Hkv, c, ...]."""
        xf = x.float()
        norm = xf.norm(dim=-1, keepdim=True)
        u = xf / norm.clamp(min=1e-30)
        rot = self.rotation[layers].unsqueeze(1)  # [L', 1, m, m]
        out: Codes = {f"{self.prefix}_norms": norm.squeeze(-1).half()}
        r = u
        if self.code_bits:
            y = torch.matmul(u, rot.transpose(-1, -2))  # Pi u, as rows
            idx = torch.bucketize(y, self.boundaries)
            out[f"{self.prefix}_codes"] = pack_codes(idx, self.code_bits)
            r = u - torch.matmul(self.centroids[idx], rot)  # u - Pi^T c[idx]
            if self.prod:
                out[f"{self.prefix}_residual_norms"] = r.norm(dim=-1).half()
        if self.prod:
            assert self.sketch is not None
            out[f"{self.prefix}_signs"] = pack_signs(
                torch.matmul(r, self.sketch[layers].unsqueeze(1).transpose(-1, -2))
            )
        return out

    def part(self, layer: int, codes: Codes) -> TurboQuantCodes:
        """This instance's codes of one layer as the kernels read them (``kernels.turboquant``)."""
        p = self.prefix
        return TurboQuantCodes(
            codes[f"{p}_norms"],
            self.rotation[layer],
            self.centroids,
            self.code_bits,
            codes.get(f"{p}_codes"),
            self.sketch[layer] if self.sketch is not None else None,
            codes.get(f"{p}_signs"),
            codes.get(f"{p}_residual_norms"),
        )

    def rotated(self, layer: int, codes: Codes) -> Tensor:
        """c[idx] [Hkv, n, m] float32: the rotated unit vectors' reconstruction (Algorithm 1, line 9)."""
        return centroid_rows(self.part(layer, codes))

    def logits(self, layer: int, qg: Tensor, codes: Codes) -> Tensor:
        """qg [Hkv, R, m] -> [Hkv, R, n]: <q, k> estimated, ||k|| (<Pi q, c[idx]> + the QJL residual term)
        (``kernels.turboquant``: Triton on CUDA, its torch reference elsewhere)."""
        return turboquant_logits(qg, self.part(layer, codes))

    def values(self, layer: int, p: Tensor, codes: Codes) -> Tensor:
        """p [Hkv, R, n] -> sum_i p_i ||v_i|| Pi^T c[idx_i], [Hkv, R, m] (mse: the reconstruction's weighted sum,
        rotated back once; ``kernels.turboquant``)."""
        return turboquant_values(p, self.part(layer, codes))

    def dequantize(self, layer: int, codes: Codes) -> Tensor:
        """x_hat [Hkv, n, m]: DeQuant_mse, plus DeQuant_qjl of the residual for prod (Algorithm 2, line 12)."""
        norms = codes[f"{self.prefix}_norms"].float().unsqueeze(-1)
        hkv, n = norms.shape[:2]
        x = torch.zeros(hkv, n, self.m, device=norms.device)
        if self.code_bits:
            x = torch.matmul(self.rotated(layer, codes), self.rotation[layer])
        if self.prod:
            assert self.sketch is not None
            signs = unpack_signs(codes[f"{self.prefix}_signs"], self.m)
            gamma = codes[f"{self.prefix}_residual_norms"].float().unsqueeze(-1) if self.code_bits else 1.0
            x = x + SQRT_HALF_PI / self.m * gamma * torch.matmul(signs, self.sketch[layer])
        return x * norms

    def shared(self) -> list[tuple[str, Tensor]]:
        out = [("rotation", self.rotation), ("codebook", self.centroids)]
        return out + ([("sketch", self.sketch)] if self.sketch is not None else [])


def channel_order(idx: Tensor, d: int) -> Tensor:
    """Outlier channel indices [..., n_out] -> a permutation [..., d]: the other channels in order, then
    the outliers in order (``gather`` with it splits a vector into its two instances' channels)."""
    mask = torch.zeros(*idx.shape[:-1], d, dtype=torch.uint8, device=idx.device)
    mask.scatter_(-1, idx.long(), 1)
    return torch.argsort(mask, dim=-1, stable=True)


def split_bits(bits: float, d: int) -> tuple[int, int]:
    """``bits`` = b + f -> (b, n_out): f x d channels get b + 1 bits (at least two channels per instance)."""
    b = int(math.floor(bits + 1e-9))
    n_out = round((bits - b) * d)
    if n_out and not 2 <= n_out <= d - 2:
        raise ParamError(f"turboquant: bits={bits} leaves an instance of {n_out} channels on head size {d}")
    return b, n_out


class TurboQuant(TokenQuantizer):
    name = "turboquant"
    title = "TurboQuant"
    group = "quantizer"
    paper = (
        "Zandieh, Daliri, Hadian, Mirrokni. TurboQuant: Online Vector Quantization with Near-optimal "
        "Distortion Rate. arXiv:2504.19874 (ICLR 2026), https://arxiv.org/abs/2504.19874"
    )
    summary = (
        "A random rotation, then a Lloyd-Max code per coordinate for the sphere's Beta density; keys add a "
        "1-bit QJL sketch of the residual (unbiased logits), outlier channels get a bit more."
    )
    params = (
        Param(
            "bits",
            None,
            "bits per number, 1-4; a fraction f gives f x head_dim outlier channels one bit more "
            "(paper's KV runs: 2.5 and 3.5; chosen from the budget when not given)",
            choices=BITS,
            kind=float,
        ),
        Param(
            "residual",
            None,
            "recent tokens kept in the cache dtype (paper: 0; chosen from the budget left over when not given)",
            minimum=0,
            kind=int,
        ),
        Param(
            "keys",
            "prod",
            "keys through TurboQuant-prod (b-1 bits + 1-bit QJL residual: unbiased logits) or -mse (b bits)",
            choices=("prod", "mse"),
        ),
        Param("orthogonalize", False, "orthogonalize the QJL sketch's rows (paper: i.i.d. Gaussian)"),
        *side_params(BITS),
        split_param("equal"),
    )

    # ----- the code --------------------------------------------------------------------------------
    def _setting(self, kbits: float, vbits: float) -> None:
        info = self.info
        self.kbits, self.vbits = float(kbits), float(vbits)
        self.bits = (self.kbits + self.vbits) / 2
        self.k_split = split_bits(kbits, info.head_dim)
        self.v_split = split_bits(vbits, info.v_head_dim)

    def pick(self, n_prompt: int) -> dict:
        c = self.cfg
        pairs = candidates(BITS, BITS, c["bits"], c["kbits"], c["vbits"], c["split"], self.name)
        self.choose_pair(pairs, self._setting, n_prompt, 0)
        (kb, n_out), (vb, v_out) = self.k_split, self.v_split
        return {
            "bits": self.bits,
            "kbits": self.kbits,
            "vbits": self.vbits,
            "key_bits": (f"{kb - 1} mse + 1 qjl" if c["keys"] == "prod" else f"{kb} mse")
            + (f" ({n_out} outlier channels: one more)" if n_out else ""),
            "value_bits": f"{vb} mse" + (f" ({v_out} outlier channels: {vb + 1})" if v_out else ""),
            "outlier_channels": n_out,
        }

    def _layout(self) -> list[tuple[str, int, int, bool]]:
        """(prefix, channels, bits, prod) of every instance."""
        (kb, ko), (vb, vo) = self.k_split, self.v_split
        dk, dv = self.info.head_dim, self.info.v_head_dim
        prod = self.cfg["keys"] == "prod"
        out = [("key", dk - ko, kb, prod), ("value", dv - vo, vb, False)]
        if ko:
            out.append(("outlier_key", ko, kb + 1, prod))
        if vo:
            out.append(("outlier_value", vo, vb + 1, False))
        return out

    def token_bytes(self) -> float:
        return float(sum(_dummy(m, b, prod).token_bytes() for _, m, b, prod in self._layout()))

    def fixed_bytes(self) -> float:
        return float(self.info.n_kv_heads * (self.k_split[1] + self.v_split[1]))  # uint8 outlier indices

    def prepare(self, keys: Tensor, values: Tensor) -> list[Codes]:
        """Make the instances (per-model: rotations, sketches, codebooks) and pick each layer's outlier channels."""
        n_layers, gen = keys.shape[0], self.generator
        self.instances = _Instances()
        for prefix, m, bits, prod in self._layout():
            rotation = make_sketch(n_layers, m, m, gen, orthogonalize=True) / math.sqrt(m)
            sketch = make_sketch(n_layers, m, m, gen, orthogonalize=self.cfg["orthogonalize"]) if prod else None
            code_bits = bits - 1 if prod else bits
            c, bd = beta_codebook(m, code_bits) if code_bits else (np.zeros(1), np.zeros(0))
            inst = Instance(prefix, m, bits, prod, rotation, sketch, torch.tensor(c).float(), torch.tensor(bd).float())
            self.instances[prefix] = _to(inst, keys.device)
        extra: list[Codes] = [{} for _ in range(n_layers)]
        for name, x, n_out in (("key", keys, self.k_split[1]), ("value", values, self.v_split[1])):
            if n_out:
                idx = (
                    x.float().norm(dim=-2).topk(n_out, dim=-1).indices.sort(-1).values.to(torch.uint8)
                )  # [L, Hkv, n_out]
                for i in range(n_layers):
                    extra[i][f"{name}_outlier_channels"] = idx[i]
        return extra

    def _split(self, x: Tensor, idx: Tensor | None, n_out: int) -> tuple[Tensor, Tensor | None]:
        """x [..., d] -> (regular channels, outlier channels) by the per-head outlier indices."""
        if idx is None or not n_out:
            return x, None
        order = channel_order(idx, x.shape[-1])
        while order.dim() < x.dim():
            order = order.unsqueeze(-2)
        xs = torch.gather(x, -1, order.expand(*x.shape))
        return xs[..., : x.shape[-1] - n_out], xs[..., x.shape[-1] - n_out :]

    def encode(self, layers: slice, k: Tensor, v: Tensor, extra: list[Codes]) -> Codes:
        out: Codes = {}
        for name, x, n_out in (("key", k, self.k_split[1]), ("value", v, self.v_split[1])):
            idx = torch.stack([e[f"{name}_outlier_channels"] for e in extra]) if n_out else None  # [L', Hkv, n_out]
            reg, outl = self._split(x, idx, n_out)
            out.update(self.instances[name].encode(layers, reg))
            if outl is not None:
                out.update(self.instances[f"outlier_{name}"].encode(layers, outl))
        return out

    def code_logits(self, layer: int, qg: Tensor, st: CodedLayer) -> Tensor:
        n_out = self.k_split[1]
        reg, outl = self._split(qg, st.extra.get("key_outlier_channels"), n_out)
        out = self.instances["key"].logits(layer, reg, st.codes)
        if outl is not None:
            out = out + self.instances["outlier_key"].logits(layer, outl, st.codes)
        return out

    def code_values(self, layer: int, p: Tensor, st: CodedLayer) -> Tensor:
        out = self.instances["value"].values(layer, p, st.codes)
        if not self.v_split[1]:
            return out
        outl = self.instances["outlier_value"].values(layer, p, st.codes)
        return self._merge(torch.cat([out, outl], -1), st.extra["value_outlier_channels"])

    @staticmethod
    def _merge(xs: Tensor, idx: Tensor) -> Tensor:
        """Inverse of ``_split``: [Hkv, R, d] in (regular, outlier) order -> channel order."""
        order = channel_order(idx, xs.shape[-1]).unsqueeze(-2).expand(*xs.shape)
        return torch.empty_like(xs).scatter_(-1, order, xs)

    def decoded(self, layer: int, st: CodedLayer, name: str) -> Tensor:
        """The keys (``name`` "key": Algorithm 2's reconstruction) or values ("value") [Hkv, n, d] the codes
        stand for."""
        n_out = (self.k_split if name == "key" else self.v_split)[1]
        x = self.instances[name].dequantize(layer, st.codes)
        if n_out:
            x = torch.cat([x, self.instances[f"outlier_{name}"].dequantize(layer, st.codes)], -1)
            x = self._merge(x, st.extra[f"{name}_outlier_channels"])
        return x

    def dequantize(self, layer: int, st: CodedLayer) -> tuple[Tensor, Tensor]:
        """The keys (Algorithm 2's reconstruction) and values [Hkv, n, d] the codes stand for."""
        return self.decoded(layer, st, "key"), self.decoded(layer, st, "value")

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The rotations, QJL sketches and codebooks of every instance (one per layer), shared by every sequence."""
        for inst in getattr(self, "instances", {}).values():
            yield from inst.shared()


class _Instances(dict):
    """The instances by prefix; a fork of the cache holds them by reference (per-model state)."""

    def __deepcopy__(self, memo: dict) -> _Instances:
        return self


def _dummy(m: int, bits: int, prod: bool) -> Instance:
    """An instance with no tensors, for counting bytes."""
    e = torch.empty(0)
    return Instance("", m, bits, prod, e, e if prod else None, e, e)


def _to(inst: Instance, device) -> Instance:
    if device == torch.device("cpu"):
        return inst
    sk = None if inst.sketch is None else inst.sketch.to(device)
    return Instance(
        inst.prefix,
        inst.m,
        inst.bits,
        inst.prod,
        inst.rotation.to(device),
        sk,
        inst.centroids.to(device),
        inst.boundaries.to(device),
    )


__all__ = [
    "Instance",
    "TurboQuant",
    "beta_codebook",
    "channel_order",
    "codebook_mse",
    "cumulative_moments",
    "lloyd_max",
    "split_bits",
]
