"""Compression methods: one file per method, registered by name (see ``registry``)."""

from kvlab.compressors.base import Compressor, Param, ParamError, PrefillState
from kvlab.compressors.dense import DenseCompressor
from kvlab.compressors.registry import UnknownMethodError, get, methods, names, register

__all__ = [
    "Compressor",
    "DenseCompressor",
    "Param",
    "ParamError",
    "PrefillState",
    "UnknownMethodError",
    "get",
    "methods",
    "names",
    "register",
]
