"""Where a kernel runs: compiled Triton on CUDA, Triton's interpreter on CPU, or the torch reference.

Triton decides once, when ``triton.language`` is imported, whether its own ``@jit`` library
functions (``tl.sum``, ``tl.zeros``, ...) are compiled or interpreted, and an interpreted kernel
cannot call compiled ones. So the interpreter is a property of the process: it needs
``TRITON_INTERPRET=1`` in the environment before anything imports triton. The tests therefore run
the kernels in a child process started with that variable (tests/test_kernels.py).

The switch: ``KVLAB_KERNELS`` = ``auto`` (Triton on CUDA, torch elsewhere; the default), ``triton``
(Triton everywhere; CPU tensors then need the interpreter), ``torch`` (the references everywhere); or
``set_backend(name)`` / ``using(name)`` from code, which win over the variable.
"""

from __future__ import annotations

import contextlib
import os

import torch

BACKENDS = ("auto", "triton", "torch")

try:  # triton is a Linux-only requirement; everything works without it through the references
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAVE_TRITON = False

_forced: str | None = None


def backend() -> str:
    """The backend in force: ``set_backend``'s choice, else ``KVLAB_KERNELS``, else ``auto``."""
    name = _forced or os.environ.get("KVLAB_KERNELS", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"KVLAB_KERNELS={name!r} is not one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: str | None) -> None:
    """Force ``auto``, ``triton`` or ``torch`` for this process (None: back to ``KVLAB_KERNELS``)."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    _forced = name


@contextlib.contextmanager
def using(name: str):
    """``with using("triton"): ...`` — the backend for the duration of the block."""
    global _forced
    before = _forced
    set_backend(name)
    try:
        yield
    finally:
        _forced = before


def use_triton(device: torch.device) -> bool:
    """Whether a call on tensors living on ``device`` goes to the Triton kernel."""
    name = backend()
    if name == "torch":
        return False
    if name == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("KVLAB_KERNELS=triton but triton is not installed")
        return True
    return HAVE_TRITON and device.type == "cuda"


def interpreting() -> bool:
    """Whether Triton was set to interpret (``TRITON_INTERPRET=1`` before triton was imported)."""
    if not HAVE_TRITON:
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def check_device(device: torch.device) -> None:
    """Refuse a Triton launch that cannot run: CPU tensors need the interpreter."""
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported "
            "(or KVLAB_KERNELS=torch / auto to use the torch references)"
        )


def next_pow2(x: int, least: int = 16) -> int:
    """The smallest power of two >= max(x, least) (Triton block shapes are powers of two)."""
    p = least
    while p < x:
        p *= 2
    return p
