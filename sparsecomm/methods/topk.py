"""ExDyna's "Top-k" comparator (Yoon and Oh, sections III and V): exact local top-k, all-gather, sum.

Like every select-then-all-gather scheme (:class:`~.select_allgather.SelectAllGather`), every rank
picks entries of its own ``acc = grad + residual`` over the WHOLE gradient, so the ranks' picks
overlap only by chance and the union grows with P (*gradient build-up*: up to P k non-zeros in the
result). This is TopkA with ExDyna's metrics (actual density, padding overhead f(t), global
error; :class:`~sparsecomm.selection.metrics.SparsificationMetrics`).

Cost: TopkA's, (P-1) k (s_idx + s_val) bytes per rank in ceil(log2 P) rounds.
"""

from __future__ import annotations

from typing import Any

from ..core.cost import Cost, register_cost
from ..selection.metrics import SparsificationMetrics
from .base import register_method
from .select_allgather import SelectAllGather, select_allgather_cost

__all__ = ["TopkComparator"]


@register_method("topk")
class TopkComparator(SparsificationMetrics, SelectAllGather):
    """ExDyna's "Top-k" baseline: exact local top-k, all-gather, sum (TopkA plus the paper's metrics).

    Args:
        density: k = ceil(density * n) per rank.
        global_error: also report the error metrics, local and global error (a pass over the
            residual and one extra exchange after the metered call, per call).
    """

    def __init__(self, comm=None, *, density: float, global_error: bool = False) -> None:
        super().__init__(comm, density=density, selector="exact_topk")
        self.track_global_error = bool(global_error)


@register_cost("topk")
def _topk_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, **_: Any) -> Cost:
    return select_allgather_cost(P, n, k, rank, itemsize)
