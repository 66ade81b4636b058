"""TopkA: local top-k selection with error feedback, an all-gather of one packed sparse message per
rank, and a sparse sum (the all-gather baseline of SparDL's evaluation, and RedSync's
synchronization, Fang et al. section 2.3).

The scheme is :class:`~.select_allgather.SelectAllGather`'s; the all-gather follows halving
distances when P is a power of two (the cost of recursive doubling, behind RedSync's equation (1))
and Bruck otherwise. Both take
ceil(log2 P) rounds and make every rank send the P-1 other ranks' messages exactly once when sizes
are equal, so equation (1)'s ``lg(p) alpha + (p-1) M D beta`` holds for every P.

Cost per rank: ceil(log2 P) rounds, ``(P-1) k (s_idx + s_val)`` bytes sent and received when every
rank sends exactly k elements (exact selectors); ``message_bytes`` gives the exact figure for
messages of different sizes and ``max_count`` an upper bound (:func:`select_allgather_cost`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.cost import Cost, register_cost
from .base import register_method
from .select_allgather import SelectAllGather, select_allgather_cost

__all__ = ["TopkAllGather"]


@register_method("topka")
class TopkAllGather(SelectAllGather):
    """TopkA: error-feedback top-k per rank, all-gather of (indices, values), sparse sum.

    Args:
        comm: communicator (default: all ranks).
        density: fraction selected per rank, k = ceil(density * n).
        selector: a name of :mod:`sparsecomm.selection` (default ``"exact_topk"``, exact top-k).
        **selector_options: passed to ``make(selector, ...)``.
    """


@register_cost("topka")
def _topka_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4,
                message_bytes: Sequence[int] | None = None, max_count: int | None = None, **_: Any) -> Cost:
    return select_allgather_cost(P, n, k, rank, itemsize, message_bytes=message_bytes, max_count=max_count)
