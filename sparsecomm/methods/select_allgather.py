"""The select-then-all-gather scheme shared by TopkA and ExDyna's comparators (Top-k, hard
threshold, SIDCo): a base class, not a registered method.

Per call, on every rank r:

1. ``acc = grad + residual``; ``idx = self.select(acc)`` (subclasses choose the entries);
   ``residual = acc`` with the entries at ``idx`` set to zero (error feedback).
2. All-gather of the packed message ``(indices, values)``; the receivers do not know its length, so
   the element counts travel first as the size header of :meth:`Communicator.exchange_many` (the
   "initial element which indicates the length" of RedSync section 2.3), by
   :func:`~sparsecomm.transport.sparse_collectives.allgather_chunks`.
3. Every rank adds the P messages into a dense zero vector in rank order and divides by P, so the
   result is the same bit for bit on every rank.

Cost per rank with message sizes ``m_q`` bytes (q = 0..P-1): ceil(log2 P) rounds and the bytes the
all-gather forwards (:func:`select_allgather_cost`); with equal messages of ``m = k (s_idx + s_val)``
bytes that is ``(P-1) m`` sent and received (RedSync equation (1) without its compute terms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..blocks.selectors import make as make_selector
from ..core.cost import Cost
from ..transport.chunk import SparseChunk, pair_bytes
from ..transport.comm import Communicator
from ..transport.sparse_collectives import allgather_chunks, allgatherv_cost
from .base import Layout, Method

__all__ = ["SelectorStateMixin", "SelectAllGather", "select_allgather_cost"]


class SelectorStateMixin:
    """Checkpoints ``self.selector``'s state (stateful selectors: thresholds, sampling counters)."""

    def extra_state(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict()}  # type: ignore[attr-defined]

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "selector" in state:
            self.selector.load_state_dict(state["selector"])  # type: ignore[attr-defined]


class SelectAllGather(SelectorStateMixin, Method):
    """Error-feedback selection per rank, all-gather of (indices, values), sparse sum.

    Args:
        comm: communicator (default: all ranks).
        density: fraction selected per rank, k = ceil(density * n).
        selector: a name of :mod:`sparsecomm.blocks.selectors` (default ``"topk"``, exact top-k).
        **selector_options: passed to ``make(selector, ...)``.

    Subclassing: override :meth:`select` (which entries of ``acc`` this rank sends) and nothing else;
    the residual update, the packed all-gather, the sum and the stats stay in this class. The layout
    is ignored: selection is over the whole bucket.

    After a call, ``self.last_sent`` holds the local indices this rank sent (int64), e.g. for DGC
    momentum masking (:class:`sparsecomm.integration.dgc.MomentumCorrection`).
    """

    sparse = True
    tracks_sent = True
    has_residual = True

    def __init__(self, comm: Communicator | None = None, *, density: float, selector: str = "topk",
                 **selector_options: Any) -> None:
        super().__init__(comm, density=density)
        self.selector_name = selector
        self.selector = make_selector(selector, **selector_options)

    def select(self, acc: Tensor) -> Tensor:
        """Indices (int64, distinct, any order) of the entries of ``acc`` = grad + residual that this
        rank sends. Default: the configured selector with k = ceil(density * n).

        Subclasses (e.g. hard threshold, SIDCo) override this; they may return any number of indices.
        """
        return self.selector(acc, self.k(acc.numel()))

    def reduce(self, grad: Tensor, layout: Layout) -> Tensor:
        n = grad.numel()
        with self.timer("select"):
            acc = self.residual_for(grad).add_(grad)
            idx = torch.sort(self.select(acc).to(torch.int64)).values
            chunk = SparseChunk.gather(acc, idx, n=n)
            acc[idx] = 0  # acc is self.residual: what was not sent stays
        self.last_sent = idx
        self.stats.selected = idx.numel()
        with self.timer("comm"):
            gathered = allgather_chunks(self.comm, chunk)
        with self.timer("decompress"):
            out = torch.zeros_like(grad)
            for received in gathered:
                received.scatter_add_(out)
            out.div_(self.comm.size)
        self.stats["message_bytes"] = chunk.nbytes()
        self.stats["counts"] = [received.nnz for received in gathered]
        self.stats["received_nnz"] = sum(self.stats["counts"])
        return out


def select_allgather_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, *,
                          counts: Sequence[int] | None = None, message_bytes: Sequence[int] | None = None,
                          max_count: int | None = None) -> Cost:
    """Cost of :class:`SelectAllGather`'s all-gather.

    Exact with ``message_bytes`` (payload bytes per rank) or ``counts`` ((index, value) pairs per
    rank); an upper bound with ``max_count`` (a per-rank count bound, e.g. 2k for threshold binary
    search); otherwise k pairs per rank, exact for selectors that return exactly k.
    """
    pair = pair_bytes(n, itemsize)
    if message_bytes is not None:
        return allgatherv_cost(message_bytes, P, rank, exact=True)
    if counts is not None:
        if len(counts) != P:
            raise ValueError(f"counts has {len(counts)} entries, need one per rank (P={P})")
        return allgatherv_cost([c * pair for c in counts], P, rank, exact=True)
    count = k if max_count is None else max_count
    return allgatherv_cost([count * pair] * P, P, rank, exact=max_count is None)
