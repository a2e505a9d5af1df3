"""llama.cpp's quantized KV cache (``--cache-type-k`` / ``--cache-type-v`` q8_0, q5_0, q4_0; Ollama's
``OLLAMA_KV_CACHE_TYPE``), with or without the Hadamard rotation llama.cpp applies since 2026.

Sources: ggml's block formats (ggml-quants.c, ``quantize_row_q8_0_ref`` / ``q5_0`` / ``q4_0``; the ``gguf``
Python package's ``gguf.quants`` implements the same) and llama.cpp's attention rotation (pull request
ggml-org/llama.cpp#21038, merged 2026-04-01; ``src/llama-kv-cache.cpp``, ``build_input_k_rot`` /
``build_input_v_rot``; ``src/llama-graph.cpp``, ``build_attn``). Implemented here, as llama.cpp does it:

* **Blocks** (``kernels.ggml_blocks``): each key and value vector cut into blocks of 32 numbers, one float16
  scale per block: q8_0 (34 bytes a block, 8.5 bits a number), q5_0 (22 bytes, 5.5 bits), q4_0 (18 bytes, 4.5
  bits), with ggml's reference rounding; keys and values each take their own type (``kbits`` / ``vbits``: 8,
  5 or 4), as ``-ctk`` and ``-ctv`` do.
* **Rotation** (``rotate``): before a key is stored, it and the query are multiplied by an orthonormal
  Walsh-Hadamard matrix (``kernels.hadamard``) in blocks of ``nrot`` numbers, nrot the largest power of two
  >= 64 dividing head_dim (64 for head_dim 64, 256 for 256): the logits are unchanged, the outlier channels
  spread over the block. Values are rotated in blocks of 64 (llama.cpp: "using smaller rotation matrices for
  V seems beneficial") and the attention output is rotated back with the same matrix (H H = I). llama.cpp turns
  this on by itself for a quantized cache whose head size is a multiple of 64 (``LLAMA_ATTN_ROT_DISABLE=1``
  and builds before April 2026 run without it); on other head sizes it stores the keys unrotated, and so does
  ``rotate=true`` here (``pick`` reports ``rotation: none`` there).
* **The query** (``query``): llama.cpp's CPU and CUDA attention kernels take the dot product of a quantized key
  with the query rounded to 8-bit blocks (q8_0 on the CPU, q8_1 on CUDA: the same codes and scales); with
  ``query=q8_0`` (default) the (rotated, scaled) query is rounded so too. Metal's kernels read it in 16 bits
  (``query=float``).
* Every token is stored quantized as it comes (the current token too, before it is attended); the prompt is
  attended exactly in the prefill (kvlab's shared prefill; llama.cpp's prefill reads the cache it has just
  written, a difference for the prompt's own attention only).

Bytes, per token, layer and KV head: (d / 32) x the key type's block bytes + (d / 32) x the value type's,
nothing else (the Hadamard matrices are per-model constants, shown apart). llama.cpp allocates its whole
context of cells up front; kvlab counts the tokens held.

Deviations: the prompt's own attention is exact (above). The attention scale multiplies the query before the
rotation and the rounding (llama.cpp scales the dot product after it); with the head sizes of kvlab's models
the scale is a power of two and the two are the same. ggml's x86 SIMD q8_0 quantizer rounds ties to even and
can differ from the reference in the last bit of a code; the reference is used.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from kernels.ggml_blocks import BLOCK, block_type, ggml_dequantize, ggml_quantize
from kernels.hadamard import block_rotate, hadamard
from kvlab.core import semantics as sm
from kvlab.methods.bit_split import candidates, side_params, split_param
from kvlab.methods.params import Param
from kvlab.methods.token_quant import CodedLayer, Codes, TokenQuantizer

WIDTHS = (8, 5, 4)  # q8_0, q5_0, q4_0
TYPE_OF = {8: "q8_0", 5: "q5_0", 4: "q4_0"}
V_ROT = 64  # llama.cpp rotates values in blocks of 64


def key_rotation_block(d: int) -> int:
    """llama.cpp's nrot for keys: the largest power of two >= 64 that divides ``d`` (``d`` a multiple of 64)."""
    n = 64
    while d % (2 * n) == 0:
        n *= 2
    return n


def round_query(q: Tensor) -> Tensor:
    """The query as llama.cpp's kernels meet a quantized key: rounded to q8_0 blocks along its last dim."""
    return ggml_dequantize(ggml_quantize(q, "q8_0"), "q8_0")


class GGMLCache(TokenQuantizer):
    name = "ggml"
    title = "llama.cpp cache types"
    group = "quantizer"
    paper = (
        "llama.cpp / ggml KV-cache types q8_0, q5_0, q4_0 (ggml-quants.c; --cache-type-k/-v) and llama.cpp's "
        "Hadamard attention rotation (ggml-org/llama.cpp#21038, 2026)"
    )
    summary = (
        "llama.cpp's quantized cache: blocks of 32 numbers with one fp16 scale (q8_0 8.5, q5_0 5.5, q4_0 4.5 bits), "
        "keys and values each their own type, optionally Hadamard-rotated first."
    )
    params = (
        *side_params(WIDTHS, int, "cache type: 8 = q8_0, 5 = q5_0, 4 = q4_0"),
        Param("rotate", True, "rotate keys, queries and values by a Hadamard matrix first (llama.cpp since 2026)"),
        Param(
            "query",
            "q8_0",
            "the query meets the keys rounded to q8_0 blocks (llama.cpp's CPU and CUDA kernels) or in float",
            choices=("q8_0", "float"),
        ),
        Param("residual", 0, "recent tokens kept in the cache dtype (llama.cpp: none)", minimum=0, kind=int),
        split_param("auto"),
    )

    def check_semantics(self) -> None:
        super().check_semantics()
        for d in {self.info.head_dim, self.info.v_head_dim}:
            if d % BLOCK:
                raise sm.UnsupportedAttention(
                    f"{self.name} cannot run on a model with head size {d}: ggml blocks are 32 numbers "
                    "(llama.cpp refuses a quantized cache there too)"
                )

    @property
    def rotating(self) -> bool:
        """``rotate``, where llama.cpp rotates: every head size a multiple of 64."""
        return bool(self.cfg["rotate"]) and not (self.info.head_dim % 64 or self.info.v_head_dim % 64)

    def pick(self, n_prompt: int) -> dict:
        c = self.cfg
        pairs = candidates(WIDTHS, WIDTHS, None, c["kbits"], c["vbits"], c["split"], self.name)
        self.choose_pair(pairs, self._set, n_prompt, int(c["residual"] or 0))
        d, dv = self.info.head_dim, self.info.v_head_dim
        rot = f"Hadamard {key_rotation_block(d)} (keys), {V_ROT} (values)" if self.rotating else "none"
        return {
            "cache_type_k": self.k_type,
            "cache_type_v": self.v_type,
            "rotation": rot,
            "bits_per_number": round(8 * self.token_bytes() / (d + dv), 4),
        }

    def _set(self, kbits: float, vbits: float) -> None:
        self.k_type, self.v_type = TYPE_OF[int(kbits)], TYPE_OF[int(vbits)]

    def token_bytes(self) -> float:
        return float(
            block_type(self.k_type).row_bytes(self.info.head_dim)
            + block_type(self.v_type).row_bytes(self.info.v_head_dim)
        )

    # ----- the cache -------------------------------------------------------------------------------
    def _rot_k(self, x: Tensor) -> Tensor:
        return block_rotate(x, key_rotation_block(x.shape[-1])) if self.rotating else x.float()

    def _rot_v(self, x: Tensor) -> Tensor:
        return block_rotate(x, V_ROT) if self.rotating else x.float()

    def encode(self, layers: slice, k: Tensor, v: Tensor, extra: list[Codes]) -> Codes:
        return {
            "keys": ggml_quantize(self._rot_k(k), self.k_type),
            "values": ggml_quantize(self._rot_v(v), self.v_type),
        }

    def code_logits(self, layer: int, qg: Tensor, st: CodedLayer) -> Tensor:
        q = self._rot_k(qg)
        if self.cfg["query"] == "q8_0":
            q = round_query(q)
        return torch.matmul(q, ggml_dequantize(st.codes["keys"], self.k_type).transpose(-1, -2))

    def code_values(self, layer: int, p: Tensor, st: CodedLayer) -> Tensor:
        return self._rot_v(torch.matmul(p, ggml_dequantize(st.codes["values"], self.v_type)))  # H H = I

    def decoded(self, layer: int, st: CodedLayer, name: str) -> Tensor:
        """The keys (``name`` "key") or values ("value") [Hkv, n, d] float32 the blocks stand for, rotated back."""
        if name == "key":
            return self._rot_k(ggml_dequantize(st.codes["keys"], self.k_type))
        return self._rot_v(ggml_dequantize(st.codes["values"], self.v_type))

    def shared_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The Hadamard matrices (per-model constants; llama.cpp keeps them in host memory)."""
        if self.rotating:
            yield "rotation", hadamard(key_rotation_block(self.info.head_dim))
            yield "rotation", hadamard(V_ROT)


__all__ = ["TYPE_OF", "WIDTHS", "GGMLCache", "key_rotation_block", "round_query"]
