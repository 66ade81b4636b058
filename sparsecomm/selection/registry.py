"""The selector registry: ``register_selector(name)``, ``make(name, **options)``, ``available()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..core.registry import Registry
from .base import Selector

__all__ = ["SELECTORS", "register_selector", "make", "available"]

#: Every selector class by name.
SELECTORS: Registry[type[Selector]] = Registry("selector")

S = TypeVar("S", bound=type[Selector])


def register_selector(name: str) -> Callable[[S], S]:
    """Class decorator: make the selector class available as ``make(name, ...)``."""
    return SELECTORS.register(name)  # type: ignore[return-value]


def make(name: str, **options: Any) -> Selector:
    """A new selector ``sel(x, k) -> int64 indices``; ``options`` are the selector class's arguments."""
    cls = SELECTORS.get(name)
    try:
        return cls(**options)
    except TypeError as err:
        raise TypeError(f"selector {name!r}: bad options {sorted(options)}: {err}") from None


def available() -> list[str]:
    """Names of the registered selectors, sorted."""
    return SELECTORS.names()
