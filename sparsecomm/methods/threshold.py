"""ExDyna's hard-threshold comparator (Yoon and Oh, section V; Aji and Heafield's sparsifier):
every ``|acc| >= threshold`` is sent, all-gather, sum.

Like every select-then-all-gather scheme (:class:`~.select_allgather.SelectAllGather`), every rank
picks entries of its own ``acc = grad + residual`` over the WHOLE gradient, so the ranks' picks
overlap only by chance and the union grows with P (*gradient build-up*: up to P k non-zeros in the
result), and every rank's count differs (padding overhead f(t) > 1 in an all-gather padded to
the largest count; ours is sized per message, f(t) is reported as a metric). The paper tunes the
threshold before training; our default is ExDyna's initial threshold 1 / (2 sqrt(k)), so the two
start from the same point and only ExDyna adapts.

Cost: TopkA's with the per-rank message sizes: ``cost("threshold", P, n, k, rank, counts=[k_0, ...,
k_(P-1)])`` is exact; without ``counts`` it is TopkA's figure for k per rank, marked inexact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..blocks.metrics import SparsificationMetrics
from ..blocks.selectors.threshold import HardThreshold
from ..core.cost import Cost, register_cost
from .base import register_method
from .select_allgather import SelectAllGather, select_allgather_cost

__all__ = ["HardThresholdAllGather"]


@register_method("threshold")
class HardThresholdAllGather(SparsificationMetrics, SelectAllGather):
    """Hard-threshold sparsifier: every ``|acc| >= threshold``, all-gather, sum.

    Args:
        density: the user-set density (metrics only, and the default threshold; density 1 sends all).
        threshold: the fixed threshold (default 1 / (2 sqrt(k)), ExDyna's initial threshold).
        global_error: also report the global error.
    """

    def __init__(self, comm=None, *, density: float, threshold: float | None = None,
                 global_error: bool = False) -> None:
        super().__init__(comm, density=density, selector="threshold",
                         threshold=0.0 if threshold is None else threshold)
        assert isinstance(self.selector, HardThreshold)
        self.hard: HardThreshold = self.selector
        self.fixed_threshold = threshold
        self.track_global_error = bool(global_error)

    def select(self, acc: Tensor) -> Tensor:
        k = self.k(acc.numel())
        if self.fixed_threshold is None:
            self.hard.threshold = 1 / (2 * math.sqrt(k))
        return self.selector(acc, k)


@register_cost("threshold")
def _threshold_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4,
                    counts: Sequence[int] | None = None, **_: Any) -> Cost:
    if counts is None:
        return select_allgather_cost(P, n, k, rank, itemsize).bound()
    return select_allgather_cost(P, n, k, rank, itemsize, counts=counts)
