"""The select-then-all-gather scheme shared by TopkA and ExDyna's comparators (Top-k, hard
threshold, SIDCo): a base class, not a registered method.

Per call, on every rank r:

1. ``acc = grad + residual``; ``idx = self.select(acc)`` (subclasses choose the entries);
   ``residual = acc`` with the entries at ``idx`` set to zero (error feedback). With the default
   selection the addition happens inside the selector's scan (one read of the gradient and the
   residual, :meth:`SelectAllGather.accumulate_select`).
2. All-gather of the packed message ``(indices, values)``, this call's first message
   (:meth:`~.base.Method.first_message`, an :class:`~.accumulation.AllGather`), which the runner may
   send along with the call's checks (on gloo and MPI, in the steps of ``allgatherv``: ceil(log2 P)
   messages in all). Sent by the method itself, it goes by
   :func:`~sparsecomm.transport.sparse_collectives.allgather_chunks`: with an exact-count selector
   every rank sends exactly k entries, a length every rank knows once the ranks checked n and the
   density, so each round is the payload alone; otherwise the element counts travel as the size
   header of :meth:`Communicator.exchange_many` (the "initial element which indicates the length" of
   RedSync section 2.3).
3. Every rank merges the P messages (each sorted by index) into the method's reused output buffer
   (:meth:`~.output.Output.average`: one ordered sweep that zeroes where the last call wrote and
   writes this call's average, :func:`~sparsecomm.transport.merge.average_into`): each index's sum is
   taken in rank order and divided by P on the way, so the result is the same bit for bit on every
   rank; no length-n vector is allocated per call, and nothing is sorted or counted again.

The hard cap (``cap``, default 2): a selector whose count can exceed k (a threshold, SIDCo, a band
selector) is cut to the ``ceil(cap * k)`` largest magnitudes it picked; what is cut stays in the
residual. ``stats.capped`` tells whether the cap acted, ``stats.cut`` how many entries it removed.

Cost per rank with message sizes ``m_q`` bytes (q = 0..P-1): ceil(log2 P) rounds and the bytes the
all-gather forwards (:func:`select_allgather_cost`); with equal messages of ``m = k (s_idx + s_val)``
bytes that is ``(P-1) m`` sent and received (RedSync equation (1) without its compute terms).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.cost import Cost
from ..selection import make as make_selector
from ..selection.scan import take_and_clear
from ..selection.threshold import cap_selection
from ..transport.chunk import SparseChunk, index_dtype, pair_bytes
from ..transport.comm import Communicator
from ..transport.merge import ascending
from ..transport.sparse_collectives import allgather_chunks, allgatherv_cost
from .accumulation import AllGather
from .base import Layout, Method, Output

__all__ = ["SelectorStateMixin", "SelectAllGather", "select_allgather_cost", "check_cap", "cap_limit"]


def check_cap(cap: float | None, method: str) -> float | None:
    """Validate the hard-cap option: ``None`` (no cap) or a factor >= 1 of the per-rank target."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1:
        raise ValueError(f"{method}: cap={cap!r} must be None (no cap) or a number >= 1 (the most a rank may "
                         "select, as a multiple of its target count)")
    return float(cap)


def cap_limit(cap: float | None, target: float) -> int | None:
    """The most entries a rank may select under ``cap`` with per-rank ``target`` (None: no cap)."""
    return None if cap is None else max(1, math.ceil(cap * target))


class SelectorStateMixin:
    """Checkpoints ``self.selector``'s state (stateful selectors: thresholds, sampling counters)."""

    def extra_state(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict()}  # type: ignore[attr-defined]

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "selector" in state:
            self.selector.load_state_dict(state["selector"])  # type: ignore[attr-defined]


class FeedbackStateMixin:
    """Checkpoints ``self._feedback`` (a :class:`~sparsecomm.selection.threshold.ThresholdController`,
    the density controller of threshold methods) beside the other extra state."""

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "feedback": self._feedback.state_dict()}  # type: ignore[misc,attr-defined]

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)  # type: ignore[misc]
        if "feedback" in state:
            self._feedback.load_state_dict(state["feedback"])  # type: ignore[attr-defined]


class SelectAllGather(SelectorStateMixin, Method):
    """Error-feedback selection per rank, all-gather of (indices, values), sparse sum.

    Args:
        comm: communicator (default: all ranks).
        density: fraction selected per rank, k = ceil(density * n).
        selector: a name of :mod:`sparsecomm.selection` (default ``"exact_topk"``, exact top-k).
        cap: the hard cap, at most ``ceil(cap * k)`` entries per rank (default 2.0; ``None``: no cap).
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

    def __init__(self, comm: Communicator | None = None, *, density: float, selector: str = "exact_topk",
                 cap: float | None = 2.0, **selector_options: Any) -> None:
        super().__init__(comm, density=density)
        self.cap = check_cap(cap, self.name)
        self.selector_name = selector
        self.selector = make_selector(selector, **selector_options)

    def select(self, acc: Tensor) -> Tensor:
        """Indices (int64, distinct, any order) of the entries of ``acc`` = grad + residual that this
        rank sends. Default: the configured selector with k = ceil(density * n).

        Subclasses (e.g. hard threshold, SIDCo) override this; they may return any number of indices.
        """
        return self.selector(acc, self.k(acc.numel()))

    def accumulate_select(self, acc: Tensor, grad: Tensor) -> Tensor:
        """``acc += grad`` (the residual, in place), then :meth:`select`: the call of a method that does
        not :meth:`accumulate` (an overridden ``select``, a selector that keeps state). With the
        configured selector both happen in one pass where it can
        (:meth:`~sparsecomm.selection.base.Selector.accumulate`)."""
        if type(self).select is SelectAllGather.select:
            return self.selector.accumulate(acc, grad, self.k(acc.numel()))
        acc.add_(grad)
        return self.select(acc)

    @property
    def accumulates(self) -> bool:
        """With the configured selector, when it keeps no state between calls (``exact_topk``): its scan
        of ``acc = residual + grad`` then also picks the entries and tells whether the gradient is
        finite (:meth:`accumulate`)."""
        return type(self).select is SelectAllGather.select and self.selector.stateless

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad`` and the indices this rank sends, in one scan (raises
        :class:`~sparsecomm.selection.NonFiniteInputError` on a non-finite gradient): the configured
        selector's :meth:`~sparsecomm.selection.base.Selector.accumulate` with k = ceil(density n)."""
        return self.selector.accumulate(residual, grad, self.k(grad.numel()), dest=acc)

    def controller_update(self, acc: Tensor, indices: Tensor) -> Callable[[], None]:
        """What a selection controller learns from this call (read from ``acc`` now, before the sent
        values leave it), as the update ``reduce`` runs: nothing here (the threshold methods move
        their controller)."""
        return _nothing

    def first_message(self, acc: Tensor, picked: Tensor) -> AllGather:
        """This rank's packed message, taken out of ``acc``, as an all-gather whose replies are (every
        rank's chunk, this rank's, the controller's update)."""
        n = acc.numel()
        update = self.controller_update(acc, picked)
        chunk = self._message(acc, picked, n)
        index_type, value_type = chunk.indices.dtype, chunk.values.dtype
        return AllGather(parts=chunk.parts(), send=lambda: (self._allgather(chunk, n), chunk, update),
                         unpack=lambda blocks: ([SparseChunk.from_bytes(b, index_type, value_type) for b in blocks],
                                                chunk, update))

    def _known_counts(self, n: int) -> list[int] | None:
        """Every rank's message length when it is known before the exchange: the configured selector
        picks exactly k = ceil(density n) entries (an exact-count selector, ``select`` not overridden)
        and the ranks checked n and the density, so all P messages hold k entries and the all-gather
        needs no size headers. ``None`` otherwise."""
        if type(self).select is not SelectAllGather.select or not self.selector.exact_count:
            return None
        return [self.k(n)] * self.comm.size

    def _allgather(self, chunk: SparseChunk, n: int) -> list[SparseChunk]:
        """Every rank's message, in rank order, by :func:`allgather_chunks` (timed as the comm)."""
        counts = self._known_counts(n)
        if counts is not None and chunk.nnz != counts[self.comm.rank]:
            raise RuntimeError(f"{self.name}: selector {self.selector_name!r} picked {chunk.nnz} entries, not "
                               f"the k={counts[self.comm.rank]} its exact count promises (a selector bug)")
        with self.timer("comm"):
            return allgather_chunks(self.comm, chunk, counts=counts)

    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        if out.accumulated is None:  # in place, after the call's checks
            with self.timer("select"):
                acc = self.residual_for(grad)
                idx = self.accumulate_select(acc, grad)
            chunk = self._message(acc, idx, grad.numel())
            gathered = self._allgather(chunk, grad.numel())
        else:
            gathered, chunk, update = out.accumulated.replies
            update()
        with self.timer("decompress"):
            result = out.average([c.indices for c in gathered], [c.values for c in gathered], self.comm.size)
        self.stats["message_bytes"] = chunk.nbytes()
        self.stats["counts"] = [received.nnz for received in gathered]
        self.stats["received_nnz"] = sum(self.stats["counts"])
        return result

    def _message(self, acc: Tensor, idx: Tensor, n: int) -> SparseChunk:
        """This rank's message: the selected entries (cut to the cap, in ascending order), their values
        taken out of ``acc``, whose rest stays as the residual (error feedback)."""
        with self.timer("select"):
            idx = idx.to(torch.int64)
            picked = idx.numel()
            limit = cap_limit(self.cap, self.k(n))
            if limit is not None and picked > limit:
                idx = cap_selection(acc, idx, limit)  # the rest stays in the residual
            idx = ascending(idx)  # sorted: the receivers merge the messages
        with self.timer("residual"):
            chunk = SparseChunk(idx.to(index_dtype(n)), take_and_clear(acc, idx))  # what was not sent stays
        self.last_sent = idx
        self.stats.update(selected=idx.numel(), capped=int(picked > idx.numel()), cut=picked - idx.numel())
        return chunk


def _nothing() -> None:
    """The controller update of a selection without a controller."""


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


def data_dependent_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4,
                        counts: Sequence[int] | None = None, **_: Any) -> Cost:
    """Cost of a :class:`SelectAllGather` whose per-rank count is data-dependent (threshold
    selection): exact with the measured ``counts``, else the bound of k pairs per rank."""
    if counts is None:
        return select_allgather_cost(P, n, k, rank, itemsize).bound()
    return select_allgather_cost(P, n, k, rank, itemsize, counts=counts)
