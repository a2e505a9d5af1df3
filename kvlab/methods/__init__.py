"""Compression methods: the contract (``base``), one file per method, compositions, and the registry
that lists them by name (``registry``). Imports ``kvlab.core`` and ``kernels`` only."""

from kvlab.methods.base import Compressor
from kvlab.methods.dense import DenseCompressor
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param, ParamError
from kvlab.methods.registry import UnknownMethodError, get, methods, names, register, unregister

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
    "unregister",
]
