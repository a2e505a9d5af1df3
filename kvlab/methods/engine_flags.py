"""The KV-cache flags serving engines ship, each a named method: vLLM's TurboQuant presets and llama.cpp's
cache types, with and without its Hadamard rotation.

Each flag is its engine's method (``vllm_turboquant.VLLMTurboQuant``, ``ggml_cache.GGMLCache``) with the
settings the flag sets as its defaults (a subclass made here, as the ``METHOD@paper`` presets are);
``--param NAME.KNOB=VALUE`` still overrides them. ``FLAGS`` is the table the docs print
(docs/methods/engine-caches.md): engine, flag, kvlab name, bits per number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.methods.base import Compressor
from kvlab.methods.ggml_cache import GGMLCache
from kvlab.methods.vllm_turboquant import VLLMTurboQuant


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: how to ask the engine for it, the kvlab name that runs it, its settings."""

    engine: str
    flag: str
    name: str
    title: str
    base: type[Compressor]
    settings: dict
    summary: str


def _vllm(preset: str, kbits: int, vbits: int, nc: bool, summary: str) -> EngineFlag:
    name = "vllm-" + preset.removeprefix("turboquant_").replace("_", "-")
    settings = {"kbits": kbits, "vbits": vbits, "norm_correction": nc}
    return EngineFlag("vLLM", f"--kv-cache-dtype {preset}", name, f"vLLM {preset}", VLLMTurboQuant, settings, summary)


def _llama(kind: str, rotate: bool) -> EngineFlag:
    bits = {"q8_0": 8, "q5_0": 5, "q4_0": 4}[kind]
    flag = f"-ctk {kind} -ctv {kind}" + ("" if rotate else " with LLAMA_ATTN_ROT_DISABLE=1")
    how = "Hadamard-rotated first (llama.cpp's default since 2026)" if rotate else "no rotation"
    return EngineFlag(
        "llama.cpp",
        flag,
        f"ggml-{kind}" + ("-rot" if rotate else ""),
        f"llama.cpp {kind}" + (" + rotation" if rotate else ""),
        GGMLCache,
        {"kbits": bits, "vbits": bits, "rotate": rotate},
        f"llama.cpp's {kind} cache for keys and values: blocks of 32 with one fp16 scale, {how}.",
    )


FLAGS: tuple[EngineFlag, ...] = (
    _vllm("turboquant_k8v4", 8, 4, False,
          "vLLM's turboquant_k8v4: e4m3 keys, 4-bit uniform values, 16-bit edge layers."),
    _vllm("turboquant_4bit_nc", 4, 4, True,
          "vLLM's turboquant_4bit_nc: 4-bit Lloyd-Max keys (Hadamard, norm-corrected), 4-bit values."),
    _vllm("turboquant_k3v4_nc", 3, 4, True,
          "vLLM's turboquant_k3v4_nc: 3-bit Lloyd-Max keys (Hadamard, norm-corrected), 4-bit values."),
    _vllm("turboquant_3bit_nc", 3, 3, True,
          "vLLM's turboquant_3bit_nc: 3-bit Lloyd-Max keys (Hadamard, norm-corrected), 3-bit values."),
    _llama("q8_0", False),
    _llama("q8_0", True),
    _llama("q5_0", False),
    _llama("q5_0", True),
    _llama("q4_0", False),
    _llama("q4_0", True),
)  # fmt: skip


def flag_class(flag: EngineFlag) -> type[Compressor]:
    """The method that runs ``flag``: its engine's class with the flag's settings as defaults."""
    base = flag.base
    params = tuple(
        dataclasses.replace(p, default=flag.settings[p.name]) if p.name in flag.settings else p for p in base.params
    )
    made = "".join(part.title() for part in flag.name.replace("-", "_").split("_"))
    return type(
        made,
        (base,),
        {
            "__module__": __name__,
            "__qualname__": made,
            "name": flag.name,
            "title": flag.title,
            "summary": flag.summary,
            "engine_flag": flag,
            "params": params,
        },
    )


ENGINE_METHODS: tuple[type[Compressor], ...] = tuple(flag_class(f) for f in FLAGS)


__all__ = ["ENGINE_METHODS", "FLAGS", "EngineFlag", "flag_class"]
