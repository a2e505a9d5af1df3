"""PolarQuant: a random rotation, a recursive polar transform per block, angle codebooks from the angles'
known densities; no scale or zero point is stored.

Han, Kacham, Karbasi, Mirrokni, Zandieh. "PolarQuant: Quantizing KV Caches with Polar
Transformation", arXiv:2502.02617 (2025), https://arxiv.org/abs/2502.02617. Implemented here:

* Random preconditioning (Sec. 2.2, Sec. 4.1): every key and value is multiplied by one random
  rotation S (QR of a Gaussian matrix), shared by keys and values, every layer and every head, as
  the paper's implementation does (one per head size when values differ in size from keys).
* The recursive polar transform (Definition 1, Algorithm 1's Polar procedure) on blocks of 2^L
  coordinates, L = 4 levels (Sec. 4.1): level 1 pairs coordinates, angle atan2(y_2j, y_2j-1) in
  [0, 2 pi) and radius; each further level pairs the radii of the level below, angle
  atan(r_2j / r_2j-1) in [0, pi/2]. A block of 16 coordinates becomes 8 + 4 + 2 + 1 angles and one
  radius, stored in float16: the only constant per block, and part of the vector (no scale or zero
  point of a quantizer is stored anywhere).
* Angle codebooks (Eq. (4)) per level from the densities of Lemma 2: level 1 uniform on [0, 2 pi),
  level l >= 2 proportional to sin^(2^(l-1) - 1)(2 psi) on [0, pi/2]; each solved by Lloyd-Max
  iterations on that density (``turboquant.lloyd_max``), computed once and cached. This is the
  paper's offline codebook (PolarQuant-R offline, Table 1), shared by all prompts, layers and heads;
  its online variant (k-means++ on each prompt's angles) is not implemented.
* Bits per level as Sec. 4.1 sets them: 4 for level 1, 2 for levels 2-4: 32 + 8 + 4 + 2 bits of
  angles plus a 16-bit radius per 16 coordinates, 3.875 bits per number.
* Keys and values both through PolarQuant: attention is softmax(q K_hat^T) V_hat (Eq. (6)). Neither is
  reconstructed: the query is rotated once (q S) and scored against the dequantized rotated keys,
  and the probability-weighted sum of the rotated values is rotated back once.
* Prefill only, as Sec. 5.3 runs it: generated tokens are kept in 16 bits (``streaming`` is off).

Bytes: the packed angle codes (4-bit codes two per byte, 2-bit codes of levels 2-4 four per byte,
``kernels.quant.pack_codes``) and the float16 radii; S and the codebooks are per-model state, shown
apart. With head_dim 64 that is 31 bytes per vector against 128 (0.242 of the exact cache), so a
budget below that is refused; the budget left over keeps the most recent prompt tokens in the cache
dtype (``residual``; the paper keeps none). At budget 1.0 nothing is quantized: the exact cache.

Deviations: ``precondition=False`` gives the paper's PolarQuant without the rotation (its Fig. 3 and
Table 1 rows without R); the codebooks then still assume the rotated angles' densities.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from kernels.qjl import make_sketch
from kernels.quant import pack_codes, packed_bytes, unpack_codes
from kvlab.core import semantics as sm
from kvlab.methods.params import Param, ParamError
from kvlab.methods.token_quant import CodedLayer, Codes, Shared, TokenQuantizer
from kvlab.methods.turboquant import GRID, cumulative_moments, lloyd_max

PAPER_BITS = "4,2,2,2"  # Sec. 4.1: bits of the angles of levels 1..4


@functools.lru_cache(maxsize=32)
def angle_codebook(level: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max centroids and boundaries (float64) of a level-``level`` angle (Lemma 2's density)."""
    if level == 1:  # uniform on [0, 2 pi)
        x = np.linspace(0.0, 2 * np.pi, GRID + 1)
        w = np.ones_like(x)
    else:
        x = np.linspace(0.0, np.pi / 2, GRID + 1)
        w = np.sin(2 * x) ** (2 ** (level - 1) - 1)
    cdf, moment = cumulative_moments(x, w, x[1] - x[0])
    return lloyd_max(x, cdf, moment, 1 << bits)


def angle_density(level: int, psi: np.ndarray) -> np.ndarray:
    """Lemma 2's density of a level-``level`` angle at psi (normalised): for tests and docs."""
    if level == 1:
        return np.full_like(psi, 1 / (2 * np.pi))
    k = 2 ** (level - 1)
    const = math.gamma(k) / (2 ** (k - 2) * math.gamma(k / 2) ** 2)
    return const * np.sin(2 * psi) ** (k - 1)


def polar(y: Tensor, levels: int) -> tuple[list[Tensor], Tensor]:
    """The recursive polar transform of blocks of 2^levels coordinates: y [..., d] -> (angles of each level
    [..., d / 2^l], radii [..., d / 2^levels]); level-1 angles in [0, 2 pi), the others in [0, pi/2]."""
    r = y.float()
    angles = []
    for level in range(1, levels + 1):
        a, b = r[..., 0::2], r[..., 1::2]
        psi = torch.atan2(b, a)
        angles.append(torch.remainder(psi, 2 * math.pi) if level == 1 else psi)
        r = torch.hypot(a, b)
    return angles, r


def unpolar(angles: list[Tensor], radii: Tensor) -> Tensor:
    """Inverse of ``polar`` (Algorithm 1's DeQuant loop): angles per level, radii [..., d / 2^L] -> [..., d]."""
    r = radii
    for psi in reversed(angles):
        r = torch.stack([r * torch.cos(psi), r * torch.sin(psi)], -1).flatten(-2)
    return r


def parse_level_bits(text: str) -> tuple[int, ...]:
    try:
        bits = tuple(int(b) for b in str(text).split(","))
    except ValueError:
        raise ParamError(f"polarquant: level_bits={text!r} must be comma-separated integers") from None
    if not bits or any(b not in (1, 2, 3, 4, 8) for b in bits):
        raise ParamError(f"polarquant: level_bits={text!r}: each level takes 1, 2, 3, 4 or 8 bits")
    return bits


class PolarQuant(TokenQuantizer):
    name = "polarquant"
    title = "PolarQuant"
    group = "quantizer"
    streaming = False  # Sec. 5.3: generated tokens stay in 16 bits
    paper = (
        "Han, Kacham, Karbasi, Mirrokni, Zandieh. PolarQuant: Quantizing KV Caches with Polar Transformation. "
        "arXiv:2502.02617, https://arxiv.org/abs/2502.02617"
    )
    summary = (
        "A random rotation, then each block of 16 coordinates as 15 angles (4 levels, 4/2/2/2 bits, codebooks "
        "from their known densities) and one 16-bit radius: 3.875 bits, no scales or zero points."
    )
    params = (
        Param("level_bits", PAPER_BITS, "bits of the angles of each polar level, comma-separated (paper: 4,2,2,2)"),
        Param("key_level_bits", None, "the keys' own level bits (default: level_bits)", kind=str),
        Param("value_level_bits", None, "the values' own level bits (default: level_bits)", kind=str),
        Param("precondition", True, "multiply by a random rotation first (PolarQuant-R; without: PolarQuant)"),
        Param(
            "residual",
            None,
            "recent prompt tokens kept in the cache dtype (paper: 0; chosen from the budget left over when not given)",
            minimum=0,
            kind=int,
        ),
    )

    def side_bits(self) -> dict[str, tuple[int, ...]]:
        """The level bits of the keys ("key") and of the values ("value")."""
        c = self.cfg
        return {side: parse_level_bits(c[f"{side}_level_bits"] or c["level_bits"]) for side in ("key", "value")}

    def check_semantics(self) -> None:
        super().check_semantics()
        for side, dim in (("key", self.info.head_dim), ("value", self.info.v_head_dim)):
            block = 1 << len(self.side_bits()[side])
            if dim % block:
                raise sm.UnsupportedAttention(
                    f"polarquant cannot run on head size {dim}: its polar blocks are {block} coordinates"
                )

    def pick(self, n_prompt: int) -> dict:
        self.bits_of = self.side_bits()
        self.level_bits = self.bits_of["key"]
        self.levels = len(self.level_bits)
        per_vector = self.token_bytes()
        d2 = self.info.head_dim + self.info.v_head_dim
        shown = {side: ",".join(map(str, b)) for side, b in self.bits_of.items()}
        bits = {"level_bits": shown["key"]} if shown["key"] == shown["value"] else {
            "key_level_bits": shown["key"], "value_level_bits": shown["value"]}  # fmt: skip
        return {**bits, "bits_per_number": round(8 * per_vector / d2, 4)}

    def _widths(self, side: str = "key") -> dict[int, list[int]]:
        """Bit width -> the levels (1-based) of ``side`` whose angles are packed together at that width."""
        out: dict[int, list[int]] = {}
        for level, b in enumerate(self.bits_of[side], 1):
            out.setdefault(b, []).append(level)
        return out

    def vector_bytes(self, d: int, side: str = "key") -> int:
        """Bytes of one coded vector of d numbers: the packed angles of each width and the float16 radii."""
        total = 2 * (d >> len(self.bits_of[side]))
        for b, levels in self._widths(side).items():
            total += packed_bytes(sum(d >> lv for lv in levels), b)
        return total

    def token_bytes(self) -> float:
        return float(self.vector_bytes(self.info.head_dim, "key") + self.vector_bytes(self.info.v_head_dim, "value"))

    def prepare(self, keys: Tensor, values: Tensor) -> list[Codes]:
        """The rotation(s) S and the angle codebooks: per-model state (nothing per sequence)."""
        dims = sorted({self.info.head_dim, self.info.v_head_dim})
        rot = {}
        for d in dims:
            s = make_sketch(1, d, d, self.generator, orthogonalize=True)[0] / math.sqrt(d)
            rot[f"rotation_{d}"] = (s if self.cfg["precondition"] else torch.eye(d)).to(keys.device)
        books = {}
        for level, b in {(lv, b) for bits in self.bits_of.values() for lv, b in enumerate(bits, 1)}:
            c, bd = angle_codebook(level, b)
            books[f"centroids_{level}_{b}"] = torch.tensor(c, dtype=torch.float32, device=keys.device)
            books[f"boundaries_{level}_{b}"] = torch.tensor(bd, dtype=torch.float32, device=keys.device)
        self.state = Shared(**rot, **books)
        return [{} for _ in range(keys.shape[0])]

    def encode(self, layers: slice, k: Tensor, v: Tensor, extra: list[Codes]) -> Codes:
        out: Codes = {}
        for name, x in (("key", k), ("value", v)):
            y = torch.matmul(x.float(), self.state[f"rotation_{x.shape[-1]}"])  # x S (rows)
            angles, radii = polar(y, len(self.bits_of[name]))
            out[f"{name}_radii"] = radii.half()
            for b, levels in self._widths(name).items():
                idx = [torch.bucketize(angles[lv - 1], self.state[f"boundaries_{lv}_{b}"]) for lv in levels]
                out[f"{name}_angles_{b}bit"] = pack_codes(torch.cat(idx, -1), b)
        return out

    def rotated(self, name: str, codes: Codes) -> Tensor:
        """The dequantized rotated vectors y_hat [Hkv, n, d] float32 (Algorithm 1's DeQuant before S^T)."""
        radii = codes[f"{name}_radii"].float()
        n_levels = len(self.bits_of[name])
        d = radii.shape[-1] << n_levels
        angles: list[Tensor] = [radii] * n_levels
        for b, levels in self._widths(name).items():
            sizes = [d >> lv for lv in levels]
            idx = unpack_codes(codes[f"{name}_angles_{b}bit"], b, sum(sizes)).long()
            for lv, part in zip(levels, idx.split(sizes, -1)):
                angles[lv - 1] = self.state[f"centroids_{lv}_{b}"][part]
        return unpolar(angles, radii)

    def code_logits(self, layer: int, qg: Tensor, st: CodedLayer) -> Tensor:
        qs = torch.matmul(qg, self.state[f"rotation_{qg.shape[-1]}"])  # <q, y_hat S^T> = <q S, y_hat>
        return torch.matmul(qs, self.rotated("key", st.codes).transpose(-1, -2))

    def code_values(self, layer: int, p: Tensor, st: CodedLayer) -> Tensor:
        yv = self.rotated("value", st.codes)
        return torch.matmul(torch.matmul(p, yv), self.state[f"rotation_{yv.shape[-1]}"].T)

    def decoded(self, layer: int, st: CodedLayer, name: str) -> Tensor:
        """The keys (``name`` "key") or values ("value") [Hkv, n, d] as the codes reconstruct them (y_hat S^T)."""
        y = self.rotated(name, st.codes)
        return torch.matmul(y, self.state[f"rotation_{y.shape[-1]}"].T)

    def dequantize(self, st: CodedLayer) -> tuple[Tensor, Tensor]:
        """Keys and values [Hkv, n, d] as the codes reconstruct them (y_hat S^T)."""
        return self.decoded(0, st, "key"), self.decoded(0, st, "value")

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """S (one per head size) and the angle codebooks, shared by every sequence and layer."""
        state = getattr(self, "state", None)
        if state is not None:
            for name, t in state.tensors.items():
                yield name.split("_")[0], t


__all__ = ["PolarQuant", "angle_codebook", "angle_density", "polar", "unpolar"]
