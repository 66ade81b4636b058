"""Sparse gradients through the DDP hook: buckets holding a ``torch.sparse_coo`` gradient.

DDP puts a parameter whose gradient is sparse (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``)
in a bucket of its own and hands the hook that gradient itself (``bucket.buffer().is_sparse``); plain
DDP all-gathers the touched rows. The hook sends such a bucket through the row-sparse reducer of
:mod:`.embedding` (S2 Reducer's workload, Ge et al., "S2 Reducer: High-Performance Sparse
Communication to Accelerate Distributed Deep Learning", ICASSP 2022), whatever the method of the
other buckets, and returns the average as a sparse COO tensor, as plain DDP does:

* ``topka``, ``topkdsa``, ``omnireduce``: the method's own row-sparse route;
* every other method, ``s2reducer`` included: the ``topka`` route (all-gather of every rank's
  (row ids, rows), summed in rank order), exact: the rows a rank touched are already the sparse
  message, so no density is applied and nothing is fed back. ``s2reducer``'s row sketch
  (:class:`.embedding.RowSparseReducer` with ``method="s2reducer"``) is an estimate; the hook uses
  the exact route so that training matches plain DDP's.

Cost per sparse bucket: the route's (see :mod:`.embedding`); for ``topka``, an all-gather of
``m_r (dim + 1)`` values from every rank r (m_r: rows rank r touched).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..methods import Stats
from ..transport.comm import Communicator
from .embedding import RowSparseReducer, reduce_embedding_grad

__all__ = ["EXACT_ROUTES", "route_for", "SparseBuckets"]

#: Methods whose own row-sparse route is exact; every other method uses "topka".
EXACT_ROUTES = ("topka", "topkdsa", "omnireduce")


def route_for(method: str) -> str:
    """The row-sparse route the hook uses for ``method``'s sparse buckets."""
    return method if method in EXACT_ROUTES else "topka"


class SparseBuckets:
    """One :class:`RowSparseReducer` per sparse bucket (by bucket index and shape)."""

    def __init__(self, comm: Callable[[], Communicator]) -> None:
        self._comm = comm
        self._reducers: dict[tuple[int, tuple[int, ...]], RowSparseReducer] = {}

    @property
    def seen(self) -> bool:
        """Whether a sparse bucket has come through (the model has sparse gradients)."""
        return bool(self._reducers)

    def reduce(self, index: int, grad: torch.Tensor, method: str) -> tuple[torch.Tensor, Stats]:
        """The average over the ranks of the sparse gradient ``grad`` of bucket ``index`` (sparse
        COO, shaped like ``grad``) and the call's stats."""
        if grad.dim() != 2:
            raise ValueError(f"sparse gradient of bucket {index} has shape {tuple(grad.shape)}; the hook "
                             "reduces row-sparse (num_rows, dim) gradients (nn.Embedding, nn.EmbeddingBag)")
        key = (index, tuple(grad.shape))
        route = route_for(method)
        reducer = self._reducers.get(key)
        if reducer is None or reducer.method != route:
            reducer = RowSparseReducer(self._comm(), route, num_rows=grad.shape[0], dim=grad.shape[1])
            self._reducers[key] = reducer
        out = reduce_embedding_grad(grad, reducer)
        return out.to(grad.dtype), reducer.stats
