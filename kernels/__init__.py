"""Triton kernels for compressed-cache decoding, each with a torch reference of the same maths.

Dispatch: ``KVLAB_KERNELS=auto|triton|torch`` (or ``set_backend`` / ``using``): ``auto`` runs the
Triton kernel on CUDA tensors and the torch reference elsewhere; ``triton`` forces the kernels
(under Triton's interpreter on CPU tensors); ``torch`` forces the references. See _runtime.py.
"""

from kernels._runtime import BACKENDS, HAVE_TRITON, backend, set_backend, use_triton, using
from kernels.formats import QJLKeys, Segment
from kernels.qjl import make_sketch, outlier_channels, qjl_quantize, qjl_scores, sketch_queries

__all__ = [
    "BACKENDS",
    "HAVE_TRITON",
    "QJLKeys",
    "Segment",
    "backend",
    "make_sketch",
    "outlier_channels",
    "qjl_quantize",
    "qjl_scores",
    "set_backend",
    "sketch_queries",
    "use_triton",
    "using",
]
