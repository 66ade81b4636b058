"""Ok-Topk (Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP'22),
the "Ok-Topk" baseline of SparDL's evaluation ([SparDL], Table I and Fig. 8).

Per call t (t counts every call, warm-up included, as the public code's ``_allreduce_counter``):

0. Dense warm-up: the first ``warmup_steps`` calls (512 by default, as the issue records for the
   public code) are a plain all-reduce (the metered Rabenseifner algorithm).
1. ``acc = grad + residual``. Local threshold: when t is a multiple of ``threshold_interval`` (32),
   the exact k-th largest |acc|; in between the previous one, reused, first raised by ``reuse_scale``
   (1.03) up to ``reuse_loops`` (5) times while it would select more than 3k/2 (``add2residual`` in
   the public code). Select ``|acc| > threshold``. One scan (:meth:`OkTopk.accumulate`) writes
   ``acc``, checks the gradient's finiteness and gathers either the
   exact top-k (whose members above the k-th magnitude are the selection) or the elements above the
   reused threshold (on which the raised thresholds are counted and picked); afterwards the threshold is divided by
   ``local_scale`` (1.012) when fewer than 3k/4 were selected and multiplied by it when more than
   5k/4 were (the public code's ``_scale`` rule).
2. Balanced partition: when t is a multiple of ``partition_interval`` (64), and on the first sparse
   call, every rank takes the P - 1 evenly spaced quantiles of its selected (sorted) indices; their
   sum over the ranks (an all-reduce of P - 1 int64), divided by P, gives the region boundaries, so
   each region holds about k/P of the globally selected indices. In between the boundaries are reused.
3. Sparse reduce-scatter: the selected pairs of region q go to rank q (an all-to-all,
   :func:`~sparsecomm.transport.alltoallv.alltoallv`, P - 1 rounds); rank q adds them in rank order.
4. Global selection: when t is a multiple of ``threshold_interval``, every region owner all-gathers
   all its non-zero sums, every rank takes the exact top-k of them and the k-th magnitude becomes the
   global threshold; in between, owners all-gather only the sums with ``|v| > threshold`` and the
   threshold is adjusted by ``global_scale`` (1.008) with the same 3k/4 and 5k/4 rule.
   (:func:`~sparsecomm.transport.sparse_collectives.allgatherv`, ceil(log2 P) rounds.)
5. The result is the gathered pairs / P. Error feedback with nothing lost: each rank zeroes in its
   residual exactly the entries it selected that made it into the result (the public code's
   ``involved_indexes``); everything else stays.

With density 1 both thresholds are 0: every element is selected and the result is the dense average.

Warm-up and the synchronizer: ``SparseSynchronizer`` / ``SparseHookState`` have their own
``dense_warmup_steps``, during which this method is not called (its counter does not advance). To
reproduce Ok-Topk through them, keep this method's ``warmup_steps`` (512) and leave theirs at 0; or set
``warmup_steps=0`` here and use theirs (the schedules then count sparse calls only).

Cost (:func:`_oktopk_cost`): exact from the counts a call records (stats ``send_counts`` of every rank,
``gather_counts``) and its step: P - 1 + ceil(log2 P) rounds, plus the boundary all-reduce on
repartition calls; warm-up calls cost a Rabenseifner all-reduce of n elements. Without the counts, an
estimate of the balanced case (k/P pairs per region and rank), not a bound: threshold selection may
pick more.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.cost import Cost, register_cost
from ..core.validate import check_int, check_number
from ..selection import make as make_selector
from ..selection.scan import MagnitudeView, Scratch, above_float32, largest_of_chunk
from ..transport.alltoallv import alltoallv, alltoallv_traffic
from ..transport.chunk import SparseChunk, add_chunks, index_dtype, pair_bytes
from ..transport.collectives import allreduce, allreduce_cost
from ..transport.comm import Communicator
from ..transport.merge import members
from ..transport.sparse_collectives import allgatherv, allgatherv_traffic
from .accumulation import add_checked
from .base import Layout, Method, Output, register_method

__all__ = ["OkTopk", "PAPER_DEFAULTS"]

log = logging.getLogger(__name__)

#: the defaults of the authors' public code (github.com/Shigangli/Ok-Topk)
WARMUP_STEPS, THRESHOLD_INTERVAL, PARTITION_INTERVAL = 512, 32, 64
LOCAL_SCALE, GLOBAL_SCALE = 1.012, 1.008
REUSE_SCALE, REUSE_LOOPS = 1.03, 5          # add2residual in the public code's compression.py
PAPER_DEFAULTS: dict[str, float] = {"warmup_steps": WARMUP_STEPS, "threshold_interval": THRESHOLD_INTERVAL,
                                    "partition_interval": PARTITION_INTERVAL, "local_scale": LOCAL_SCALE,
                                    "global_scale": GLOBAL_SCALE, "reuse_scale": REUSE_SCALE,
                                    "reuse_loops": REUSE_LOOPS}


@register_method("oktopk")
class OkTopk(Method):
    """Ok-Topk with error feedback (see the module docstring).

    Args:
        density: k = ceil(density * n), the target count of both the local and the global selection.
        warmup_steps: dense all-reduce calls first (default 512).
        threshold_interval: calls between exact threshold estimations (default 32).
        partition_interval: calls between region repartitions (default 64).
        local_scale, global_scale: threshold adjustment factors (> 1; defaults 1.012, 1.008).
        reuse_scale, reuse_loops: the pre-selection raise of a reused local threshold (1.03, 5 times).
    """

    sparse = True
    has_residual = True
    tracks_sent = True

    def __init__(self, comm: Communicator | None = None, *, density: float,
                 warmup_steps: int = WARMUP_STEPS,
                 threshold_interval: int = THRESHOLD_INTERVAL,
                 partition_interval: int = PARTITION_INTERVAL,
                 local_scale: float = LOCAL_SCALE,
                 global_scale: float = GLOBAL_SCALE, reuse_scale: float = REUSE_SCALE,
                 reuse_loops: int = REUSE_LOOPS) -> None:
        super().__init__(comm, density=density)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.threshold_interval = check_int("threshold_interval", threshold_interval, minimum=1)
        self.partition_interval = check_int("partition_interval", partition_interval, minimum=1)
        self.local_scale = float(check_number("local_scale", local_scale, 1.0, strict=True))
        self.global_scale = float(check_number("global_scale", global_scale, 1.0, strict=True))
        self.reuse_scale = float(check_number("reuse_scale", reuse_scale, 1.0, strict=True))
        self.reuse_loops = check_int("reuse_loops", reuse_loops, minimum=0)
        self.local_threshold: float | None = None
        self.global_threshold: float | None = None
        self.boundaries: list[int] | None = None
        self.selector = make_selector("exact_topk")     # exact top-k for the periodic threshold estimation
        self._scratch = Scratch()  # the scan's buffers for the reused threshold's candidates

    # ------------------------------------------------------------------ schedule
    def estimates_threshold(self, step: int) -> bool:
        return step % self.threshold_interval == 0 or self.global_threshold is None

    def repartitions(self, step: int) -> bool:
        return step % self.partition_interval == 0 or self.boundaries is None

    # ------------------------------------------------------------------ the call
    @property
    def accumulates(self) -> bool:
        """Past the dense warm-up (whose all-reduce has no residual)."""
        return self.step >= self.warmup_steps

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor | MagnitudeView | None:
        """``acc = residual + grad`` in the scan of the local selection: the exact top-k (whose k-th
        magnitude is the new local threshold) when the threshold is estimated, else the candidates
        above the reused threshold (:class:`MagnitudeView`, on which the raised thresholds are
        counted); at density 1 the plain fused scan."""
        n = grad.numel()
        k = self.k(n)
        if k >= n:
            with self.timer("residual"):
                add_checked(residual, grad, acc, self._scratch, self.name)
            return None
        if self.estimates_threshold(self.step) or self.local_threshold is None:
            return self.selector.accumulate(residual, grad, k, dest=acc)
        return MagnitudeView(residual, self._scratch, above_float32(self.local_threshold), name=self.name,
                             check_finite=True, count=2 * k, need_mean=False, addend=grad, dest=acc)

    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        n, P, t = grad.numel(), self.comm.size, self.step
        if t < self.warmup_steps:
            with self.timer("comm"):
                total = allreduce(self.comm, grad, "rabenseifner")
            # a dense step's output counts as n non-zeros, as a dense method's does (no pass counting them)
            self.stats.update(warmup=True, dense_calls=1, selected=n, nnz_out=n)
            return total.div_(P) if P > 1 else total  # x / 1 is x
        k = self.k(n)
        exact = k >= n
        estimate, repartition = self.estimates_threshold(t), self.repartitions(t)
        acc, picked, _ = out.accumulated
        with self.timer("select"):
            idx, threshold = self._local_selection(acc, picked, k)
        self.stats.selected = idx.numel()
        with self.timer("comm"):
            if repartition:
                self.boundaries = self._repartition(idx, n)
            reduced, send_counts = self._reduce_scatter(idx, acc, n)
        with self.timer("select"):
            if estimate or exact:
                candidates = reduced.select(reduced.values != 0)
            else:
                assert self.global_threshold is not None
                candidates = reduced.select(reduced.values.abs() > self.global_threshold)
        with self.timer("comm"):
            gathered = allgatherv(self.comm, candidates.parts())
        with self.timer("select"):
            parts = self._global_selection([SparseChunk(i, v) for i, v in gathered], k, estimate, exact)
            global_count = sum(p.nnz for p in parts)
        with self.timer("decompress"):
            # one sweep over the sorted shares, no concatenation of them
            result = out.average([p.indices for p in parts], [p.values for p in parts], P)
        with self.timer("residual"):
            sent = idx[self._reached_result(idx, parts, send_counts)]
            acc.index_fill_(0, sent, 0)        # the residual keeps what did not reach the result
        self.last_sent = sent
        self.stats.update(nnz_out=global_count)
        self.stats.extra.update(
            local_threshold=threshold, global_threshold=self.global_threshold, estimated=estimate or exact,
            repartitioned=repartition, boundaries=list(self.boundaries or []), send_counts=send_counts,
            gather_counts=[g[0].numel() for g in gathered], global_count=global_count)
        return result

    def _local_selection(self, acc: Tensor, picked: Tensor | MagnitudeView | None, k: int) -> tuple[Tensor, float]:
        """This rank's selection ``|acc| > threshold`` (sorted indices) from what :meth:`accumulate`
        gathered, and the threshold it used; then the threshold's ``local_scale`` adjustment."""
        if picked is None:  # density 1
            self.local_threshold = 0.0
            idx = torch.nonzero(acc.abs() > 0.0).reshape(-1)
        elif isinstance(picked, MagnitudeView):
            assert self.local_threshold is not None
            self.local_threshold = self._pre_adjust(picked, self.local_threshold, k)
            idx = picked.indices_ge(above_float32(self.local_threshold), 2 * k)
        else:
            magnitudes = acc.index_select(0, picked).abs_()
            self.local_threshold = float(magnitudes.min())
            # every |acc_i| above the k-th largest is among the top k
            idx = torch.sort(picked[magnitudes > self.local_threshold]).values
        threshold = self.local_threshold
        count = idx.numel()
        if picked is not None:
            if count < 3 * k / 4:
                self.local_threshold = threshold / self.local_scale
            elif count > 5 * k / 4:
                self.local_threshold = threshold * self.local_scale
        return idx, threshold

    def _global_selection(self, parts: list[SparseChunk], k: int, estimate: bool, exact: bool) -> list[SparseChunk]:
        """The global selection from the regions' shares (region q's from rank q: disjoint, in rank order,
        each sorted, so together the sorted global selection), and the global threshold's update."""
        if exact:
            self.global_threshold = 0.0
        elif estimate:
            parts = [largest_of_chunk(SparseChunk(torch.cat([p.indices for p in parts]),
                                                  torch.cat([p.values for p in parts])), k)[0]]
            self.global_threshold = float(parts[0].values.abs().min()) if parts[0].nnz else 0.0
        else:
            assert self.global_threshold is not None
            global_count = sum(p.nnz for p in parts)
            if global_count < 3 * k / 4:
                self.global_threshold = self.global_threshold / self.global_scale
            elif global_count > 5 * k / 4:
                self.global_threshold = self.global_threshold * self.global_scale
        return parts

    def _pre_adjust(self, view: MagnitudeView, threshold: float, k: int) -> float:
        """A reused local threshold, raised by ``reuse_scale`` (1.03) up to ``reuse_loops`` (5) times
        while it would select more than 3k/2 (the public code's ``add2residual``); ``view``: the
        candidates of ``|acc| > threshold``, which hold those above every raised threshold."""
        for _ in range(self.reuse_loops):
            if view.count(above_float32(threshold)) <= 3 * k // 2:
                break
            threshold *= self.reuse_scale
        return threshold

    def _repartition(self, idx: Tensor, n: int) -> list[int]:
        """Region starts [0, b_1, ..., b_{P-1}, n] from the averaged local quantiles of ``idx``."""
        P = self.comm.size
        if P == 1:
            return [0, n]
        count = idx.numel()
        if count >= P:
            chunk = count // P
            local = idx[torch.arange(1, P, device=idx.device) * chunk].to(torch.int64)
        else:                                    # too few selected: even regions
            local = torch.tensor([q * n // P for q in range(1, P)], dtype=torch.int64, device=idx.device)
        summed = allreduce(self.comm, local, "rabenseifner")
        inner = torch.div(summed, P, rounding_mode="floor").clamp(0, n)
        inner = torch.cummax(inner, 0).values   # the average of sorted quantiles is sorted; keep it so
        return [0] + [int(b) for b in inner.tolist()] + [n]

    @staticmethod
    def _reached_result(idx: Tensor, parts: list[SparseChunk], send_counts: list[int]) -> Tensor:
        """Mask of this rank's selected entries ``idx`` (sorted) that are in the global selection:
        region by region where ``parts`` are the regions' shares (an entry of region q can only be in
        share q; ``send_counts[q]`` of ``idx`` fall in region q), else against the one chunk."""
        if len(parts) != len(send_counts):
            return members(idx, parts[0].indices)
        masks, start = [], 0
        for part, count in zip(parts, send_counts, strict=True):
            masks.append(members(idx[start:start + count], part.indices))
            start += count
        return torch.cat(masks)

    def _reduce_scatter(self, idx: Tensor, acc: Tensor, n: int) -> tuple[SparseChunk, list[int]]:
        """Send region q's selected pairs to rank q; returns this rank's region sum and the pairs sent
        to each region."""
        assert self.boundaries is not None
        P = self.comm.size
        edges = torch.tensor(self.boundaries, dtype=torch.int64, device=idx.device)
        cuts = torch.searchsorted(idx, edges).tolist()
        chunk = SparseChunk.gather(acc, idx, n=n)
        messages = [[chunk.indices[cuts[q]:cuts[q + 1]], chunk.values[cuts[q]:cuts[q + 1]]] for q in range(P)]
        received = alltoallv(self.comm, messages, [index_dtype(n), acc.dtype], acc.device)
        return add_chunks([SparseChunk(i, v) for i, v in received]), [cuts[q + 1] - cuts[q] for q in range(P)]

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"local_threshold": self.local_threshold, "global_threshold": self.global_threshold,
                "boundaries": None if self.boundaries is None else list(self.boundaries)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.local_threshold = state.get("local_threshold")
        self.global_threshold = state.get("global_threshold")
        bounds = state.get("boundaries")
        self.boundaries = None if bounds is None else list(bounds)

    def __repr__(self) -> str:
        return (f"OkTopk(P={self.comm.size}, density={self.density:g}, warmup_steps={self.warmup_steps}, "
                f"threshold_interval={self.threshold_interval}, partition_interval={self.partition_interval})")


@register_cost("oktopk")
def _oktopk_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, step: int | None = None,
                 warmup_steps: int = WARMUP_STEPS,
                 partition_interval: int = PARTITION_INTERVAL,
                 send_counts: Sequence[Sequence[int]] | None = None, gather_counts: Sequence[int] | None = None,
                 **_: Any) -> Cost:
    """Exact with ``step`` (calls before this one), ``send_counts[s][q]`` (pairs rank s sent to
    region q) and ``gather_counts[q]`` (pairs region q's owner all-gathered), for a method run from
    its first call. Without counts an estimate (``Cost.estimate``) of the balanced steady state that
    Ok-Topk aims at: each rank sends k/P pairs to every other region and each region gathers k/P
    pairs, the lower end of SparDL's Table I (2 (P-1)/P k)."""
    step = warmup_steps if step is None else step
    if step < warmup_steps:
        return allreduce_cost("rabenseifner", P=P, n=n, rank=rank, itemsize=itemsize)
    if P == 1:
        return Cost(0, 0, 0)
    pair = pair_bytes(n, itemsize)
    repartition = step % partition_interval == 0 or step == warmup_steps
    share = -(-k // P)
    sends = [list(row) for row in send_counts] if send_counts is not None else [[share] * P for _ in range(P)]
    gathers = list(gather_counts) if gather_counts is not None else [share] * P
    r1, s1, v1 = alltoallv_traffic([[c * pair for c in row] for row in sends], rank)
    r2, s2, v2 = allgatherv_traffic([c * pair for c in gathers], rank)
    total = Cost(r1 + r2, s1 + s2, v1 + v2)
    if repartition:
        total = total + allreduce_cost("rabenseifner", P=P, n=P - 1, rank=rank, itemsize=8)
    return total if send_counts is not None and gather_counts is not None else total.estimate()
