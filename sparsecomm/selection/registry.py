"""The selector registry: ``register_selector(name)``, ``make(name, **options)``, ``available()``.

Selector names never repeat a method's name (``topk`` is a method, ``exact_topk`` the selector it uses).
The names the selectors had before, ``topk``, ``threshold`` and ``dgc``, still work for one release
(:data:`RENAMED`) with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.registry import Registry
from ..core.validate import check_options, keyword_options
from .base import Selector

__all__ = ["SELECTORS", "RENAMED", "register_selector", "make", "available", "option_names", "current_name"]

#: deprecated selector name -> its name now (the old names were also method names or modules)
RENAMED = {"topk": "exact_topk", "threshold": "fixed_threshold", "dgc": "dgc_sampled"}

#: Every selector class by name.
SELECTORS: Registry[type[Selector]] = Registry("selector")

S = TypeVar("S", bound=type[Selector])


def register_selector(name: str) -> Callable[[S], S]:
    """Class decorator: make the selector class available as ``make(name, ...)``."""
    return SELECTORS.register(name)  # type: ignore[return-value]


def current_name(name: str) -> str:
    """``name``, or the name a renamed selector has now (with a ``DeprecationWarning``)."""
    if isinstance(name, str) and name in RENAMED:
        warnings.warn(f"selector {name!r} is now called {RENAMED[name]!r}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=3)
        return RENAMED[name]
    return name


def option_names(name: str) -> list[str]:
    """The options selector ``name`` takes."""
    return keyword_options(SELECTORS.get(current_name(name)).__init__)[0]


def make(name: str, **options: Any) -> Selector:
    """A new selector ``sel(x, k) -> int64 indices``; ``options`` are the selector class's arguments
    (an unknown one raises :class:`~sparsecomm.core.validate.UnknownOptionError` listing the valid ones)."""
    name = current_name(name)
    cls = SELECTORS.get(name)
    check_options(f"selector {name!r}", options, keyword_options(cls.__init__)[0])
    return cls(**options)


def available() -> list[str]:
    """Names of the registered selectors, sorted."""
    return SELECTORS.names()
