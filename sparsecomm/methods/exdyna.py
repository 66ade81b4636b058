"""ExDyna: exclusive dynamic partitions and an online-scaled threshold (Yoon and Oh, "ExDyna:
Preserving Near-Optimal Gradient Sparsification Cost for Scalable Distributed Deep Learning").

One step on rank r (Algorithm 1):

1. ``acc = residual + grad``.
2. Dynamic partition allocation (Algorithm 3): the gradient is cut into blocks (Algorithm 2, block
   size a multiple of 32, the remainder going to the last partition), grouped into P contiguous
   partitions of blocks. Using the previous step's per-partition selection counts, each pair of
   neighbouring partitions (i, i+1) is inspected once, left to right: when one holds more than
   ``balance_ratio`` x the mean count and the other less than 1/``balance_ratio`` of it,
   ``move_blocks`` blocks pass from the heavy to the light one (never below ``min_blocks``).
   Rank r then owns partition ``(t mod P + r) mod P``: the partitions rotate cyclically, so no two
   ranks search the same coordinates (no gradient build-up) and every rank sees every coordinate.
3. Partition-wise exclusive selection (Algorithm 4): the indices of the rank's partition where
   ``|acc| >= threshold``. Here steps 1 and 3 are one scan (:meth:`ExDyna.accumulate`), which also
   checks the gradient's finiteness: it writes ``acc`` and gathers ``|acc| >= threshold`` over all of
   ``acc``, of which the rank keeps its partition's; the threshold and partitions it used become the
   method's state only once the call goes on (:meth:`ExDyna.reduce`).
4. All-gather of the selected indices. ``allgather="uneven"`` (default) uses the all-gather of
   unknown sizes of :mod:`~sparsecomm.methods.topka` (halving distances for powers of two, Bruck
   otherwise), sending exactly the selected indices; ``allgather="padded"`` is the paper's
   all-gather: the counts first, then every rank's indices padded to the largest count m_t. Either
   way ``stats["padding_overhead"]`` holds f(t) = P m_t / k' (equation 5), the traffic factor
   padding costs.
5. All-reduce (sum) of every rank's ``acc`` at the union of the indices (k' = sum of counts
   coordinates; the partitions are disjoint, so the union is the concatenation, ordered by partition,
   hence sorted), divided by P. ``allreduce="rabenseifner"`` (default) or ``"ring"``.
6. ``acc`` is zeroed at the union on every rank and becomes the new residual.
7. Threshold update from the *global* count k' (identical on every rank). ``controller="paper"``:
   online threshold scaling (Algorithm 5, :class:`~sparsecomm.selection.threshold.ScaledThreshold`'s
   factor) from k' / k; x (1 + gamma) above ``threshold_band``, x (1 + gamma/4) inside
   (1/band, band], x (1 - gamma) below. ``controller="adaptive"`` (default): log-space feedback
   (:class:`~sparsecomm.selection.threshold.ThresholdController`), which corrects a factor-2
   error per step instead of 0.5% and follows a drifting gradient scale.

The threshold from the gradient. The paper's first threshold 1 / (2 sqrt(k)) does not depend on the
gradient's scale (on unit-scale gradients at density 0.001 it selects almost everything, for
hundreds of steps), and Algorithm 5's 0.5% steps cannot follow the growth of the residual over the
first 1/d steps. With ``controller="adaptive"`` every rank estimates, at every step, the k-th largest
``|acc|`` of its whole ``acc`` from a sample (about 1024/k of it;
:func:`~sparsecomm.selection.threshold.estimate_kth_magnitude`), k corrected by feedback on
the global count k' (identical on every rank), and selects with that in its partition.
The ranks' thresholds then differ by their samples' noise (a few percent), not in kind: each is an
estimate of the same global threshold. ``controller="paper"`` restores every constant of the paper
(one threshold shared by all ranks, first 1 / (2 sqrt(k)) or ``initial_threshold``, Algorithm 5).

The hard cap (``cap``, default 2): a rank selects at most ``ceil(cap * k / P)`` entries (twice its
share of k); a partition holding more keeps its largest and leaves the rest in the residual
(``stats.capped``, ``stats.cut``).

Consistency: partition re-balancing and threshold scaling use only the all-gathered counts, and each
sum is computed once by the collective and copied, so every rank holds the same state and result bit
for bit. At density 1 every coordinate is selected (threshold 0): the dense average.

Defaults are those of the authors' public code: 1024 blocks, alignment 32, ``min_blocks`` =
num_blocks / (4P), ``balance_ratio`` 1.05, one block moved; with ``controller="paper"`` also
``threshold_band`` 1.1, ``gamma`` 0.005 (factors 1.005, 1.00125, 0.995), initial threshold
1 / (2 sqrt(k)).

Cost per rank (``allgather="uneven"``, counts k_0..k_{P-1}, K' = sum): variable-size all-gather of
the index blocks (ceil(log2 P) rounds, bytes as replayed by
:func:`~sparsecomm.transport.sparse_collectives.allgatherv_traffic`) +
the chosen all-reduce of K' values; ``"padded"``: recursive-doubling all-gather of one int64 count
and of m_t = max k_i indices per rank, + the same all-reduce. Register: ``sparsecomm.methods.cost("exdyna",
P, n, k, rank, counts=[...], allgather=..., allreduce=...)``; without ``counts`` the figure assumes
perfectly balanced counts (k / P each) and is marked inexact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..core.cost import Cost, chunk_sizes, register_cost
from ..core.validate import check_int
from ..selection.metrics import SparsificationMetrics
from ..selection.scan import Scratch, take_and_clear
from ..selection.threshold import (
    ScaledThreshold,
    ThresholdController,
    cap_selection,
    estimate_kth_magnitude,
)
from ..transport.chunk import bytes_as, index_dtype
from ..transport.collectives import (
    allreduce,
    allreduce_cost,
    check_allreduce,
    recursive_doubling_allgather,
    recursive_doubling_cost,
)
from ..transport.sparse_collectives import allgatherv, allgatherv_traffic
from .accumulation import AllGather, FirstMessage
from .base import Layout, Method, Output, register_method
from .select_allgather import cap_limit, check_cap

__all__ = ["ExDyna", "BlockPartitions", "block_partition", "rebalance", "allocated_partition"]

log = logging.getLogger(__name__)

_ALLGATHERS = ("uneven", "padded")
_CONTROLLERS = ("adaptive", "paper")


# ---------------------------------------------------------------------- partitions (Algorithms 2, 3)
@dataclass(frozen=True)
class BlockPartitions:
    """P contiguous partitions of ``[0, n)`` made of blocks of ``block_size`` elements.

    Partition p holds blocks ``starts[p] .. starts[p] + blocks[p] - 1``; the last partition also
    holds the ``n - num_blocks * block_size`` elements past the last block.
    """

    n: int
    block_size: int
    blocks: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks)

    def bounds(self, p: int) -> tuple[int, int]:
        """``(start, end)`` element range of partition p."""
        start = self.starts[p] * self.block_size
        end = self.n if p == len(self.blocks) - 1 else (self.starts[p] + self.blocks[p]) * self.block_size
        return start, end


def block_partition(n: int, P: int, num_blocks: int = 1024, align: int = 32) -> BlockPartitions:
    """Algorithm 2: ``num_blocks`` blocks of ``(n // num_blocks)`` rounded down to a multiple of
    ``align``, dealt to P partitions (the first ``num_blocks mod P`` get one more).

    A gradient too short for that (n < num_blocks * align) gets blocks of ``align`` elements, as
    many as fit; one shorter than P * align gets one unaligned block of n // P per partition.
    """
    if num_blocks < 1 or align < 1 or P < 1:
        raise ValueError(f"num_blocks={num_blocks}, align={align}, P={P}: each must be >= 1")
    block = (n // num_blocks) // align * align
    count = num_blocks
    if block == 0:
        count, block = n // align, align
        if count < P:
            count, block = P, n // P
        log.debug("exdyna: n=%d too short for %d blocks of a multiple of %d; using %d blocks of %d",
                  n, num_blocks, align, count, block)
    blocks = chunk_sizes(count, P)
    starts = [0] * P
    for i in range(1, P):
        starts[i] = starts[i - 1] + blocks[i - 1]
    return BlockPartitions(n, block, tuple(blocks), tuple(starts))


def rebalance(parts: BlockPartitions, counts: Sequence[int], ratio: float = 1.05, move: int = 1,
              min_blocks: int = 1) -> BlockPartitions:
    """Algorithm 3, lines 7-28: move ``move`` blocks between neighbouring partitions whose
    selection ``counts`` (indexed by partition) lie on opposite sides of [mean / ratio, mean * ratio].

    Pairs (i, i+1) are inspected left to right; after a move the two counts are corrected by the
    expected count of the moved blocks (move * block_size * k'/n), as in the paper. A partition
    never drops below ``min_blocks`` blocks. Pure function of its arguments: every rank that passes
    the same counts gets the same partitions.
    """
    P = len(parts.blocks)
    total = sum(counts)
    if P < 2 or total == 0:
        return parts
    blocks, starts = list(parts.blocks), list(parts.starts)
    k = [float(c) for c in counts]
    mean = total / P
    moved_count = move * parts.block_size * total / parts.n
    for i in range(P - 1):
        left, right = k[i] / mean, k[i + 1] / mean
        if left > ratio and right < 1 / ratio:
            if blocks[i] - move < min_blocks:
                continue
            blocks[i] -= move
            blocks[i + 1] += move
            starts[i + 1] -= move
            k[i] -= moved_count
            k[i + 1] += moved_count
        elif left < 1 / ratio and right > ratio:
            if blocks[i + 1] - move < min_blocks:
                continue
            blocks[i] += move
            blocks[i + 1] -= move
            starts[i + 1] += move
            k[i] += moved_count
            k[i + 1] -= moved_count
    return BlockPartitions(parts.n, parts.block_size, tuple(blocks), tuple(starts))


def allocated_partition(step: int, rank: int, P: int) -> int:
    """Algorithm 3, line 29: the partition rank ``rank`` searches at step ``step``."""
    return (step % P + rank) % P


# ---------------------------------------------------------------------- the method
class _State(NamedTuple):
    """ExDyna's state between calls (identical on every rank)."""

    partitions: BlockPartitions
    partition_counts: list[int] | None  # the previous step's counts, by partition
    scaler: ScaledThreshold  # holds the threshold; Algorithm 5's factor
    feedback: ThresholdController | None  # the adaptive controller


class _Plan(NamedTuple):
    """One call's plan, made before it communicates (:meth:`ExDyna.accumulate`)."""

    state: _State  # the state it starts from
    estimated: float  # this call's threshold estimate
    partitions: BlockPartitions  # this call's partitions (rebalanced)
    mine: int  # the partition this rank searches
    threshold: float  # the threshold it selects with (0 at density 1)
    candidates: torch.Tensor  # increasing indices of |acc| >= threshold over all of acc


@register_method("exdyna")
class ExDyna(SparsificationMetrics, Method):
    """ExDyna (Yoon and Oh), Algorithms 1-5; see the module docstring.

    Args:
        density: user-set density d, k = ceil(d n).
        num_blocks: blocks of the gradient (1024).
        block_align: the block size is a multiple of this (32).
        min_blocks: smallest partition, in blocks (default num_blocks // (4P), at least 1).
        move_blocks: blocks moved per re-balancing decision (1).
        balance_ratio: alpha of Algorithm 3 (1.05).
        threshold_band: beta of Algorithm 5 (1.1; ``controller="paper"`` only).
        gamma: threshold step of Algorithm 5 (0.005; ``controller="paper"`` only).
        initial_threshold: delta_0 (default 1 / (2 sqrt(k)) with ``controller="paper"``; with
            ``"adaptive"``, if given, the first step's threshold instead of the estimate).
        controller: ``"adaptive"`` (default; threshold estimated from the gradient every step, with a
            correction held by feedback on the global count)
            or ``"paper"`` (the paper's constants: 1 / (2 sqrt(k)) and Algorithm 5).
        cap: at most ``ceil(cap * k / P)`` entries per rank (default 2.0; ``None``: no cap).
        allgather: ``"uneven"`` (variable-size all-gather, exact sizes) or ``"padded"`` (the paper's,
            every rank's indices padded to the largest count).
        allreduce: ``"rabenseifner"`` or ``"ring"`` for the values at the union of indices.
        global_error: also report the error metrics, local and global error (a pass over the
            residual and one extra exchange after the metered call, per call).
    """

    sparse = True
    has_residual = True

    def __init__(self, comm=None, *, density: float, num_blocks: int = 1024, block_align: int = 32,
                 min_blocks: int | None = None, move_blocks: int = 1, balance_ratio: float = 1.05,
                 threshold_band: float = 1.1, gamma: float = 0.005,
                 initial_threshold: float | None = None, allgather: str = "uneven",
                 allreduce: str = "rabenseifner", controller: str = "adaptive", cap: float | None = 2.0,
                 global_error: bool = False) -> None:
        super().__init__(comm, density=density)
        if controller not in _CONTROLLERS:
            raise ValueError(f"exdyna: controller={controller!r} must be one of {_CONTROLLERS}")
        self.controller = controller
        self.cap = check_cap(cap, "exdyna")
        for label, value in (("num_blocks", num_blocks), ("block_align", block_align),
                             ("move_blocks", move_blocks)):
            check_int(f"exdyna: {label}", value, minimum=1)
        check_int("exdyna: min_blocks", min_blocks, minimum=0, allow_none=True)
        for label, ratio in (("balance_ratio", balance_ratio), ("threshold_band", threshold_band)):
            if not ratio > 1:
                raise ValueError(f"exdyna: {label}={ratio!r} must be > 1")
        if not 0 < gamma < 1:
            raise ValueError(f"exdyna: gamma={gamma!r} must lie in (0, 1)")
        if initial_threshold is not None and not initial_threshold > 0:
            raise ValueError(f"exdyna: initial_threshold={initial_threshold!r} must be > 0")
        if allgather not in _ALLGATHERS:
            raise ValueError(f"exdyna: allgather={allgather!r} must be one of {_ALLGATHERS}")
        self.num_blocks = num_blocks
        self.block_align = block_align
        self.min_blocks_option = min_blocks
        self.move_blocks = move_blocks
        self.balance_ratio = float(balance_ratio)
        self.threshold_band = float(threshold_band)
        self.gamma = float(gamma)
        self.initial_threshold = initial_threshold
        self.allgather = allgather
        self.allreduce = check_allreduce(allreduce, "exdyna")
        self.track_global_error = bool(global_error)
        # State, identical on every rank; (re)built on the first call and whenever n changes.
        self.partitions: BlockPartitions | None = None
        self.partition_counts: list[int] | None = None  # previous step's counts, by partition
        self.scaler: ScaledThreshold | None = None  # holds the threshold; Algorithm 5's factor
        self.feedback: ThresholdController | None = None  # the adaptive controller
        self._scratch = Scratch()  # reused buffers of the selection pass

    # ------------------------------------------------------------------ state
    @property
    def samples_threshold(self) -> bool:
        """Whether every call estimates its threshold from a sample (``controller="adaptive"``): a cost
        set by the density, not by n (the simulator's calibration times it apart)."""
        return self.controller == "adaptive"

    def _state_for(self, n: int) -> _State:
        """The state a call on n elements starts from: the current one, or for a first call (or a new
        n) a fresh one, which the call adopts once it goes on (:meth:`reduce`)."""
        if self.partitions is not None and self.partitions.n == n:
            assert self.scaler is not None
            return _State(self.partitions, self.partition_counts, self.scaler, self.feedback)
        initial = self.initial_threshold
        if initial is None:
            initial = 1 / (2 * math.sqrt(self.k(n)))
        return _State(block_partition(n, self.comm.size, self.num_blocks, self.block_align), None,
                      ScaledThreshold(initial_threshold=initial, beta=self.threshold_band, gamma=self.gamma),
                      ThresholdController() if self.controller == "adaptive" else None)

    def _min_blocks(self, partitions: BlockPartitions) -> int:
        if self.min_blocks_option is not None:
            return self.min_blocks_option
        return max(1, partitions.num_blocks // (4 * self.comm.size))

    def extra_state(self) -> dict[str, Any]:
        parts = self.partitions
        return {"threshold": None if self.scaler is None else self.scaler.state_dict(),
                "feedback": None if self.feedback is None else self.feedback.state_dict(),
                "partition_counts": None if self.partition_counts is None else list(self.partition_counts),
                "partitions": None if parts is None else
                (parts.n, parts.block_size, list(parts.blocks), list(parts.starts))}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if state["threshold"] is None:
            self.scaler = None
        else:
            self.scaler = ScaledThreshold(beta=self.threshold_band, gamma=self.gamma)
            self.scaler.load_state_dict(state["threshold"])
        self.feedback = None
        if self.controller == "adaptive":
            self.feedback = ThresholdController()
            if state.get("feedback") is not None:
                self.feedback.load_state_dict(state["feedback"])
        self.partition_counts = None if state["partition_counts"] is None else list(state["partition_counts"])
        saved = state["partitions"]
        self.partitions = None if saved is None else \
            BlockPartitions(saved[0], saved[1], tuple(saved[2]), tuple(saved[3]))

    # ------------------------------------------------------------------ one step
    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, layout: Layout) -> _Plan:
        """This call's threshold and partitions (from a sample of ``acc = residual + grad``, nothing
        written yet), then one fused pass (the selectors' scan kernel where built) that writes ``acc``,
        checks the gradient and gathers ``|acc| >= threshold`` over all of ``acc`` (about P times this
        rank's share, the threshold estimating the global k-th magnitude). Changes no state: the plan
        is adopted in :meth:`reduce`."""
        n, P = grad.numel(), self.comm.size
        k = self.k(n)
        state = self._state_for(n)
        assert state.scaler.threshold is not None
        estimated = state.scaler.threshold
        if state.feedback is not None and (self.initial_threshold is None or self.step > 0):
            estimated = estimate_kth_magnitude(residual, state.feedback.target(k), self.step, addend=grad)
        partitions = state.partitions
        if state.partition_counts is not None:
            partitions = rebalance(partitions, state.partition_counts, self.balance_ratio, self.move_blocks,
                                   self._min_blocks(partitions))
        mine = allocated_partition(self.step, self.comm.rank, P)
        threshold = 0.0 if k >= n else estimated
        candidates = self._scratch.scan(residual, threshold, name="exdyna", check_finite=True, need_total=False,
                                        expected=math.ceil(2 * k), addend=grad, dest=acc).indices
        return _Plan(state, estimated, partitions, mine, threshold, candidates)

    def first_message(self, acc: torch.Tensor, picked: _Plan) -> FirstMessage:
        """This rank's indices (its partition's candidates, cut to the cap), all-gathered: replies are
        (the indices, how many there were before the cut, every rank's indices in rank order)."""
        start, end = picked.partitions.bounds(picked.mine)
        indices, found = self._selection(acc, picked.candidates, start, end, self.k(acc.numel()))

        def send() -> tuple[torch.Tensor, int, list[torch.Tensor]]:
            with self.timer("comm"):
                return indices, found, self._allgather_indices(indices)
        if self.allgather != "uneven":  # the padded all-gather: two of its own
            return FirstMessage(send)
        return AllGather(parts=[indices], send=send,
                         unpack=lambda blocks: (indices, found, [bytes_as(b, indices.dtype) for b in blocks]))

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        n, P, r = grad.numel(), self.comm.size, self.comm.rank
        k = self.k(n)
        acc, plan, (indices, found, gathered) = out.accumulated
        scaler = self._adopt(plan)
        with self.timer("comm"):
            # Rank q searched partition allocated_partition(step, q, P): order the union by partition.
            owner = [0] * P
            for q in range(P):
                owner[allocated_partition(self.step, q, P)] = q
            union = torch.cat([gathered[owner[p]] for p in range(P)]).long()
            counts = [int(g.numel()) for g in gathered]
            total = len(union)
        with self.timer("residual"):
            taken = take_and_clear(acc, union)  # the partitions are disjoint: distinct indices; acc keeps the rest
        with self.timer("comm"):
            summed = allreduce(self.comm, taken, self.allreduce) if total else taken
        with self.timer("decompress"):
            result = out.average([union], [summed], P, keep_sign=True)  # summed / P, 0 elsewhere
        self.partition_counts = [counts[owner[p]] for p in range(P)]
        if self.feedback is not None:
            self.feedback.update(total, k)
        else:
            scaler.threshold = plan.estimated * scaler.scale_factor(total, k)
        scaler.calls += 1
        self.stats.update(selected=counts[r], nnz_out=total, counts=counts, partition_id=plan.mine,
                          partition=plan.partitions.bounds(plan.mine), threshold=plan.threshold,
                          threshold_next=scaler.threshold, capped=int(found > counts[r]), cut=found - counts[r])
        return result

    def _adopt(self, plan: _Plan) -> ScaledThreshold:
        """Make ``plan``'s state, threshold and partitions this method's (the call goes on)."""
        self.partitions, self.partition_counts, self.scaler, self.feedback = plan.state
        self.scaler.threshold, self.partitions = plan.estimated, plan.partitions
        return self.scaler

    def _selection(self, acc: torch.Tensor, candidates: torch.Tensor, start: int, end: int,
                   k: int) -> tuple[torch.Tensor, int]:
        """This rank's indices to send (global, increasing): the candidates inside its partition
        [start, end), cut to the cap; and how many there were before the cut."""
        n, P = acc.numel(), self.comm.size
        with self.timer("select"):
            lo, hi = torch.searchsorted(candidates, torch.tensor([start, end], dtype=candidates.dtype,
                                                                 device=candidates.device)).tolist()
            selected = candidates[lo:hi]  # increasing indices of |acc| >= threshold inside the partition
            picked = selected.numel()
            limit = cap_limit(self.cap, k / P)
            if limit is not None and k < n and picked > limit:
                selected = cap_selection(acc, selected, limit)  # the rest stays in the residual
            return selected.to(index_dtype(n)), picked

    def _allgather_indices(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's selected indices, in rank order (see the module docstring for both modes)."""
        if self.allgather == "uneven":
            return [parts[0] for parts in allgatherv(self.comm, [indices])]
        count = torch.tensor([indices.numel()], dtype=torch.int64, device=indices.device)
        counts = [int(c) for c in recursive_doubling_allgather(self.comm, count)]
        padded = torch.zeros(max(counts), dtype=indices.dtype, device=indices.device)
        padded[:indices.numel()] = indices
        blocks = recursive_doubling_allgather(self.comm, padded)
        return [block[:c] for block, c in zip(blocks, counts, strict=False)]


# ---------------------------------------------------------------------- cost model
@register_cost("exdyna")
def _exdyna_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4,
                 counts: Sequence[int] | None = None, allgather: str = "uneven",
                 allreduce: str = "rabenseifner", **_: Any) -> Cost:
    """Traffic of one ExDyna step for rank ``rank`` given the per-rank selection ``counts``."""
    exact = counts is not None
    counts = list(counts) if counts is not None else chunk_sizes(k, P)
    if len(counts) != P:
        raise ValueError(f"exdyna cost: counts has {len(counts)} entries, expected P={P}")
    index_size = index_dtype(n).itemsize
    if allgather == "uneven":
        gather = Cost(*allgatherv_traffic([c * index_size for c in counts], rank))
    else:
        gather = recursive_doubling_cost(P=P, n=1, rank=rank, itemsize=8) + \
            recursive_doubling_cost(P=P, n=max(counts), rank=rank, itemsize=index_size)
    total = sum(counts)
    reduce = allreduce_cost(allreduce, P=P, n=total, rank=rank, itemsize=itemsize)
    result = gather + reduce
    return result if exact else result.bound()
