"""Synchronization methods: one module per method in this package, found automatically.

``make_method(name, **options)`` builds one inside a worker; a :class:`MethodSpec` holds a name
with its options, checked once, for whatever builds methods later; ``available_methods()`` lists the
names; ``cost(name, P, n, k, ...)`` evaluates a method's registered cost formula and
``collective_cost(name, ...)`` a collective's. A module registers its class with
``@register_method("name")`` (:mod:`.base`) and its formula with ``@register_cost("name")``
(:mod:`sparsecomm.core.cost`), next to the code that sends.

Method modules never import each other; what several share lives in :mod:`.base`,
:mod:`.stats`, :mod:`.select_allgather` or a lower layer.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from ..core.cost import COLLECTIVE_COSTS, METHOD_COSTS, Cost, evaluate
from ..core.validate import check_options, keyword_options
from ..selection import option_names as selector_option_names
from ..transport import collectives, sparse_collectives  # noqa: F401  (register the collectives' formulas)
from ..transport.comm import Communicator
from .base import METHODS, Layout, Method, register_method
from .spec import MethodSpec, method_spec
from .stats import Stats

__all__ = ["Method", "MethodSpec", "method_spec", "Layout", "Stats", "register_method", "make_method",
           "available_methods", "sparse_methods", "is_sparse", "tracks_sent", "method_class", "dense_warmup",
           "check_method_options",
           "cost",
           "available_costs", "collective_cost", "available_collective_costs", "load_all"]

_SHARED_MODULES = {"base", "spec", "stats", "select_allgather"}
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


def sparse_methods() -> list[str]:
    """Names of the methods that take ``density``, sorted."""
    return [name for name in available_methods() if method_class(name).sparse]


def is_sparse(name: str) -> bool:
    """Whether method ``name`` takes ``density`` (``ValueError`` listing the names when unknown)."""
    return method_class(name).sparse


def tracks_sent(name: str) -> bool:
    """Whether method ``name`` reports the indices each call sent (``last_sent``: what DGC's momentum
    factor masking needs)."""
    return method_class(name).tracks_sent


def dense_warmup(name: str) -> int:
    """The dense all-reduce calls method ``name`` makes first with its default options (its
    ``warmup_steps``: Ok-Topk's 512, as in its paper), 0 for a method without such an option. The
    simulator predicts, and a measurement of the method's own work should time, the calls after them."""
    param = inspect.signature(method_class(name).__init__).parameters.get("warmup_steps")
    default = None if param is None else param.default
    return default if isinstance(default, int) and not isinstance(default, bool) else 0


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``; ``ValueError`` listing the available names otherwise."""
    load_all()
    return METHODS.get(name)


def make_method(name: str | MethodSpec, comm: Communicator | None = None, **options: Any) -> Method:
    """Build method ``name`` (or a :class:`MethodSpec`) over ``comm`` (default: all ranks of the
    default process group).

    Every sparse method takes ``density`` (k = ceil(density * n)); see each method's docstring for
    its other options. An unknown option raises :class:`~sparsecomm.core.validate.UnknownOptionError`
    (a ``TypeError``) naming the method and listing its options (:func:`check_method_options`).
    ``nonfinite`` (``"error"``, the default, ``"skip"`` or ``"propagate"``) is every method's policy for NaN/Inf
    gradients (:attr:`Method.nonfinite`). The options are kept in ``method.options``; every call checks
    that all ranks built the method alike.
    """
    return MethodSpec.of(name, options).build(comm)


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


def available_costs() -> list[str]:
    """Names of the methods with a registered cost formula (every method has one)."""
    load_all()
    return METHOD_COSTS.names()


def cost(name: str, P: int, n: int, k: int = 0, rank: int = 0, itemsize: int = 4, **options: Any) -> Cost:
    """This rank's cost of method ``name`` for P workers, n elements, k selected."""
    load_all()
    return evaluate(name, P=P, n=n, k=k, rank=rank, itemsize=itemsize, **options)


def available_collective_costs() -> list[str]:
    """Names of the collectives (and other communication parts) with a registered cost formula."""
    load_all()
    return COLLECTIVE_COSTS.names()


def collective_cost(name: str, P: int, n: int, k: int = 0, rank: int = 0, itemsize: int = 4,
                    **options: Any) -> Cost:
    """This rank's cost of collective ``name`` (``ring_allreduce``, ``bruck_allgather``, ...)."""
    load_all()
    return evaluate(name, P=P, n=n, k=k, rank=rank, itemsize=itemsize, formulas=COLLECTIVE_COSTS, **options)
