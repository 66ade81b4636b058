"""The selector registry: ``register_selector(name)``, ``make(name, **options)``, ``available()``."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Type, TypeVar

from .base import Selector

__all__ = ["register_selector", "make", "available"]

_REGISTRY: Dict[str, Type[Selector]] = {}

S = TypeVar("S", bound=Type[Selector])


def register_selector(name: str) -> Callable[[S], S]:
    """Class decorator: make the selector class available as ``make(name, ...)``."""

    def decorate(cls: S) -> S:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"selector name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def make(name: str, **options: Any) -> Selector:
    """A new selector ``sel(x, k) -> int64 indices``; ``options`` are the selector class's arguments."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; available: {', '.join(available())}") from None
    try:
        return cls(**options)
    except TypeError as err:
        raise TypeError(f"selector {name!r}: bad options {sorted(options)}: {err}") from None


def available() -> List[str]:
    """Names of the registered selectors, sorted."""
    return sorted(_REGISTRY)
