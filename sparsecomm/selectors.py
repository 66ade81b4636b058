"""The selector namespace, ``sparsecomm.selectors``: the names of :mod:`sparsecomm.selection`.

``sparsecomm.selectors.make(name, **options)`` returns ``sel(x, k) -> int64 indices``; ``available()``
lists the names; ``register_selector(name)`` adds one. The selectors, their fused magnitude scan and
the C kernel live in :mod:`sparsecomm.selection` (see its docstring for the table of selectors).
"""

from .selection import NonFiniteInputError, Selector, available, make, option_names, register_selector

__all__ = ["make", "available", "register_selector", "option_names", "Selector", "NonFiniteInputError"]
