"""The registered methods: every module of the methods package imported once, a class found by name,
and a method's options checked against its constructor (and its selector's).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from typing import Any

from ..core.validate import check_options, keyword_options
from ..selection import option_names as selector_option_names
from .base import METHODS, Method

__all__ = ["load_all", "available_methods", "method_class", "check_method_options"]

#: the modules of the package that register no method
SHARED_MODULES = {"accumulation", "base", "catalog", "checks", "output", "residual", "runner", "select_allgather",
                  "spec", "stats"}
_PACKAGE = __name__.rsplit(".", 1)[0]
_loaded = False


def load_all() -> None:
    """Import every method module (registering its class and cost formula); idempotent."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if info.name not in SHARED_MODULES:
            importlib.import_module(f"{_PACKAGE}.{info.name}")


def available_methods() -> list[str]:
    """Names accepted by :func:`make_method`, sorted."""
    load_all()
    return METHODS.names()


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``; ``ValueError`` listing the available names otherwise."""
    load_all()
    return METHODS.get(name)


def check_method_options(name: str, options: dict[str, Any]) -> None:
    """Raise :class:`~sparsecomm.core.validate.UnknownOptionError` for an option method ``name`` does not
    take: ``"spardl: unknown option 'x'; valid options: density, teams, sag, selector, nonfinite"``.

    A method that passes further options on to its selector (``**selector_options``) also takes that
    selector's options, and the message lists them under the selector's name."""
    names, passes_on = keyword_options(method_class(name).__init__)
    valid = [*names, "nonfinite"]
    selector = options.get("selector", _default(method_class(name).__init__, "selector"))
    if passes_on and isinstance(selector, str):
        taken = selector_option_names(selector)
        check_options(name, [option for option in options if option not in taken], valid,
                      more=f"; and those of its selector {selector!r}: {', '.join(taken) if taken else 'none'}")
    elif not passes_on:
        check_options(name, options, valid)


def _default(function: Any, parameter: str) -> Any:
    found = inspect.signature(function).parameters.get(parameter)
    return None if found is None else found.default
