"""vLLM's TurboQuant KV-cache presets (``--kv-cache-dtype turboquant_k8v4`` / ``turboquant_4bit_nc`` /
``turboquant_k3v4_nc`` / ``turboquant_3bit_nc``): what vLLM ships under TurboQuant's name, with vLLM's semantics.

Source: the vLLM repository (2026), ``vllm/model_executor/layers/quantization/turboquant/`` (``config.py``: the
presets, the packed sizes and the boundary layers; ``centroids.py``: the codebook) and
``vllm/v1/attention/ops/triton_turboquant_store.py`` / ``triton_turboquant_decode.py`` (the stored bytes, the
rounding and the decode). The method it is named after: Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant:
Online Vector Quantization with Near-optimal Distortion Rate", arXiv:2504.19874 (kvlab's ``turboquant``).
Implemented here, as vLLM does it:

* **Keys, 3 or 4 bits** (TurboQuant-mse with a fixed rotation): the norm ||k|| (float32, stored float16),
  u = k / (||k|| + 1e-8), y = u H with H the orthonormal Walsh-Hadamard matrix of the head size (one matrix
  for every layer and head, no random signs: vLLM's note is that sign flips do not change a symmetric
  quantizer's error), and each coordinate of y coded as the index of the nearest centroid of a Lloyd-Max
  codebook for N(0, 1/d) (a coordinate of a rotated unit vector; ``gaussian_codebook``). A query's logit is
  ||k|| <q H, c[idx]> (no key is reconstructed).
* **Keys, 8 bits** (``turboquant_k8v4``): the key itself cast to float8 e4m3, with no scale and no rotation.
* **Values** (3 or 4 bits): uniform per token over the whole head: minimum m and scale s = (max - m) /
  (2^b - 1) (float32, at least 1e-8), code = floor((v - m) / s + 0.5) clipped to [0, 2^b - 1]; stored with s
  and m in float16, read back as code * s + m (float16 s and m).
* **No QJL residual.** vLLM's config: "QJL is intentionally omitted: community consensus (5+ independent
  groups) found it hurts attention quality by amplifying variance through softmax" (tested by the
  ``turboquant-qjl-residual`` reproduction).
* **``_nc``, norm correction**: c[idx] is rescaled to a unit vector before the logit (the quantized direction
  is re-normalised; vLLM: "improving PPL by ~0.8% at 4-bit"). On in ``4bit_nc``, ``k3v4_nc``, ``3bit_nc``.
* **Outliers: boundary layers.** TurboQuant's outlier channels (the paper's Sec. 4.3) are not in vLLM; what
  vLLM protects instead is layers: on a dense model it keeps the first 2 and the last 2 attention layers in the
  model's dtype (``get_boundary_skip_layers``, "empirically required for aggressive presets"; at most half the
  layers). ``skip_layers`` (default 2) does the same here: those layers hold every token in the cache dtype.
* Prefill attention is exact (vLLM's first prefill chunk runs flash attention on the unquantized keys and
  values, as kvlab's shared prefill does); every token, generated ones included, is then read from the codes:
  a decode step's own token is stored before it is attended (``residual=0``).

Bytes, per token, layer and KV head, as vLLM's slot stores them (``TurboQuantConfig.slot_size``): keys
ceil(d kbits / 8) + 2 (the float16 norm) or d (e4m3), values ceil(d vbits / 8) + 4 (float16 scale and
minimum); the codes are packed as vLLM packs them (4-bit: two per byte, low nibble first; 3-bit: 8 codes in 3
bytes, little endian), which is ``kernels.quant.pack_codes``'s layout. vLLM rounds a slot up to an even number
of bytes (no head size a multiple of 16 needs it) and allocates pages of 16-128 slots; kvlab counts the tokens
held. The skipped layers hold 2 x d x 2 bytes a token. The Hadamard matrix and the codebook are per-model
constants, shown apart (``shared_tensors``).

Deviations: the codebook is solved by kvlab's Lloyd-Max solver (``turboquant.lloyd_max`` on a fine grid, to
convergence); vLLM's solves the same conditions by trapezoid sums and stops after at most 200 iterations.
float8 keys are e4m3fn (vLLM's format on Hopper GPUs and later; on Ampere and Ada it stores e4b15), saturated
at +-448. The logits use kvlab's attention scaling before the rotation (the same product). The decode reads the
key codes through ``kernels.turboquant`` (its Hadamard path: Triton on CUDA, the torch reference elsewhere)
and the values through ``kernels.quant.weighted_token_sum``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from kernels.formats import TurboQuantCodes
from kernels.hadamard import fwht, hadamard, is_power_of_two
from kernels.quant import QuantizedGroups, pack_codes, packed_bytes, unpack_codes, weighted_token_sum
from kernels.turboquant import turboquant_logits, unit_rows
from kvlab.core import semantics as sm
from kvlab.methods.bit_split import candidates, split_param
from kvlab.methods.fp8 import to_fp8
from kvlab.methods.params import Param
from kvlab.methods.token_quant import CodedLayer, Codes, Shared, TokenQuantizer
from kvlab.methods.turboquant import GRID, cumulative_moments, lloyd_max

KEY_BITS = (8, 4, 3)  # 8: float8 e4m3 keys; 3-4: Lloyd-Max codes of the rotated key
VALUE_BITS = (4, 3)  # uniform per-token codes
NORM_EPS = 1e-8  # u = k / (||k|| + eps), as vLLM's store
SCALE_FLOOR = 1e-8  # the values' smallest scale, as vLLM's store
SIGMAS = 10.0  # the codebook's grid spans +-10 standard deviations


@functools.lru_cache(maxsize=32)
def gaussian_codebook(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max centroids [2^bits] and boundaries (midpoints) for N(0, 1/dim), float64: the codebook vLLM's
    TurboQuant uses for a rotated unit vector's coordinates."""
    sigma = 1.0 / math.sqrt(dim)
    x = np.linspace(-SIGMAS * sigma, SIGMAS * sigma, GRID + 1)
    cdf, moment = cumulative_moments(x, np.exp(-0.5 * (x / sigma) ** 2), x[1] - x[0])
    return lloyd_max(x, cdf, moment, 1 << bits)


def uniform_values(v: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """vLLM's value code of v [..., d]: (codes [..., d] int64, scale [...] float16, minimum [...] float16)."""
    x = v.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    top = (1 << bits) - 1
    scale = ((hi - lo) / top).clamp(min=SCALE_FLOOR)
    codes = torch.floor((x - lo) / scale + 0.5).clamp_(0, top).long()
    return codes, scale.squeeze(-1).half(), lo.squeeze(-1).half()


class VLLMTurboQuant(TokenQuantizer):
    name = "vllm-turboquant"
    title = "vLLM TurboQuant"
    group = "quantizer"
    paper = (
        "vLLM's TurboQuant KV cache (--kv-cache-dtype turboquant_*, 2026; vllm/model_executor/layers/quantization/"
        "turboquant), after Zandieh et al., TurboQuant, arXiv:2504.19874, https://arxiv.org/abs/2504.19874"
    )
    summary = (
        "vLLM's engine version of TurboQuant: a Walsh-Hadamard rotation and Lloyd-Max codes for keys (or e4m3 keys), "
        "uniform per-token values, no QJL residual; the first and last 2 layers kept 16-bit."
    )
    params = (
        Param(
            "kbits",
            None,
            "keys: 8 (e4m3), 4 or 3 (Lloyd-Max codes); chosen from the budget when not given",
            KEY_BITS,
            kind=int,
        ),  # fmt: skip
        Param(
            "vbits",
            None,
            "values: 4 or 3 bits (uniform per token); chosen from the budget when not given",
            VALUE_BITS,
            kind=int,
        ),  # fmt: skip
        Param("norm_correction", True, "rescale the keys' centroid vector to unit norm (vLLM's _nc presets)"),
        Param(
            "skip_layers",
            2,
            "first and last layers kept in the cache dtype (vLLM's boundary protection on dense models: 2)",
            minimum=0,
            kind=int,
        ),
        Param("residual", 0, "recent tokens kept in the cache dtype (vLLM: none)", minimum=0, kind=int),
        split_param("auto"),
    )

    # ----- the code --------------------------------------------------------------------------------
    def check_semantics(self) -> None:
        super().check_semantics()
        d = self.info.head_dim
        if not is_power_of_two(d):
            raise sm.UnsupportedAttention(
                f"{self.name} cannot run on a model with head size {d}: its Hadamard rotation needs a power of two"
            )

    def pick(self, n_prompt: int) -> dict:
        c = self.cfg
        pairs = candidates(KEY_BITS, VALUE_BITS, None, c["kbits"], c["vbits"], c["split"], self.name)
        self.choose_pair(pairs, self._set, n_prompt, int(c["residual"] or 0))
        return {
            "kbits": self.kbits,
            "vbits": self.vbits,
            "keys": "e4m3" if self.kbits == 8 else f"{self.kbits}-bit Lloyd-Max, Hadamard-rotated",
            "norm_correction": bool(c["norm_correction"]) and self.kbits != 8,
            "skipped_layers": sorted(self.full_layers()),
            "slot_bytes": int(self.token_bytes()),
        }

    def _set(self, kbits: float, vbits: float) -> None:
        self.kbits, self.vbits = int(kbits), int(vbits)

    def key_bytes(self) -> int:
        d = self.info.head_dim
        return d if self.kbits == 8 else packed_bytes(d, self.kbits) + 2

    def value_bytes(self) -> int:
        return packed_bytes(self.info.v_head_dim, self.vbits) + 4

    def token_bytes(self) -> float:
        """vLLM's slot: key bytes + value bytes (``TurboQuantConfig.slot_size``)."""
        return float(self.key_bytes() + self.value_bytes())

    def full_layers(self) -> frozenset[int]:
        n = self.info.n_layers
        k = min(int(self.cfg["skip_layers"]), n // 2)
        return frozenset([*range(k), *range(n - k, n)])

    def prepare(self, keys: Tensor, values: Tensor) -> list[Codes]:
        """The per-model constants: the Hadamard matrix and the keys' codebook (nothing per sequence)."""
        d, dev = self.info.head_dim, keys.device
        bits = self.kbits if self.kbits != 8 else self.vbits  # vLLM builds a codebook for k8v4 too (unused)
        c, b = gaussian_codebook(d, bits)
        self.state = Shared(
            hadamard=hadamard(d, dev),
            centroids=torch.tensor(c, dtype=torch.float32, device=dev),
            boundaries=torch.tensor(b, dtype=torch.float32, device=dev),
        )
        return [{} for _ in range(keys.shape[0])]

    def encode(self, layers: slice, k: Tensor, v: Tensor, extra: list[Codes]) -> Codes:
        out: Codes = {}
        if self.kbits == 8:
            out["keys"] = to_fp8(k, torch.ones((), device=k.device))
        else:
            x = k.float()
            norm = x.norm(dim=-1, keepdim=True)
            y = fwht(x / (norm + NORM_EPS))  # u H
            idx = torch.bucketize(y, self.state["boundaries"], right=True)  # y at a boundary: the upper cell
            out["key_codes"] = pack_codes(idx, self.kbits)
            out["key_norms"] = norm.squeeze(-1).half()
        codes, scale, lo = uniform_values(v, self.vbits)
        out["value_codes"] = pack_codes(codes, self.vbits)
        out["value_scales"] = scale
        out["value_minimums"] = lo
        return out

    def key_part(self, st: CodedLayer) -> TurboQuantCodes:
        """The key codes as ``kernels.turboquant`` reads them (Hadamard Pi, norm correction per the preset)."""
        return TurboQuantCodes(
            st.codes["key_norms"],
            self.state["hadamard"],
            self.state["centroids"],
            self.kbits,
            st.codes["key_codes"],
            hadamard=True,
            norm_correction=bool(self.cfg["norm_correction"]),
        )

    def value_groups(self, st: CodedLayer) -> QuantizedGroups:
        """The values as one group per token [Hkv, n, d] (``kernels.quant`` layout)."""
        d = self.info.v_head_dim
        return QuantizedGroups(
            st.codes["value_codes"].unsqueeze(-2),
            st.codes["value_scales"].unsqueeze(-1),
            st.codes["value_minimums"].unsqueeze(-1),
            self.vbits,
            d,
            2,
            d,
        )

    def code_logits(self, layer: int, qg: Tensor, st: CodedLayer) -> Tensor:
        if self.kbits == 8:
            return torch.matmul(qg, st.codes["keys"].float().transpose(-1, -2))
        return turboquant_logits(qg, self.key_part(st))

    def code_values(self, layer: int, p: Tensor, st: CodedLayer) -> Tensor:
        return weighted_token_sum(p, self.value_groups(st))

    def decoded(self, layer: int, st: CodedLayer, name: str) -> Tensor:
        """The keys (``name`` "key") or values ("value") [Hkv, n, d] float32 the codes stand for."""
        if name == "value":
            groups = self.value_groups(st)
            codes = unpack_codes(groups.codes.squeeze(-2), self.vbits, self.info.v_head_dim).float()
            return codes * groups.scale.float() + groups.minimum.float()
        if self.kbits == 8:
            return st.codes["keys"].float()
        c = self.state["centroids"][unpack_codes(st.codes["key_codes"], self.kbits, self.info.head_dim).long()]
        if self.cfg["norm_correction"]:
            c = unit_rows(c)
        return fwht(c) * st.codes["key_norms"].float().unsqueeze(-1)  # c H^T = c H

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        state = getattr(self, "state", None)
        if state is not None:
            yield "rotation", state["hadamard"]
            yield "codebook", state["centroids"]


__all__ = ["KEY_BITS", "VALUE_BITS", "VLLMTurboQuant", "gaussian_codebook", "uniform_values"]
