"""The registry of compression methods, by name. Each method file registers itself with ``@register``."""

from __future__ import annotations

import importlib
import pkgutil

from kvlab.compressors.base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}
_RESOLVERS: list = []  # name -> class or None, for composed names such as "snapkv+kivi4"
_LOADED = False


class UnknownMethodError(ValueError):
    pass


def register(cls: type[Compressor]) -> type[Compressor]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise TypeError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def add_resolver(fn) -> None:
    """Let ``get`` build classes for names that are not registered (e.g. compositions)."""
    _RESOLVERS.append(fn)


def _load_all() -> None:
    """Import every module of the package so that each method registers itself."""
    global _LOADED
    if _LOADED:
        return
    import kvlab.compressors as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in ("base", "registry"):
            importlib.import_module(f"kvlab.compressors.{mod.name}")
    _LOADED = True


_ORDER = {"reference": 0, "paper": 1, "baseline": 2, "recent": 3}


def names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY, key=lambda n: (_ORDER.get(_REGISTRY[n].group, 9), n))


def get(name: str) -> type[Compressor]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        for fn in _RESOLVERS:
            cls = fn(name)
            if cls is not None:
                return cls
        raise UnknownMethodError(f"unknown method {name!r}; allowed: {', '.join(names())}") from None


def methods() -> dict[str, type[Compressor]]:
    return {n: _REGISTRY[n] for n in names()}
