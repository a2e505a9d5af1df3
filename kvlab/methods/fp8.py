"""FP8 (e4m3) KV cache with per-head scales: the serving engines' safe 2x, as a baseline.

Micikevicius, Stosic, Burgess, Cornea, Dubey, Grisenthwaite, Ha, Heinecke, Judd, Kamalu, Mellempudi,
Oberman, Shoeybi, Siu, Wu. "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022),
https://arxiv.org/abs/2209.05433 — the E4M3 format (4 exponent bits, 3 mantissa bits, no
infinities, largest finite value 448), which serving engines use as a KV-cache dtype with one
scale per tensor or per head.

As implemented: every key and value number is stored as ``x / scale`` rounded to e4m3 by torch's
own cast (``torch.float8_e4m3fn``, one byte; values past +-448 saturate instead of becoming NaN).
``scales="head"`` (the default, as engines do): one float32 scale per layer, KV head and tensor
(keys, values), amax / 448 over the prompt's tokens, kept for the whole run; a generated token
larger than the prompt's largest saturates, as it would against an engine's calibrated scale.
``scales="token"``: one float16 scale per token, KV head and tensor (amax of that token / 448).
Attention upcasts the codes (and scales) to float32 inside attention only; nothing else is kept.

Bytes: one byte per number plus the scales actually held (per head: 8 bytes per layer and KV head;
per token: 4 bytes per token and KV head). With a 16-bit cache that is just over half of the exact
cache: a budget below what FP8 holds is refused (the smallest it honours is named). Above it, the
budget left over pays for the most recent tokens in the cache dtype (``residual``, chosen from the
budget when not given; streaming, the window's oldest token is cast to FP8 as a new one arrives).
At budget 1.0 nothing is cast: the exact cache.

Deviations: this is a storage format, not a paper's method; engines' per-tensor scales (one scale
for a whole layer) are not offered, per-head being the finer of their two common choices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.methods.params import Param
from kvlab.methods.token_quant import CodedLayer, Codes, TokenQuantizer

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_FLOOR = 2.0**-14  # smallest normal float16: a token of zeros gets a finite scale


def to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale as e4m3 (torch's cast, round to nearest even), saturated at +-448 (the cast would give NaN)."""
    return (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(E4M3)


def token_scales(x: Tensor) -> Tensor:
    """Per-token scales [..., n] float16 of x [..., n, d]: amax / 448 (rounded to float16, floored)."""
    return (x.float().abs().amax(-1) / FP8_MAX).clamp_(min=SCALE_FLOOR).half()


class FP8(TokenQuantizer):
    name = "fp8"
    title = "FP8 (e4m3)"
    group = "quantizer"
    paper = "Micikevicius et al., FP8 Formats for Deep Learning, arXiv:2209.05433 (the E4M3 format serving engines use)"
    summary = (
        "Keys and values as 8-bit e4m3 floats with per-head scales (the engines' 2x); a budget above that "
        "keeps the most recent tokens in 16 bits."
    )
    params = (
        Param(
            "scales", "head", "one scale per KV head (from the prompt's amax) or per token", choices=("head", "token")
        ),
        Param(
            "residual",
            None,
            "recent tokens kept in the cache dtype (chosen from the budget left over after FP8 when not given)",
            minimum=0,
            kind=int,
        ),
    )

    def pick(self, n_prompt: int) -> dict:
        self.per_token = self.cfg["scales"] == "token"
        return {"scales": self.cfg["scales"], "bits_per_number": 8}

    def token_bytes(self) -> float:
        info = self.info
        return info.head_dim + info.v_head_dim + (4 if self.per_token else 0)

    def fixed_bytes(self) -> float:
        return 0.0 if self.per_token else 8.0 * self.info.n_kv_heads

    def prepare(self, keys: Tensor, values: Tensor) -> list[Codes]:
        """Per-head scales [Hkv] float32 from the prompt's amax (per-token scales: nothing here)."""
        if self.per_token:
            return [{} for _ in range(keys.shape[0])]
        ks = (keys.float().abs().amax((-2, -1)) / FP8_MAX).clamp_(min=SCALE_FLOOR)  # [L, Hkv]
        vs = (values.float().abs().amax((-2, -1)) / FP8_MAX).clamp_(min=SCALE_FLOOR)
        return [{"key_scales": ks[i], "value_scales": vs[i]} for i in range(keys.shape[0])]

    def encode(self, layers: slice, k: Tensor, v: Tensor, extra: list[Codes]) -> Codes:
        if self.per_token:
            ks, vs = token_scales(k), token_scales(v)  # [L', Hkv, c]
            return {
                "keys": to_fp8(k, ks[..., None]),
                "values": to_fp8(v, vs[..., None]),
                "key_scales": ks,
                "value_scales": vs,
            }
        ks = torch.stack([e["key_scales"] for e in extra])[..., None, None]  # [L', Hkv, 1, 1]
        vs = torch.stack([e["value_scales"] for e in extra])[..., None, None]
        return {"keys": to_fp8(k, ks), "values": to_fp8(v, vs)}

    def _scales(self, st: CodedLayer, name: str) -> Tensor:
        """[Hkv, 1, n] (per token) or [Hkv, 1, 1] (per head) float32, to multiply logits or probabilities."""
        if self.per_token:
            return st.codes[name].float().unsqueeze(1)
        return st.extra[name].float()[:, None, None]

    def code_logits(self, layer: int, qg: Tensor, st: CodedLayer) -> Tensor:
        return torch.matmul(qg, st.codes["keys"].float().transpose(-1, -2)) * self._scales(st, "key_scales")

    def code_values(self, layer: int, p: Tensor, st: CodedLayer) -> Tensor:
        if self.per_token:
            return torch.matmul(p * self._scales(st, "value_scales"), st.codes["values"].float())
        return torch.matmul(p, st.codes["values"].float()) * self._scales(st, "value_scales")

    def decoded(self, layer: int, st: CodedLayer, name: str) -> Tensor:
        """The coded keys (``name`` "key") or values ("value") [Hkv, n, d] float32, as attention reads them."""
        return st.codes[f"{name}s"].float() * self._scales(st, f"{name}_scales").transpose(-1, -2)

    def dequantize(self, st: CodedLayer) -> tuple[Tensor, Tensor]:
        """The coded keys and values [Hkv, n, d] float32, as attention reads them."""
        return self.decoded(0, st, "key"), self.decoded(0, st, "value")


__all__ = ["FP8", "FP8_MAX", "to_fp8", "token_scales"]
