"""Synchronization methods: one module per method in this package, found automatically.

``make_method(name, **options)`` builds one inside a worker; ``available_methods()`` lists the
names; ``cost(name, P, n, k, ...)`` evaluates a method's (or collective's) registered cost formula.
A module registers its class with ``@register_method("name")`` (:mod:`.base`) and its formula with
``@register_cost("name")`` (:mod:`sparsecomm.core.cost`), next to the code that sends.

Method modules never import each other; what several share lives in :mod:`.base`,
:mod:`.stats`, :mod:`.select_allgather` or a lower layer.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ..core.cost import COSTS, Cost, evaluate
from ..transport import collectives, sparse_collectives  # noqa: F401  (register the collectives' formulas)
from ..transport.comm import Communicator
from .base import METHODS, Layout, Method, register_method
from .stats import Stats

__all__ = ["Method", "Layout", "Stats", "register_method", "make_method", "available_methods", "method_class",
           "cost", "available_costs", "load_all"]

_SHARED_MODULES = {"base", "stats", "select_allgather"}
_loaded = False


def load_all() -> None:
    """Import every method module (registering its class and cost formula); idempotent."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _SHARED_MODULES:
            importlib.import_module(f"{__name__}.{info.name}")


def available_methods() -> list[str]:
    """Names accepted by :func:`make_method`, sorted."""
    load_all()
    return METHODS.names()


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``; ``ValueError`` listing the available names otherwise."""
    load_all()
    return METHODS.get(name)


def make_method(name: str, comm: Communicator | None = None, **options: Any) -> Method:
    """Build method ``name`` over ``comm`` (default: all ranks of the default process group).

    Every sparse method takes ``density`` (k = ceil(density * n)); see each method's docstring for
    its other options. Unknown options raise ``TypeError`` naming them. ``nonfinite`` (``"error"``,
    the default, ``"skip"`` or ``"propagate"``) is every method's policy for NaN/Inf gradients
    (:attr:`Method.nonfinite`).
    The options are kept in ``method.options``; every call checks that all ranks built the method alike.
    """
    nonfinite = options.pop("nonfinite", "error")
    method = method_class(name)(comm, **options)
    method.nonfinite = nonfinite
    method.options = dict(options)
    return method


def available_costs() -> list[str]:
    """Names with a registered cost formula (methods and collectives)."""
    load_all()
    return COSTS.names()


def cost(name: str, P: int, n: int, k: int = 0, rank: int = 0, itemsize: int = 4, **options: Any) -> Cost:
    """This rank's cost of method (or collective) ``name`` for P workers, n elements, k selected."""
    load_all()
    return evaluate(name, P=P, n=n, k=k, rank=rank, itemsize=itemsize, **options)
