"""Compression methods: one file per method, registered by name (see ``registry``)."""

from kvlab.compressors.base import Compressor
from kvlab.compressors.dense import DenseCompressor
from kvlab.compressors.handover import PrefillNeeds, PrefillState
from kvlab.compressors.params import Param, ParamError
from kvlab.compressors.registry import UnknownMethodError, get, methods, names, register

__all__ = [
    "Compressor",
    "DenseCompressor",
    "Param",
    "ParamError",
    "PrefillNeeds",
    "PrefillState",
    "UnknownMethodError",
    "get",
    "methods",
    "names",
    "register",
]
