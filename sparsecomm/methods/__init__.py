"""Registry of synchronization methods: one module per method in this package, found automatically.

``make_method(name, **options)`` builds one inside a worker; ``available_methods()`` lists the
names. A module registers its class with ``@register_method("name")`` and its cost formula with
``@sparsecomm.costmodel.register_cost("name")``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Dict, List, Type

from .base import Layout, Method

__all__ = ["Method", "Layout", "register_method", "make_method", "available_methods", "method_class"]

_REGISTRY: Dict[str, Type[Method]] = {}
_loaded = False


def register_method(name: str) -> Callable[[Type[Method]], Type[Method]]:
    """Class decorator registering a :class:`Method` subclass under ``name``."""

    def wrap(cls: Type[Method]) -> Type[Method]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


def available_methods() -> List[str]:
    """Names accepted by :func:`make_method`, sorted."""
    _load_all()
    return sorted(_REGISTRY)


def method_class(name: str) -> Type[Method]:
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def make_method(name: str, comm=None, **options) -> Method:
    """Build method ``name`` over ``comm`` (default: all ranks of the default process group).

    Every sparse method takes ``density`` (k = ceil(density * n)); see each method's docstring for
    its other options. Unknown options raise ``TypeError`` naming them.
    """
    cls = method_class(name)
    return cls(comm, **options)
