"""The selector registry: ``register_selector(name)``, ``make(name, **options)``, ``available()``.

Selector names never repeat a method's name (``topk`` is a method, ``exact_topk`` the selector it uses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..core.registry import Registry
from ..core.validate import check_options, keyword_options
from .base import Selector

__all__ = ["SELECTORS", "register_selector", "make", "available", "option_names"]

#: Every selector class by name.
SELECTORS: Registry[type[Selector]] = Registry("selector")

S = TypeVar("S", bound=type[Selector])


def register_selector(name: str) -> Callable[[S], S]:
    """Class decorator: make the selector class available as ``make(name, ...)``."""
    return SELECTORS.register(name)  # type: ignore[return-value]


def option_names(name: str) -> list[str]:
    """The options selector ``name`` takes."""
    return keyword_options(SELECTORS.get(name).__init__)[0]


def make(name: str, **options: Any) -> Selector:
    """A new selector ``sel(x, k) -> int64 indices``; ``options`` are the selector class's arguments
    (an unknown one raises :class:`~sparsecomm.core.validate.UnknownOptionError` listing the valid ones)."""
    cls = SELECTORS.get(name)
    check_options(f"selector {name!r}", options, keyword_options(cls.__init__)[0])
    return cls(**options)


def available() -> list[str]:
    """Names of the registered selectors, sorted."""
    return SELECTORS.names()
