"""Synchronization methods: one module per method in this package, found automatically.

``make_method(name, **options)`` builds one inside a worker; a :class:`MethodSpec` holds a name
with its options, checked once, for whatever builds methods later; ``available_methods()`` lists the
names; ``cost(name, P, n, k, ...)`` evaluates a method's registered cost formula and
``collective_cost(name, ...)`` a collective's. A module registers its class with
``@register_method("name")`` (:mod:`.base`) and its formula with ``@register_cost("name")``
(:mod:`sparsecomm.core.cost`), next to the code that sends.

Method modules never import each other; what several share lives in the shared modules (:mod:`.base`,
the interface; :mod:`.runner`, what runs around every call, with :mod:`.checks`, :mod:`.output`,
:mod:`.residual`, :mod:`.accumulation` and :mod:`.stats`; :mod:`.select_allgather`; :mod:`.catalog`
and :mod:`.spec`, which find and configure methods by name) or a lower layer.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..core.cost import COLLECTIVE_COSTS, METHOD_COSTS, Cost, evaluate
from ..transport import collectives, sparse_collectives  # noqa: F401  (register the collectives' formulas)
from ..transport.comm import Communicator
from .base import Layout, Method, Output, register_method
from .catalog import available_methods, check_method_options, load_all, method_class
from .spec import MethodSpec, method_spec
from .stats import Stats

__all__ = ["Method", "Output", "MethodSpec", "method_spec", "Layout", "Stats", "register_method", "make_method",
           "available_methods", "sparse_methods", "is_sparse", "tracks_sent", "method_class", "dense_warmup",
           "check_method_options",
           "cost",
           "available_costs", "collective_cost", "available_collective_costs", "load_all"]


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
