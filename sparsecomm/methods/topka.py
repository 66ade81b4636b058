"""TopkA: local top-k selection with error feedback, an all-gather of one packed sparse message per
rank, and a sparse sum (the all-gather baseline of SparDL's evaluation, and RedSync's
synchronization, Fang et al. section 2.3).

Per call, on every rank r:

1. ``acc = grad + residual``; ``idx = self.select(acc)`` (the hook subclasses override);
   ``residual = acc`` with the entries at ``idx`` set to zero (error feedback).
2. All-gather of the packed message ``(indices, values)``; the receivers do not know its length, so
   the element counts travel first as the size header of :meth:`Communicator.exchange_many` (the
   "initial element which indicates the length" of RedSync section 2.3).
3. Every rank adds the P messages into a dense zero vector in rank order and divides by P, so the
   result is the same bit for bit on every rank.

All-gather of variable-size messages (:func:`sparse_allgatherv`): recursive doubling when P is a power
of two (the algorithm behind RedSync's equation (1)), Bruck otherwise. Both take ceil(log2 P) rounds
and make every rank send the P-1 other ranks' messages exactly once when sizes are equal, so
equation (1)'s ``lg(p) alpha + (p-1) M D beta`` holds for every P.

Cost per rank with message sizes ``m_q`` bytes (q = 0..P-1): ceil(log2 P) rounds, and the bytes the
schedule forwards (:func:`allgatherv_bytes`); with equal messages of ``m = k (s_idx + s_val)`` bytes
that is ``(P-1) m`` sent and received.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..collectives import bruck_allgatherv
from ..comm import Communicator
from ..costmodel import Cost, ceil_log2, register_cost
from ..selectors import make as make_selector
from ..sparse import SparseChunk, index_dtype
from . import Layout, Method, register_method

__all__ = ["TopkAllGather", "sparse_allgatherv", "recursive_doubling_allgatherv", "allgatherv_bytes",
           "allgatherv_cost", "SelectorStateMixin"]



# ---------------------------------------------------------------------- variable-size all-gather
def _is_power_of_two(P: int) -> bool:
    return P & (P - 1) == 0


def recursive_doubling_allgatherv(comm: Communicator, parts: Sequence[Tensor]) -> List[List[Tensor]]:
    """Recursive-doubling all-gather of per-rank tuples of 1-D tensors of sizes unknown to receivers.

    P must be a power of two. Step mask = 1, 2, ..., P/2: exchange everything held (the blocks of
    ranks ``r & ~(2 mask - 1) ..``, i.e. the ``mask`` ranks of this rank's current group) with rank
    ``r ^ mask``, in one packed message (a size header of one int64 per tensor first).
    Cost: log2 P rounds; rank r sends sum over steps of the bytes of the blocks it holds.
    Returns ``result[q]`` = the parts of rank q.
    """
    P, r = comm.size, comm.rank
    if not _is_power_of_two(P):
        raise ValueError(f"recursive_doubling_allgatherv needs a power-of-two size, got P={P}")
    width = len(parts)
    dtypes = [t.dtype for t in parts]
    device = parts[0].device if parts else None
    held: Dict[int, List[Tensor]] = {r: list(parts)}
    mask = 1
    while mask < P:
        partner = r ^ mask
        mine = sorted(held)
        outgoing = [t for q in mine for t in held[q]]
        incoming = comm.exchange_many(partner, outgoing, partner, count=mask * width,
                                      dtypes=dtypes * mask, device=device)
        first = partner & ~(mask - 1)
        for j in range(mask):
            held[first + j] = incoming[j * width:(j + 1) * width]
        mask *= 2
    return [held[q] for q in range(P)]


def sparse_allgatherv(comm: Communicator, parts: Sequence[Tensor]) -> List[List[Tensor]]:
    """All-gather of one packed message per rank whose size the receivers do not know.

    Recursive doubling for powers of two (RedSync, equation (1)), Bruck otherwise; ceil(log2 P)
    rounds either way. Returns ``result[q]`` = the parts of rank q (this rank's own parts included).
    """
    if comm.size == 1:
        return [list(parts)]
    if _is_power_of_two(comm.size):
        return recursive_doubling_allgatherv(comm, parts)
    return bruck_allgatherv(comm, parts)


def allgatherv_bytes(message_bytes: Sequence[int], rank: int) -> Tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) of ``rank`` in :func:`sparse_allgatherv` when rank q's
    message has ``message_bytes[q]`` payload bytes (size headers excluded). Replays the schedule."""
    P = len(message_bytes)
    if P == 1:
        return 0, 0, 0
    sent = recv = 0
    if _is_power_of_two(P):
        mask = 1
        while mask < P:
            mine = rank & ~(mask - 1)
            theirs = (rank ^ mask) & ~(mask - 1)
            sent += sum(message_bytes[mine:mine + mask])
            recv += sum(message_bytes[theirs:theirs + mask])
            mask *= 2
    else:
        distance = 1
        while distance < P:
            count = min(distance, P - distance)
            sent += sum(message_bytes[(rank + j) % P] for j in range(count))
            recv += sum(message_bytes[(rank + distance + j) % P] for j in range(count))
            distance *= 2
    return ceil_log2(P), sent, recv


# ---------------------------------------------------------------------- the method
class SelectorStateMixin:
    """Checkpoints ``self.selector``'s state (stateful selectors: thresholds, sampling counters)."""

    def extra_state(self) -> Dict[str, Any]:
        return {"selector": self.selector.state_dict()}  # type: ignore[attr-defined]

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        if "selector" in state:
            self.selector.load_state_dict(state["selector"])  # type: ignore[attr-defined]


@register_method("topka")
class TopkAllGather(SelectorStateMixin, Method):
    """TopkA: error-feedback top-k per rank, all-gather of (indices, values), sparse sum.

    Args:
        comm: communicator (default: all ranks).
        density: fraction selected per rank, k = ceil(density * n).
        selector: a name of :mod:`sparsecomm.selectors` (default ``"topk"``, exact top-k by magnitude).
        **selector_options: passed to ``sparsecomm.selectors.make(selector, ...)``.

    Subclassing: override :meth:`select` (which entries of ``acc`` this rank sends) and nothing else;
    the residual update, the packed all-gather, the sum and the stats stay in this class. The layout
    is ignored: selection is over the whole bucket.

    After a call, ``self.last_sent`` holds the local indices this rank sent (int64), e.g. for DGC
    momentum masking (:class:`sparsecomm.techniques.MomentumCorrection`).
    """

    sparse = True
    tracks_sent = True
    has_residual = True

    def __init__(self, comm: Optional[Communicator] = None, *, density: float, selector: str = "topk",
                 **selector_options: Any) -> None:
        super().__init__(comm, density=density)
        self.selector_name = selector
        self.selector = make_selector(selector, **selector_options)

    # ------------------------------------------------------------------ the hook
    def select(self, acc: Tensor) -> Tensor:
        """Indices (int64, distinct, any order) of the entries of ``acc`` = grad + residual that this
        rank sends. Default: the configured selector with k = ceil(density * n).

        Subclasses (e.g. hard threshold, SIDCo) override this; they may return any number of indices.
        """
        return self.selector(acc, self.k(acc.numel()))

    # ------------------------------------------------------------------ the work
    def reduce(self, grad: Tensor, layout: Layout) -> Tensor:
        n = grad.numel()
        with self.timer("select"):
            acc = self.residual_for(grad).add_(grad)
            idx = torch.sort(self.select(acc).to(torch.int64)).values
            chunk = SparseChunk.gather(acc, idx, n=n)
            acc[idx] = 0  # acc is self.residual: what was not sent stays
        self.last_sent = idx
        self.stats["selected"] = idx.numel()
        with self.timer("comm"):
            gathered = sparse_allgatherv(self.comm, chunk.parts())
        with self.timer("decompress"):
            out = torch.zeros_like(grad)
            for indices, values in gathered:
                SparseChunk(indices, values).scatter_add_(out)
            out.div_(self.comm.size)
        self.stats["message_bytes"] = chunk.nbytes()
        self.stats["counts"] = [int(indices.numel()) for indices, _ in gathered]
        self.stats["received_nnz"] = sum(self.stats["counts"])
        return out



@register_cost("topka")
def _topka_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4,
                message_bytes: Optional[Sequence[int]] = None, max_count: Optional[int] = None,
                **_: Any) -> Cost:
    """RedSync equation (1) without the compute terms: ceil(log2 P) rounds, (P-1) k (s_idx + s_val)
    bytes per rank when every rank sends exactly k elements (exact selectors).

    ``message_bytes`` (one entry per rank) gives the exact figure for messages of different sizes;
    ``max_count`` (a per-rank count bound, e.g. 2k for threshold binary search) gives an upper bound.
    """
    if message_bytes is None:
        per_element = torch.empty(0, dtype=index_dtype(n)).element_size() + itemsize
        count = k if max_count is None else max_count
        message_bytes = [count * per_element] * P
        exact = max_count is None
    else:
        exact = True
    return allgatherv_cost(message_bytes, P, rank, exact)


def allgatherv_cost(message_bytes: Sequence[int], P: int, rank: int, exact: bool) -> Cost:
    """Cost of :func:`sparse_allgatherv` for one packed message of ``message_bytes[q]`` bytes per rank q."""
    if len(message_bytes) != P:
        raise ValueError(f"message_bytes has {len(message_bytes)} entries, need one per rank (P={P})")
    rounds, sent, recv = allgatherv_bytes(list(message_bytes), rank)
    return Cost(rounds, sent, recv, exact=exact)
