"""Triton kernels for compressed-cache decoding, each with a torch reference of the same maths.

Dispatch: ``KVLAB_KERNELS=auto|triton|torch`` (or ``set_backend`` / ``using``): ``auto`` runs the
Triton kernel on CUDA tensors and the torch reference elsewhere; ``triton`` forces the kernels
(CPU tensors then need TRITON_INTERPRET=1 before triton is imported); ``torch`` forces the references. See _runtime.py.
"""

from kernels import decode_attention  # the module; its entry point is decode_attention.decode_attention
from kernels._runtime import BACKENDS, HAVE_TRITON, backend, set_backend, use_triton, using
from kernels.formats import QJLKeys, Segment, TurboQuantCodes
from kernels.qjl import (
    make_sketch,
    outlier_channels,
    qjl_estimate,
    qjl_estimate_grouped,
    qjl_estimate_split_grouped,
    qjl_estimate_split_pair,
    qjl_quantize,
    qjl_scores,
    sketch_queries,
)
from kernels.turboquant import turboquant_logits, turboquant_values

__all__ = [
    "BACKENDS",
    "HAVE_TRITON",
    "QJLKeys",
    "Segment",
    "TurboQuantCodes",
    "backend",
    "decode_attention",  # module
    "make_sketch",
    "outlier_channels",
    "qjl_estimate",
    "qjl_estimate_grouped",
    "qjl_estimate_split_grouped",
    "qjl_estimate_split_pair",
    "qjl_quantize",
    "qjl_scores",
    "set_backend",
    "sketch_queries",
    "turboquant_logits",
    "turboquant_values",
    "use_triton",
    "using",
]
