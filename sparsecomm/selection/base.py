"""The selector contract shared by every selector.

A selector is called as ``sel(x, k) -> indices``: ``x`` a 1-D floating tensor, ``k`` the number of
elements wanted, the result an int64 tensor of distinct indices into ``x`` (order unspecified) on
``x.device``, chosen by magnitude ``|x|``. How close the count is to ``k`` is each selector's
documented contract (exactly ``k``, a band such as ``[k, 2k]``, or none for a fixed threshold).

The base class handles what is common: it validates ``x`` and ``k``, returns no index for ``k == 0``
and every index for ``k >= n`` (density 1 is the dense case, for every selector), and by default
refuses NaN or Inf input with a ``ValueError``. Subclasses implement :meth:`Selector.select` for
``0 < k < n`` and keep any state across calls explicitly, saved by ``state_dict()``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor

__all__ = ["Selector", "NonFiniteInputError", "validate_input", "assert_finite"]


class NonFiniteInputError(ValueError):
    """The input to a selector holds NaN or Inf (refused unless ``check_finite=False``)."""


class Selector:
    """Base class: ``sel(x, k) -> int64 indices`` into the 1-D floating tensor ``x``.

    Args:
        check_finite: raise :class:`NonFiniteInputError` when ``x`` holds NaN or Inf (default). With
            ``False`` the check is skipped and the result for such input is unspecified (NaN compares
            false against every threshold, so threshold selectors never pick it).
    """

    #: name in the registry, set by ``register_selector``
    name: str = ""
    #: True when the selector returns exactly ``min(k, n)`` indices
    exact_count: bool = False

    def __init__(self, *, check_finite: bool = True) -> None:
        self.check_finite = bool(check_finite)

    # -- the call -------------------------------------------------------------------------------------
    def __call__(self, x: Tensor, k: int) -> Tensor:
        n = validate_input(x, k, self.name)
        k = operator.index(k)
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=x.device)
        if k >= n:
            if self.check_finite:
                assert_finite(x, self.name)
            return torch.arange(n, dtype=torch.int64, device=x.device)
        return self.select(x, int(k))

    def select(self, x: Tensor, k: int) -> Tensor:
        """Indices for ``0 < k < n``; implemented by subclasses. Must honour ``self.check_finite``."""
        raise NotImplementedError

    def accumulate(self, x: Tensor, addend: Tensor, k: int, *, dest: Tensor | None = None) -> Tensor:
        """``dest = x + addend`` (``dest`` defaults to ``x``: ``x += addend`` in place), then
        ``self(dest, k)``: error feedback's ``acc = residual + grad`` followed by the selection. A
        separate ``dest`` (shaped like ``x``, same dtype and device, not overlapping ``x`` or
        ``addend`` partially) leaves ``x`` unchanged, so a caller can keep the old residual until it
        is no longer needed. Selectors whose scan can do the addition (exact top-k) override
        :meth:`_fused_select` to read each vector once; the result is the same either way."""
        n = validate_input(x, k, self.name)
        for name, other in (("addend", addend), ("dest", x if dest is None else dest)):
            if not isinstance(other, Tensor) or other.shape != x.shape:
                got = tuple(other.shape) if isinstance(other, Tensor) else type(other).__name__
                raise ValueError(f"selector {self.name!r}: {name} must be a tensor shaped like x "
                                 f"({tuple(x.shape)}), got {got}")
        if dest is not None and (dest.dtype != x.dtype or dest.device != x.device):
            raise ValueError(f"selector {self.name!r}: dest must have x's dtype and device ({x.dtype}, "
                             f"{x.device}), got {dest.dtype}, {dest.device}")
        if 0 < k < n:
            fused = self._fused_select(x, addend, int(k), dest)
            if fused is not None:
                return fused
        total = x.add_(addend) if dest is None else torch.add(x, addend, out=dest)
        return self(total, k)

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        """For ``0 < k < n``: write ``x + addend`` to ``dest`` (``x`` when ``None``) inside the
        selection's scan and select, or return ``None`` (having changed nothing) where this selector
        cannot; the base class then adds and selects in two steps."""
        return None

    # -- state ----------------------------------------------------------------------------------------
    @property
    def stateless(self) -> bool:
        """Whether the selector keeps no state between calls (a selection changes nothing but its
        result), so that a selection can be made and then dropped."""
        return type(self).state_dict is Selector.state_dict

    def state_dict(self) -> dict[str, Any]:
        """The state carried from one call to the next (empty for stateless selectors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"selector {self.name!r} is stateless but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def validate_input(x: Tensor, k: Any, name: str) -> int:
    """Check the call ``sel(x, k)`` of selector ``name`` (1-D floating tensor, integer k >= 0); returns n."""
    if not isinstance(x, Tensor):
        raise TypeError(f"selector {name!r}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"selector {name!r}: x must be 1-D, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"selector {name!r}: x must be a floating tensor, got dtype {x.dtype}")
    try:
        k_int = operator.index(k)
    except TypeError:
        k_int = -1
    if isinstance(k, bool) or k_int < 0:
        raise ValueError(f"selector {name!r}: k must be an integer >= 0, got {k!r}")
    return x.numel()


def assert_finite(x: Tensor, name: str) -> None:
    """Raise :class:`NonFiniteInputError` unless every element of ``x`` is finite (one pass)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteInputError(
            f"selector {name!r}: input holds {bad} NaN/Inf element(s); selection by magnitude needs finite "
            "values (pass check_finite=False to skip this check)")
