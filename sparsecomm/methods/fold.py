"""Folding a method's call agreement into its selection's scan (:attr:`.base.Method.agrees_in_reduce`):
helpers for the methods whose selection has state or picks its own threshold.

:meth:`.base.Method.accumulate_and_agree` writes ``acc = residual + grad`` in the selection's scan,
which also tells whether the gradient is finite, and then makes the call's agreement; a method that
opts in changes no state before that agreement. Two ways to keep that rule:

* :class:`ThresholdFold`, for the threshold methods on :class:`~.select_allgather.SelectAllGather`
  (``threshold``, ``sidco``): the selection picks its threshold without touching the controller,
  which moves after the agreement;
* :func:`kept_on_failure`, for a selection by stateful selectors (MSTopK's generator, the reused
  threshold of RedSync's sampled binary search): their state is put back when the call fails or is
  skipped in the agreement, so it stays as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from torch import Tensor

from ..selection.base import Selector
from .base import Layout, Method

__all__ = ["ThresholdFold", "kept_on_failure"]


@contextlib.contextmanager
def kept_on_failure(selectors: Iterable[Selector]) -> Iterator[None]:
    """Restore the ``selectors``' state (``state_dict``) when the block raises: wrap a
    :meth:`~.base.Method.accumulate_and_agree` whose selection moves them, so that a call the ranks
    refuse or skip in the agreement leaves them as they were."""
    kept = [(selector, selector.state_dict()) for selector in selectors]
    try:
        yield
    except BaseException:
        for selector, state in kept:
            selector.load_state_dict(state)
        raise


class ThresholdFold:
    """The selection of a threshold method (``threshold``, ``sidco``) folded into error feedback's scan,
    and the call's agreement after it (:attr:`~.base.Method.agrees_in_reduce`).

    :class:`~.select_allgather.SelectAllGather` makes the agreement in
    :meth:`~.base.Method.accumulate_and_agree`, handing it its configured selector's fused scan. A
    threshold method takes its threshold from the gradient itself, so it selects by its own
    :meth:`fused_select` instead: ``fused_select(residual, grad, acc)`` writes ``acc = residual + grad``
    and returns the selected indices, changing no state but the working threshold of its
    :class:`~sparsecomm.selection.threshold.HardThreshold` (set anew every call); its controller moves
    by :meth:`controller_update`'s result, run once every rank agreed to go on, so a refused or skipped
    call leaves it as it was.
    """

    agrees_in_reduce = True

    def fused_select(self, residual: Tensor, grad: Tensor, acc: Tensor) -> Tensor:
        """``acc = residual + grad`` and the indices this rank sends (raises
        :class:`~sparsecomm.selection.NonFiniteInputError` on a non-finite gradient)."""
        raise NotImplementedError

    def controller_update(self, acc: Tensor, indices: Tensor) -> Callable[[], None]:
        """What the controller learns from this call's selection (``indices`` of ``acc``, read now,
        before the sent values leave ``acc``), as the update to run once the ranks agreed."""
        raise NotImplementedError

    def accumulate_and_agree(self, grad: Tensor, layout: Layout,
                             select: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                             ) -> tuple[Tensor, Tensor | None]:
        """:meth:`.base.Method.accumulate_and_agree` with :meth:`fused_select` as the selection (the
        ``select`` handed in, the configured selector's scan, is not this method's), then the
        controller's update."""
        assert isinstance(self, Method)
        acc, indices = Method.accumulate_and_agree(self, grad, layout, self.fused_select)
        assert indices is not None
        self.controller_update(acc, indices)()
        return acc, indices
