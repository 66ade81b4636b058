"""Threshold searches on a GPU: the loop on the device, one host synchronization per selection.

The searches are RedSync's threshold binary search (Fang et al., "RedSync: Accelerating Distributed
Deep Learning Training with Gradient Compression", Journal of Parallel and Distributed Computing,
2019, Algorithm 3; its trimmed top-k, Algorithm 2, selects the exact top-k) and MSTopK (Shi et al.,
"Towards Scalable Distributed Training of Deep Learning on Public Cloud Clusters", MLSys 2021,
Algorithm 1). The CPU runs these bisections step by step on the gathered candidates (:mod:`.search`);
each step's count is cheap there. On a GPU every step that asks the
host costs a round trip, so here a selection is a fixed short sequence of kernels queued back to
back, and the host waits once, at the end, for a few figures:

1. the sample of ``|x|`` and the floor above its rank-th largest (:func:`.triton_scan.launch_sample`);
2. the pass: one read of ``x`` (``x + addend`` written to ``dest`` on the way) giving ``sum |x|``,
   ``max |x|`` and the candidates ``|x| >= floor`` in index order (:func:`.triton_scan.launch_gather`);
3. the search, on the candidates only (a few percent of ``x``):

   * a ratio bisection (RedSync Algorithm 3, MSTopK): the thresholds ``mean + ratio (max - mean)``
     that its next ``D`` steps can visit are the ``2^D - 1`` dyadic midpoints of the bracket; one
     kernel counts the candidates at all of them at once (each candidate finds, by a binary
     search, how many of those thresholds lie at or below it; a histogram of that number gives
     every count), and one single-program kernel replays the ``D`` steps from the counts. The
     thresholds are computed in float64 exactly as the host computes them (no fused multiply-add)
     and compared in float32, so the visited thresholds, counts and decisions are the CPU's;
   * the exact top-k (exact top-k, RedSync's trimmed top-k, whose result it is): a radix select
     of the candidates' float32 bit patterns, 9 bits a level, each level's 512-bin histogram made
     per program and added once;

4. the selection, in index order: a count per block of candidates, then a kernel that writes each
   block's picks at the prefix of the counts before it (ties with the k-th largest, or MSTopK's
   window of the band between its two thresholds, taken in index order by their rank among the
   tied).

From the second call with the same input tensors and sizes, the sequence is captured as a CUDA graph
and replayed: the host's part of a selection is then one launch and the synchronization
(:data:`GRAPHS`).

A case the device path does not decide -- the floor above a threshold whose exact count is needed
(a sample that misjudged), no threshold in RedSync's band, non-finite input, more candidates than
the buffers held -- is reported in the state's flags, and the caller takes its host path for that
call (:class:`Fallback`). The results equal the CPU's wherever the device path decides.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..transport.triton_launch import Launcher
from . import triton_scan
from .triton_scan import FLAGS, HISTS, STATE, Buffers, finish, launch_gather, launch_sample, tl, triton

__all__ = ["Fallback", "SamplePlan", "exact_topk", "band_search", "mstopk", "bisection_steps", "MSTOPK_DRAW"]

#: the largest bisection depth one counting pass covers (``2^D`` int32 counts, replayed in registers)
_DEPTH = 15
#: candidates per program of the search kernels
_BLOCK = 2048
#: MSTopK's window is placed by one draw ``u`` of ``torch.randint(*MSTOPK_DRAW)`` per call, taken
#: before the search on both devices: ``start = u % (band - missing + 1)`` (from 2^32 on, so that the
#: kernels always take it as a 64-bit integer)
MSTOPK_DRAW = (1 << 32, 1 << 62)

_MODE_GE, _MODE_TOPK, _MODE_WINDOW = 0, 1, 2

#: whether the pipelines run as CUDA graphs from their second call with the same inputs and sizes
#: (``SPARSECOMM_CUDA_GRAPHS=0``: the kernels are launched one by one on every call)
GRAPHS = os.environ.get("SPARSECOMM_CUDA_GRAPHS", "1") not in ("", "0")

log = logging.getLogger(__name__)
_BAND, _MSTOPK = 0, 1


class Fallback(Exception):
    """The device path did not decide this call (``reason``); the caller takes its host path on
    ``summed`` (``x + addend`` when the pass wrote it, else ``x``)."""

    def __init__(self, reason: str, summed: Tensor) -> None:
        super().__init__(reason)
        self.reason = reason
        self.summed = summed


@dataclass(frozen=True)
class SamplePlan:
    """Where the floor's sample lies (``runs`` runs of :data:`~.triton_scan.SAMPLE_RUN` elements,
    ``stride`` apart) and the sample rank the floor sits under (``rank``); ``expected`` candidates."""

    runs: int
    stride: int
    rank: int
    expected: int


if triton is not None:
    _S = STATE

    @triton.jit
    def _bisection_threshold(mean, span_lo, span, top, j, DEPTH: tl.constexpr):
        """``mean + ratio * (top - mean)`` for the ratio ``span_lo + span * j / 2^DEPTH``, in float64,
        each operation rounded as the host's (the kernels are compiled without fused multiply-add)."""
        ratio = span_lo + span * (j.to(tl.float64) * (1.0 / (1 << DEPTH)))
        return mean + ratio * (top - mean)

    @triton.jit(do_not_specialize=["n", "capacity"], do_not_specialize_on_alignment=["state_ptr", "hist_ptr"])
    def _grid_count_kernel(val_ptr, state_ptr, n, hist_ptr, capacity, DEPTH: tl.constexpr, BLOCK: tl.constexpr):
        """For each candidate ``v``, ``p(v)``: how many of the bracket's ``2^DEPTH - 1`` midpoint
        thresholds (float32-rounded) lie at or below ``v`` (a binary search); the histogram of
        ``p`` gives the count at every one of them. Nothing once the search is done."""
        if tl.load(state_ptr + 16) == 0.0:
            count = tl.minimum(tl.load(state_ptr + 0).to(tl.int64), capacity)
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < count
            v = tl.load(val_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            mean = tl.load(state_ptr + 1) / n.to(tl.float64)
            top = tl.load(state_ptr + 2)
            lo = tl.load(state_ptr + 6)
            span = tl.load(state_ptr + 7) - lo
            last = (1 << DEPTH) - 1
            low = tl.zeros([BLOCK], dtype=tl.int32)
            high = tl.full([BLOCK], last, dtype=tl.int32)
            for _ in tl.static_range(DEPTH):
                mid = (low + high + 1) >> 1
                at_or_below = _bisection_threshold(mean, lo, span, top, mid, DEPTH).to(tl.float32) <= v
                low = tl.where(at_or_below, mid, low)
                high = tl.where(at_or_below, high, mid - 1)
            tl.atomic_add(hist_ptr + low, 1, mask=ok & (low > 0) & (low < last), sem="relaxed")
            tl.atomic_add(hist_ptr + last, tl.sum(((low == last) & ok).to(tl.int32), 0), sem="relaxed")

    @triton.jit(do_not_specialize=["n", "k", "limit", "steps"],
                do_not_specialize_on_alignment=["state_ptr", "draw_ptr"])
    def _replay_kernel(hist_ptr, state_ptr, n, k, limit, steps, draw_ptr, DEPTH: tl.constexpr, MODE: tl.constexpr,
                       LAST: tl.constexpr):
        """One program: the counts at the bracket's midpoints (suffix sums of the histogram, which is
        cleared), then up to ``steps`` bisection steps replayed from them as the host would make
        them: RedSync's band search (``MODE`` 0: stop at a count in ``[k, limit]``) or MSTopK's
        (``MODE`` 1: keep the last threshold with at most ``k`` and the last with more); the new
        bracket into the state. ``LAST``: the search's end (no band found; MSTopK's window, placed by
        the call's draw, an int64 in device memory)."""
        bins = tl.arange(0, 1 << DEPTH)
        h = tl.load(hist_ptr + bins)
        tl.store(hist_ptr + bins, tl.zeros_like(h))
        suffix = tl.cumsum(h, 0, reverse=True)
        count = tl.load(state_ptr + 0).to(tl.int64)
        mean = tl.load(state_ptr + 1) / n.to(tl.float64)
        top = tl.load(state_ptr + 2)
        floor = tl.load(state_ptr + 4)
        flags = tl.load(state_ptr + 5).to(tl.int32)
        lo = tl.load(state_ptr + 6)
        span = tl.load(state_ptr + 7) - lo
        thres1 = tl.load(state_ptr + 8)
        thres2 = tl.load(state_ptr + 9)
        count1 = tl.load(state_ptr + 10).to(tl.int64)
        count2 = tl.load(state_ptr + 11).to(tl.int64)
        found_t = tl.load(state_ptr + 13)
        found_c = tl.load(state_ptr + 12).to(tl.int64)
        done = (tl.load(state_ptr + 16) != 0.0).to(tl.int32)
        jl = 0
        jh = 1 << DEPTH
        step = 0
        while (step < steps) & (done == 0):
            mid = (jl + jh) // 2
            t = _bisection_threshold(mean, lo, span, top, mid, DEPTH)
            below = t < floor  # the candidates do not hold its count: at least all of them
            c = tl.where(below, count, tl.sum(tl.where(bins == mid, suffix, 0), 0).to(tl.int64))
            if below & (count <= limit):  # the exact count is needed, and only a pass over x has it
                flags = flags | 1
                done = 1
            elif MODE == 0:
                if c > limit:
                    jl = mid
                elif c < k:
                    jh = mid
                else:
                    found_t = t
                    found_c = c
                    done = 1
            else:
                if c > limit:
                    jl = mid
                    thres2 = t
                    count2 = c
                else:
                    jh = mid
                    thres1 = t
                    count1 = c
            step += 1
        tl.store(state_ptr + 6, lo + span * (tl.cast(jl, tl.float64) * (1.0 / (1 << DEPTH))))
        tl.store(state_ptr + 7, lo + span * (tl.cast(jh, tl.float64) * (1.0 / (1 << DEPTH))))
        if MODE == 0:
            tl.store(state_ptr + 13, found_t)
            tl.store(state_ptr + 12, found_c.to(tl.float64))
            if LAST:  # the steps ran out with no count in the band
                flags = tl.where(done == 0, flags | 2, flags)
                done = 1
        else:
            tl.store(state_ptr + 8, thres1)
            tl.store(state_ptr + 9, thres2)
            tl.store(state_ptr + 10, count1.to(tl.float64))
            tl.store(state_ptr + 11, count2.to(tl.float64))
            if LAST:
                missing = k - count1
                band = count2 - count1
                if thres2 < floor:  # the band reaches below the floor: its members were not gathered
                    flags = flags | 1
                if missing > band:  # no bracket (NaN input)
                    flags = flags | 8
                start = tl.load(draw_ptr) % tl.maximum(band - missing + 1, 1)
                tl.store(state_ptr + 14, start.to(tl.float64))
                tl.store(state_ptr + 15, (start + missing).to(tl.float64))
        tl.store(state_ptr + 5, flags.to(tl.float64))
        tl.store(state_ptr + 16, done.to(tl.float64))

    @triton.jit
    def _radix_width(state_ptr):
        """(the floor's float32 bits, the bit length of the span of the candidates' bit patterns)."""
        floor_bits = tl.load(state_ptr + 4).to(tl.float32).to(tl.int32, bitcast=True)
        top_bits = tl.load(state_ptr + 2).to(tl.float32).to(tl.int32, bitcast=True)
        span = (top_bits - floor_bits + 1).to(tl.float64)
        return floor_bits, ((span.to(tl.int64, bitcast=True) >> 52) - 1022).to(tl.int32)

    @triton.jit
    def _radix_prefix(state_ptr, hists_ptr, k, LEVEL: tl.constexpr):
        """(the lowest bit pattern of level ``LEVEL``'s range, its shift, the rank still sought in
        it, the range's width as a shift) from the histograms of the levels before."""
        base, width = _radix_width(state_ptr)
        rank = k
        for level in tl.static_range(LEVEL):
            shift = tl.maximum(width - 9 * (level + 1), 0)
            b, above = _pick_512(hists_ptr + 512 + 512 * level, rank)
            base += tl.maximum(b, 0) << shift
            rank -= above
        return base, tl.maximum(width - 9 * (LEVEL + 1), 0), rank, tl.maximum(width - 9 * LEVEL, 0)

    @triton.jit
    def _pick_512(hist_ptr, rank):
        bins = tl.arange(0, 512)
        h = tl.load(hist_ptr + bins)
        suffix = tl.cumsum(h, 0, reverse=True)
        b = tl.max(tl.where(suffix >= rank, bins, -1), 0)
        return b, tl.sum(tl.where(bins > b, h, 0), 0)

    @triton.jit(do_not_specialize=["k", "capacity"], do_not_specialize_on_alignment=["state_ptr", "hists_ptr"])
    def _radix_count_kernel(val_ptr, state_ptr, hists_ptr, k, capacity, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
        """Level ``LEVEL`` of the radix select of the candidates' k-th largest bit pattern: the
        histogram of the next 9 bits of those in the range the levels before chose."""
        count = tl.minimum(tl.load(state_ptr + 0).to(tl.int64), capacity)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < count
        bits = tl.load(val_ptr + offs, mask=ok, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        base, shift, _, width = _radix_prefix(state_ptr, hists_ptr, k, LEVEL)
        rel = bits.to(tl.int64) - base
        inside = ok & (rel >= 0) & (rel < (tl.full([BLOCK], 1, tl.int64) << width))
        bins = tl.where(inside, rel >> shift, 0).to(tl.int32)
        h = tl.histogram(bins, 512, mask=inside)
        tl.atomic_add(hists_ptr + 512 + 512 * LEVEL + tl.arange(0, 512), h, mask=h > 0, sem="relaxed")

    @triton.jit
    def _topk_key(state_ptr, hists_ptr, k, LEVELS: tl.constexpr):
        """(the k-th largest candidate's bit pattern, how many candidates with that pattern the
        top-k takes, whether the levels resolved every bit)."""
        base, shift, rank, _ = _radix_prefix(state_ptr, hists_ptr, k, LEVELS - 1)
        b, above = _pick_512(hists_ptr + 512 + 512 * (LEVELS - 1), rank)
        return base + (tl.maximum(b, 0) << shift), rank - above, (shift != 0) | (b < 0)

    @triton.jit
    def _classes(v, t1, t2, key, MODE: tl.constexpr):
        """(taken outright, taken by rank among its class): ``v >= t1`` (MODE 0); the top-k's bits
        above the k-th's and equal to it (MODE 1); MSTopK's ``v >= t1`` and its band ``[t2, t1)``."""
        if MODE == 0:
            strict = v >= t1
            tied = v != v
        elif MODE == 1:
            bits = v.to(tl.int32, bitcast=True)
            strict = bits > key
            tied = bits == key
        else:
            strict = v >= t1
            tied = (v >= t2) & (v < t1)
        return strict, tied

    @triton.jit(do_not_specialize=["blocks", "k", "capacity"],
                do_not_specialize_on_alignment=["state_ptr", "hists_ptr", "counts_ptr"])
    def _select_count_kernel(val_ptr, state_ptr, hists_ptr, counts_ptr, blocks, k, capacity, MODE: tl.constexpr,
                             LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        """Per block of candidates, how many the selection takes outright and how many it ranks
        (ties, MSTopK's band); program 0 leaves the selection's parameters in the state."""
        pid = tl.program_id(0)
        count = tl.minimum(tl.load(state_ptr + 0).to(tl.int64), capacity)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < count
        v = tl.load(val_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        key = 0
        need = 0
        unresolved = 0
        if MODE == 1:
            key, need, unresolved = _topk_key(state_ptr, hists_ptr, k, LEVELS)
        t1 = tl.load(state_ptr + 13).to(tl.float32)
        if MODE == 2:
            t1 = tl.load(state_ptr + 8).to(tl.float32)
        t2 = tl.load(state_ptr + 9).to(tl.float32)
        strict, tied = _classes(v, t1, t2, key, MODE)
        tl.store(counts_ptr + pid, tl.sum((strict & ok).to(tl.int32), 0))
        tl.store(counts_ptr + blocks + pid, tl.sum((tied & ok).to(tl.int32), 0))
        if pid == 0:
            if MODE == 0:
                tl.store(state_ptr + 14, 0.0)
                tl.store(state_ptr + 15, 0.0)
            if MODE == 1:
                flags = tl.load(state_ptr + 5).to(tl.int32)
                if unresolved:
                    flags = flags | 4
                if count < k:
                    flags = flags | 16
                tl.store(state_ptr + 5, flags.to(tl.float64))
                tl.store(state_ptr + 13, tl.cast(key, tl.float64))
                tl.store(state_ptr + 14, 0.0)
                tl.store(state_ptr + 15, tl.cast(need, tl.float64))

    @triton.jit(do_not_specialize=["blocks", "capacity", "out_capacity"],
                do_not_specialize_on_alignment=["state_ptr", "hists_ptr", "counts_ptr", "val_ptr", "out_idx_ptr",
                                                "out_val_ptr"])
    def _select_write_kernel(idx_ptr, val_ptr, state_ptr, hists_ptr, counts_ptr, blocks, capacity, out_idx_ptr,
                             out_val_ptr, out_capacity, MODE: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr):
        """Per block of candidates, its picks written in index order at the prefix of the counts of
        the blocks before (a ranked member is taken when its rank lies in the state's
        ``[low_rank, high_rank)``); program 0 writes the selection's size into the state and clears
        the histograms for the next call."""
        pid = tl.program_id(0)
        lanes = tl.arange(0, SCAN)
        strict_before = tl.zeros([SCAN], dtype=tl.int64)
        tied_before = tl.zeros([SCAN], dtype=tl.int64)
        start = 0
        while start < pid:  # (while loops: Triton's interpreter takes no tensor as a range bound)
            o = start + lanes
            strict_before += tl.load(counts_ptr + o, mask=o < pid, other=0)
            tied_before += tl.load(counts_ptr + blocks + o, mask=o < pid, other=0)
            start += SCAN
        strict_prefix = tl.sum(strict_before, 0)
        tied_prefix = tl.sum(tied_before, 0)
        low_rank = tl.load(state_ptr + 14).to(tl.int64)
        high_rank = tl.load(state_ptr + 15).to(tl.int64)
        count = tl.minimum(tl.load(state_ptr + 0).to(tl.int64), capacity)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < count
        v = tl.load(val_ptr + offs, mask=ok, other=0.0)
        vf = v.to(tl.float32)
        t1 = tl.load(state_ptr + 13).to(tl.float32)
        if MODE == 2:
            t1 = tl.load(state_ptr + 8).to(tl.float32)
        t2 = tl.load(state_ptr + 9).to(tl.float32)
        key = tl.load(state_ptr + 13).to(tl.int32)
        strict, tied = _classes(vf, t1, t2, key, MODE)
        strict = strict & ok
        tied = tied & ok
        rank = tied_prefix + tl.cumsum(tied.to(tl.int32), 0).to(tl.int64) - 1
        take = strict | (tied & (rank >= low_rank) & (rank < high_rank))
        first = strict_prefix + tl.minimum(tl.maximum(tied_prefix, low_rank), high_rank) - low_rank
        position = first + tl.cumsum(take.to(tl.int32), 0).to(tl.int64) - 1
        keep = take & (position < out_capacity)
        tl.store(out_idx_ptr + position, tl.load(idx_ptr + offs, mask=keep), mask=keep)
        tl.store(out_val_ptr + position, v, mask=keep)
        if pid == 0:
            strict_all = tl.zeros([SCAN], dtype=tl.int64)
            tied_all = tl.zeros([SCAN], dtype=tl.int64)
            start = 0
            while start < blocks:
                o = start + lanes
                strict_all += tl.load(counts_ptr + o, mask=o < blocks, other=0)
                tied_all += tl.load(counts_ptr + blocks + o, mask=o < blocks, other=0)
                start += SCAN
            taken = tl.minimum(tl.maximum(tl.sum(tied_all, 0), low_rank), high_rank) - low_rank
            tl.store(state_ptr + 12, (tl.sum(strict_all, 0) + taken).to(tl.float64))
            clear = tl.arange(0, 512)
            for part in tl.static_range(6):  # the sample's two histograms, the radix levels
                tl.store(hists_ptr + 512 * part + clear, tl.zeros([512], dtype=tl.int32))


_GRID = Launcher(_grid_count_kernel, enable_fp_fusion=False) if triton is not None else None
_REPLAY = Launcher(_replay_kernel, enable_fp_fusion=False) if triton is not None else None
_RADIX = Launcher(_radix_count_kernel) if triton is not None else None
_SELECT_COUNT = Launcher(_select_count_kernel) if triton is not None else None
_SELECT_WRITE = Launcher(_select_write_kernel) if triton is not None else None


def bisection_steps(eps: float) -> int:
    """The steps RedSync's band search makes at most: ``hi - lo`` halves from 1 until it is at most ``eps``."""
    steps, width = 0, 1.0
    while width > eps:
        width /= 2
        steps += 1
    return steps


def _gather(x: Tensor, buffers: Buffers, plan: SamplePlan | None, addend: Tensor | None, dest: Tensor | None,
            capacity: int) -> int:
    """Queue the sample (with a plan) and the pass: the candidates above the sampled floor (every
    element without a plan)."""
    if plan is None:
        return launch_gather(x, buffers, floor=0.0, capacity=x.numel(), addend=addend, dest=dest)
    buffers.prepare(x, max(1, -(-x.numel() // int(triton_scan.SHAPE["block"]))))
    launch_sample(x, buffers, plan.runs, plan.stride, plan.rank, addend)
    return launch_gather(x, buffers, rank=plan.rank, capacity=capacity, addend=addend, dest=dest)


def _select(buffers: Buffers, k: int, capacity: int, out_capacity: int, mode: int, levels: int = 3
            ) -> tuple[Tensor, Tensor]:
    """Queue the selection's two kernels over the candidates: its picks in index order."""
    assert _SELECT_COUNT is not None and _SELECT_WRITE is not None
    blocks = max(1, -(-capacity // _BLOCK))
    counts = buffers.counts_buffer(blocks)
    out_idx = torch.empty(out_capacity, dtype=torch.int64, device=buffers.device)
    out_val = torch.empty(out_capacity, dtype=buffers.val.dtype, device=buffers.device)
    _SELECT_COUNT(blocks, buffers.val, buffers.state, buffers.hists, counts, blocks, k, capacity, warps=4,
                  MODE=mode, LEVELS=levels, BLOCK=_BLOCK)
    _SELECT_WRITE(blocks, buffers.idx, buffers.val, buffers.state, buffers.hists, counts, blocks, capacity, out_idx,
                  out_val, out_capacity, warps=4, MODE=mode, BLOCK=_BLOCK, SCAN=1024)
    return out_idx, out_val


def _capacity(n: int, plan: SamplePlan | None, buffers: Buffers) -> int:
    """Room for the candidates: every element without a sample; else 1.5 times what the sample leads
    to expect, or what an earlier call at these sizes needed (the same from call to call, so that the
    pipeline's CUDA graph is replayed)."""
    if plan is None:
        return n
    return min(n, max(plan.expected + plan.expected // 2 + 4096, buffers.needed.get((n, plan), 0)))


def _queued(buffers: Buffers, key: tuple, queue: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, bool]:
    """``queue()``'s outputs (it queues a pipeline's kernels and returns its output tensors), and whether
    they are a CUDA graph's (the caller copies what it keeps: the next replay overwrites them).

    On a GPU the first call with a ``key`` (the inputs' addresses and every size) runs the kernels as
    they are (compiling them where needed), the second captures them into a CUDA graph, and every
    later one replays it: one launch for the host instead of one per kernel. ``SPARSECOMM_CUDA_GRAPHS=0``
    (or a capture that fails) keeps the kernels launched one by one."""
    if not GRAPHS or buffers.device is None or buffers.device.type != "cuda":
        return (*queue(), False)
    if buffers.dirty:  # a pipeline left midway: its histograms are cleared before the graph runs
        buffers.prepare_histograms()
    entry = buffers.graphs.get(key)
    if entry is not None:
        entry[0].replay()
        return (*entry[1], True)
    if key not in buffers.seen:
        buffers.seen.add(key)
        return (*queue(), False)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = queue()
    except Exception as err:  # noqa: BLE001  (any failure of the capture: the kernels then run one by one)
        _disable_graphs(err)
        buffers.forget_graphs()
        buffers.dirty = True
        buffers.prepare_histograms()
        return (*queue(), False)
    buffers.keep_graph(key, graph, outputs)
    graph.replay()
    return (*outputs, True)


def _disable_graphs(err: Exception) -> None:
    global GRAPHS
    GRAPHS = False
    log.warning("the device selections' CUDA graphs are off (capture failed: %s); kernels are launched one by one",
                err)


def _pipeline(x: Tensor, k: int, buffers: Buffers, plan: SamplePlan | None, addend: Tensor | None,
              dest: Tensor | None, *, search: Callable[[int], None], mode: int, out_capacity: int, levels: int,
              key: tuple, check_finite: bool, name: str) -> tuple[np.ndarray, Tensor, Tensor]:
    """The sample, the pass, ``search(capacity)`` (the search's kernels), the selection, then the one
    synchronization: (the state on the host, the picks' indices, the sum ``x + addend`` where the pass
    wrote it, else ``x``). More candidates than the buffers held: gathered again (of the sum) with
    room for them. Non-finite input raises (``check_finite``) or falls back."""
    summed = x if addend is None else (x if dest is None else dest)
    n = x.numel()
    capacity = _capacity(n, plan, buffers)
    for _attempt in range(2):
        def queue(x: Tensor = x, addend: Tensor | None = addend, dest: Tensor | None = dest,
                  capacity: int = capacity) -> tuple[Tensor, Tensor]:
            used = _gather(x, buffers, plan, addend, dest, capacity)
            search(used)
            return _select(buffers, k, used, out_capacity, mode, levels)
        address = tuple(0 if t is None else t.data_ptr() for t in (x, addend, dest))
        shape = tuple(triton_scan.SHAPE.values())
        out_idx, _, replayed = _queued(buffers, (*key, n, k, capacity, plan, address, shape), queue)
        state = finish(buffers)
        larger = _checked(state, buffers, summed, capacity, check_finite, name)
        if not larger:
            return state, out_idx.clone() if replayed else out_idx, summed
        buffers.needed[(n, plan)] = larger + larger // 4
        capacity, x, addend, dest = larger, summed, None, None  # the sum is written: gather it again
    raise Fallback("more candidates than the buffers held", summed)


def _checked(state: np.ndarray, buffers: Buffers, summed: Tensor, capacity: int, check_finite: bool, name: str
             ) -> int:
    """The common outcomes of a finished device selection: non-finite input (raises with
    ``check_finite``, else :class:`Fallback`), more candidates than were kept (returned: the caller
    gathers again with room for them); else 0."""
    from .base import assert_finite

    if state[STATE["nonfinite"]] > 0:
        buffers.dirty = True
        if check_finite:
            assert_finite(summed, name)
        raise Fallback("non-finite input", summed)
    count = int(state[STATE["count"]])
    buffers.last_count = count
    if count > capacity:
        buffers.dirty = True
        return count
    return 0


def exact_topk(x: Tensor, k: int, buffers: Buffers, plan: SamplePlan | None, *, addend: Tensor | None = None,
               dest: Tensor | None = None, check_finite: bool = True, name: str = "exact_topk") -> Tensor:
    """The ``k`` largest ``|x|`` (of ``x + addend``, written to ``dest``, default ``x``), in increasing
    index order, ties with the k-th largest taken lowest index first (the CPU's rule): the sample,
    the pass, 3 radix levels over the candidates (4 without a sample: every element is one), the
    selection; one synchronization. Raises :class:`Fallback` where the device path did not decide."""
    assert _RADIX is not None
    levels = 3 if plan is not None else 4

    def search(capacity: int) -> None:
        assert _RADIX is not None
        for level in range(levels):
            _RADIX(max(1, -(-capacity // _BLOCK)), buffers.val, buffers.state, buffers.hists, k, capacity, warps=4,
                   LEVEL=level, BLOCK=_BLOCK)
    state, out_idx, summed = _pipeline(x, k, buffers, plan, addend, dest, search=search, mode=_MODE_TOPK,
                                       out_capacity=k, levels=levels, key=("topk",), check_finite=check_finite,
                                       name=name)
    _raise_flags(state, buffers, summed)
    return out_idx


def band_search(x: Tensor, k: int, eps: float, buffers: Buffers, plan: SamplePlan | None, *,
                addend: Tensor | None = None, dest: Tensor | None = None, check_finite: bool = True,
                name: str = "binary_search") -> tuple[Tensor, float | None]:
    """RedSync Algorithm 3's search (:func:`.search._band_search`) on the device: (the indices of
    ``|x| >= t``, in increasing order, ``t``), ``t`` the first visited threshold whose count lies in
    ``[k, 2k]``; where none does, (the exact top-k, ``None``), as on the CPU. ``plan``: the sample
    for a floor with more than ``2k`` elements above it."""
    assert _GRID is not None and _REPLAY is not None
    steps = bisection_steps(eps)

    def search(capacity: int) -> None:
        _bisect(buffers, x.numel(), capacity, k, 2 * k, steps, _BAND)
    state, out_idx, summed = _pipeline(x, k, buffers, plan, addend, dest, search=search, mode=_MODE_GE,
                                       out_capacity=2 * k, levels=3, key=("band", steps), check_finite=check_finite,
                                       name=name)
    flags = int(state[STATE["flags"]])
    if flags & FLAGS["no_band"] and not flags & ~FLAGS["no_band"]:  # as on the CPU: the exact top-k instead
        return exact_topk(summed, k, buffers, plan, check_finite=False, name=name), None
    _raise_flags(state, buffers, summed)
    return out_idx[:int(state[STATE["result"]])], float(state[STATE["threshold"]])


def mstopk(x: Tensor, k: int, samplings: int, draw: int, buffers: Buffers, plan: SamplePlan | None, *,
           addend: Tensor | None = None, dest: Tensor | None = None, check_finite: bool = True,
           name: str = "mstopk") -> Tensor:
    """MSTopK (Shi et al. Algorithm 1, :class:`.search.MSTopK`) on the device: ``samplings``
    bisection steps in counting passes of up to 15 steps each, then every candidate at or above
    ``thres1`` and the window of the band ``[thres2, thres1)`` that starts at
    ``draw % (band - missing + 1)``, in increasing index order (exactly ``k``)."""
    assert _GRID is not None and _REPLAY is not None
    buffers.set_draw(x, draw)

    def search(capacity: int) -> None:
        _bisect(buffers, x.numel(), capacity, k, k, samplings, _MSTOPK)
    state, out_idx, summed = _pipeline(x, k, buffers, plan, addend, dest, search=search, mode=_MODE_WINDOW,
                                       out_capacity=k, levels=3, key=("mstopk", samplings), check_finite=check_finite,
                                       name=name)
    _raise_flags(state, buffers, summed)
    return out_idx


def _raise_flags(state: np.ndarray, buffers: Buffers, summed: Tensor) -> None:
    flags = int(state[STATE["flags"]])
    if flags:
        buffers.dirty = True
        raise Fallback(_reason(flags), summed)


def _bisect(buffers: Buffers, n: int, capacity: int, k: int, limit: int, steps: int, mode: int) -> None:
    """Queue ``steps`` bisection steps: counting passes of up to :data:`_DEPTH` steps, each followed
    by its replay."""
    assert _GRID is not None and _REPLAY is not None and buffers.val is not None
    blocks = max(1, -(-capacity // _BLOCK))
    hist = buffers.hists[HISTS["grid"]:]
    left = steps
    while True:
        depth = min(_DEPTH, max(left, 1))
        last = left <= _DEPTH
        _GRID(blocks, buffers.val, buffers.state, n, hist, capacity, warps=4, DEPTH=depth, BLOCK=_BLOCK)
        _REPLAY(1, hist, buffers.state, n, k, limit, min(left, depth), buffers.draw, warps=16 if depth > 12 else 4,
                DEPTH=depth, MODE=mode, LAST=last)
        left -= depth
        if last:
            return


def _reason(flags: int) -> str:
    names = [name for name, bit in FLAGS.items() if flags & bit]
    return "device search: " + ", ".join(names)


def sample_expected(n: int, runs: int, rank: int) -> int:
    """Candidates expected above a floor at the sample's ``rank``-th largest of ``runs`` runs."""
    return math.ceil(rank * n / max(1, runs * triton_scan.SAMPLE_RUN))
