"""A loaded model as kvlab sees it: what its attention is (``ModelInfo``), the weights and tokenizer
together (``LoadedModel``), the cache dtypes budgets count, and the one error a load raises.

Value types only: loading, the attention inspection and the self-check are ``kvlab.engine.loader``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, cast

import torch

from kvlab.core.rope import Rotary
from kvlab.core.semantics import ModelSemantics, plain_semantics

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


MODELS_DOC = "docs/models.md"  # where the supported model families are listed


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why in one line, for the user."""


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and the compressors need to know about a model's attention."""

    id: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    max_positions: int
    cache_dtype: str = ""  # the dtype caches store K/V in ("": the compute dtype; see ``default_cache_dtype``)
    # per layer: scaling, sliding window, soft-cap, sinks, key/value head sizes (default, or empty:
    # plain attention in every layer)
    semantics: ModelSemantics = field(default=ModelSemantics(()), compare=False, repr=False)
    # the model's rotary position embedding, per layer (``kvlab.core.rope``); None: none kvlab can read
    rope: Rotary | None = field(default=None, compare=False, repr=False)
    # sequence lengths past which the model's RoPE switches factors for every position (Phi-3's longrope:
    # ``original_max_position_embeddings``; ``Rotary.factor_switches``): a run must not cross one
    rope_switches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.cache_dtype:
            object.__setattr__(self, "cache_dtype", self.dtype)
        if not self.semantics:
            object.__setattr__(self, "semantics", plain_semantics(self.n_layers, self.head_dim))
        if self.cache_dtype not in CACHE_DTYPES:
            raise ModelLoadError(f"unknown cache dtype {self.cache_dtype!r}; allowed: {', '.join(CACHE_DTYPES)}")

    def switch_crossed(self, prefilled: int, longest: int) -> int | None:
        """The first RoPE switch (``rope_switches``) a run would cross: its prefill of ``prefilled`` tokens ends
        at or before it and a later forward sees a sequence of ``longest`` tokens, longer than it (transformers'
        ``generate`` re-encodes the whole sequence with the new factors there; kvlab's caches keep the keys of
        the old). None: no switch is crossed."""
        return next((s for s in self.rope_switches if prefilled <= s < longest), None)

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def torch_cache_dtype(self) -> torch.dtype:
        """The dtype every cache stores its full-precision keys and values in (upcast for attention)."""
        return CACHE_DTYPES[self.cache_dtype]

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one stored key or value number: the cache dtype's size (what budgets count)."""
        return self.torch_cache_dtype.itemsize

    def with_cache_dtype(self, cache_dtype: str | None) -> ModelInfo:
        """The same model with caches stored in ``cache_dtype`` (None or "auto": the default for its device)."""
        chosen = cache_dtype if cache_dtype and cache_dtype != "auto" else default_cache_dtype(self.dtype, self.device)
        return replace(self, cache_dtype=chosen)

    @property
    def v_head_dim(self) -> int:
        """The value head size (the key head size but with multi-head latent attention)."""
        return self.semantics.v_dim

    def held_tokens(self, n_tokens: int) -> int:
        """Tokens the exact cache holds over all layers after ``n_tokens`` tokens (a local layer: its window)."""
        return sum(s.held(n_tokens) for s in self.semantics.layers)

    def to_json(self) -> dict:
        """The model as JSON-ready values (a tuple field as a list: what the same dict is once read back)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("semantics", "rope")}
        out["rope_switches"] = list(self.rope_switches)
        out["semantics"] = self.semantics.to_json()
        out["features"] = self.semantics.features()
        return out


CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_cache_dtype(dtype: str, device: str) -> str:
    """The 16-bit cache dtype papers and deployments count: the model's dtype on a GPU when it is
    16-bit, else float16 (on the CPU the model computes in float32 but its cache is float16)."""
    if str(device).startswith("cuda") and dtype in ("float16", "bfloat16"):
        return dtype
    return "float16"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo

    @property
    def device(self) -> torch.device:
        return torch.device(self.info.device)

    def with_cache_dtype(self, cache_dtype: str | None) -> LoadedModel:
        """The same weights with caches stored in ``cache_dtype`` (float32, float16, bfloat16; None: default)."""
        return replace(self, info=self.info.with_cache_dtype(cache_dtype))

    def encode(self, text: str, chat: bool = True) -> list[int]:
        """Token ids exactly as the model is fed: the chat template when the model has one."""
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = out["input_ids"] if isinstance(out, Mapping) else out  # a BatchEncoding or the ids themselves
            return [int(i) for i in cast("list[int]", ids)]  # one conversation, tokenized: one list of ids
        return [int(i) for i in tok(text)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one string

    @property
    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else src)
        return ids
