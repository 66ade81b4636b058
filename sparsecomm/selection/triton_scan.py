"""The selectors' pass over the gradient on a GPU: Triton kernels that read ``x`` once.

The CPU path reads ``x`` once with the C kernel; on CUDA the same contract is met here (see
:mod:`sparsecomm.selection.scan` for how the selectors use it, :mod:`.triton_select` for the
threshold searches built on it):

* :func:`launch_gather`, the *pass*: one read of ``x`` (and, fused, of an ``addend``, writing
  ``dest = x + addend`` once: error feedback's ``acc = residual + grad``) giving each program's
  ``sum |x|`` (float64), ``max |x|``, NaN/Inf count and the candidates ``|x| >= floor`` (indices and
  magnitudes), written at a slot the program reserves with one atomic addition; then the *order*
  kernel, which copies every program's candidates to their place in increasing index order (a
  prefix of the programs' counts, summed by each of its programs) and reduces the programs' figures
  in a fixed order, so that the result is the same on every run. The candidates are a small share
  of ``x``: the order kernel moves a few percent of a pass.
* The floor is a number, or, for the searches, placed on the device from a strided sample of
  ``|x|`` (:func:`launch_sample`: the sample's exponent histogram, then a histogram of the mantissa's
  top 8 bits within the chosen octave; every program of the pass reads the floor off the two
  histograms), so that no host round trip sits between the sample and the pass.
* :func:`finish` brings the figures to the host: the call's one synchronization.
* :func:`counts_ge` -- the exact counts ``#{v >= t_j}`` at many thresholds at once, from values
  sorted by magnitude (the host-driven searches' fallback).

Comparisons are made in the input's dtype with the threshold rounded to it, exactly as the C kernel
and torch's ``ge`` do on the CPU, so counts and index sets are the same on both devices.

Triton ships with CUDA builds of PyTorch. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors
(slowly): the test suite uses it where Triton is installed, so the kernels are checked without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..transport.triton_launch import Launcher, interpreted

__all__ = ["available", "installed", "interpreted", "scan_ge", "counts_ge", "launch_gather", "launch_sample",
           "finish", "take_and_clear", "Buffers", "SHAPE", "STATE", "FLAGS"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: the torch passes are used instead
    triton = None
    tl = None

#: the launch shape: elements per program of the pass, programs' chunks copied per program of the
#: order kernel, sample runs per program of the sample kernels, and warps of each
SHAPE: dict[str, int] = {"block": 2048, "pass_warps": 8, "group": 64, "order_warps": 8, "sample_runs": 256}
#: the smallest candidate buffer the pass is given before the count is known (elements)
_MIN_CAPACITY = 1 << 12
#: elements per sample run (whole 16-byte pieces: one sector holds two runs)
SAMPLE_RUN = 4

#: positions in the device state (float64) the pipelines share: the pass's figures, the floor, the
#: searches' bracket and thresholds, and the selection's count
STATE = {"count": 0, "sum": 1, "max": 2, "nonfinite": 3, "floor": 4, "flags": 5, "lo": 6, "hi": 7, "thres1": 8,
         "thres2": 9, "count1": 10, "count2": 11, "result": 12, "threshold": 13, "low_rank": 14, "high_rank": 15,
         "done": 16}
_STATE_SIZE = 32
#: what the device searches report in ``STATE["flags"]`` (bits): the host then takes another path
FLAGS = {"floor_high": 1, "no_band": 2, "unresolved": 4, "window": 8, "short": 16}
#: the int32 histograms: the sample's exponents and mantissas, the radix levels, the bisection grid
HISTS = {"exponent": 0, "mantissa": 256, "radix": 512, "grid": 512 + 4 * 512}
_GRID_DEPTH_MAX = 15
_HISTS_SIZE = HISTS["grid"] + (1 << _GRID_DEPTH_MAX)


def installed() -> bool:
    """Whether Triton can be imported here."""
    return triton is not None


def available(x: Tensor, *, on_cpu: bool = False) -> bool:
    """Whether the Triton kernels can scan ``x``: Triton is installed, and ``x`` is a contiguous
    float32/float16/bfloat16 CUDA tensor, or (``on_cpu``, under the interpreter) a CPU tensor."""
    if triton is None or not x.is_contiguous() or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False  # float64 stays on torch's passes (a Triton float scalar argument is float32)
    return x.is_cuda or (on_cpu and interpreted() and x.device.type == "cpu")


if triton is not None:

    @triton.jit
    def _pick(hist_ptr, BINS: tl.constexpr, rank):
        """(the largest bin ``b`` of the int32 histogram with at least ``rank`` elements in bins
        ``>= b``, the elements in bins ``> b``); ``(-1, total)`` when the histogram holds fewer."""
        bins = tl.arange(0, BINS)
        h = tl.load(hist_ptr + bins)
        suffix = tl.cumsum(h, 0, reverse=True)
        b = tl.max(tl.where(suffix >= rank, bins, -1), 0)
        return b, tl.sum(tl.where(bins > b, h, 0), 0)

    @triton.jit
    def _sampled_floor(hists_ptr, rank):
        """The floor read off the sample's histograms: the lower edge of the 1/256-octave bin that
        holds the sample's ``rank``-th largest magnitude (0 when the sample is smaller)."""
        e, above = _pick(hists_ptr, 256, rank)
        m, _ = _pick(hists_ptr + 256, 256, rank - above)
        bits = (tl.maximum(e, 0) << 23) | (tl.maximum(m, 0) << 15)
        return tl.where(e >= 0, bits.to(tl.float32, bitcast=True), 0.0)

    @triton.jit(do_not_specialize=["runs", "stride"], do_not_specialize_on_alignment=["addend_ptr", "sample_ptr",
                                                                                   "hists_ptr"])
    def _sample_kernel(x_ptr, addend_ptr, runs, stride, sample_ptr, hists_ptr, RUNS: tl.constexpr,
                       RUN: tl.constexpr, ADD: tl.constexpr):
        """``|x + addend|`` at the ``RUN`` elements from ``r * stride`` on, for this program's
        ``RUNS`` runs ``r < runs``, into the sample; their float32 exponents into the histogram."""
        pid = tl.program_id(0)
        r = pid * RUNS + tl.arange(0, RUNS)
        j = tl.arange(0, RUN)
        ok = (r < runs)[:, None] & (j < RUN)[None, :]
        offs = r.to(tl.int64)[:, None] * stride + j[None, :]
        v = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if ADD:
            v += tl.load(addend_ptr + offs, mask=ok, other=0.0)
        a = tl.abs(v).to(tl.float32)
        tl.store(sample_ptr + r[:, None] * RUN + j[None, :], a, mask=ok)
        e = tl.reshape(a.to(tl.int32, bitcast=True) >> 23, [RUNS * RUN])
        h = tl.histogram(e, 256, mask=tl.reshape(ok, [RUNS * RUN]))
        tl.atomic_add(hists_ptr + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")

    @triton.jit(do_not_specialize=["size", "rank"], do_not_specialize_on_alignment=["hists_ptr"])
    def _sample_fine_kernel(sample_ptr, size, hists_ptr, rank, TILE: tl.constexpr):
        """The top 8 mantissa bits of this program's sample elements in the octave that holds the
        sample's ``rank``-th largest, into the second histogram."""
        pid = tl.program_id(0)
        offs = pid * TILE + tl.arange(0, TILE)
        bits = tl.load(sample_ptr + offs, mask=offs < size, other=0.0).to(tl.int32, bitcast=True)
        e, _ = _pick(hists_ptr, 256, rank)
        h = tl.histogram((bits >> 15) & 255, 256, mask=(offs < size) & ((bits >> 23) == e))
        tl.atomic_add(hists_ptr + 256 + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")

    @triton.jit(do_not_specialize=["n", "floor", "rank", "capacity", "programs"],
                do_not_specialize_on_alignment=["addend_ptr", "dest_ptr", "hists_ptr", "idx_ptr", "val_ptr",
                                                "chunks_ptr", "partials_ptr", "slots_ptr"])
    def _pass_kernel(x_ptr, addend_ptr, dest_ptr, n, floor, hists_ptr, rank, idx_ptr, val_ptr, capacity,
                     chunks_ptr, partials_ptr, slots_ptr, programs, BLOCK: tl.constexpr, ADD: tl.constexpr,
                     SAMPLED: tl.constexpr, GATHER: tl.constexpr):
        """One read of this program's ``BLOCK`` elements of ``x`` (with ``ADD``, of ``x + addend``,
        written to ``dest``): its figures (``partials[q * programs + pid]``: sum |x| in float64,
        max |x|, the candidates, the NaN/Inf elements) and, with ``GATHER``, its candidates
        ``|x| >= floor`` in index order from a slot reserved by one atomic addition (those below
        ``capacity``), the slot and the count in ``chunks``. ``SAMPLED``: the floor is read off the
        sample's histograms (``rank``), not ``floor``."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        v = tl.load(x_ptr + offs, mask=inside, other=0.0)
        if ADD:
            v = v + tl.load(addend_ptr + offs, mask=inside, other=0.0)
            tl.store(dest_ptr + offs, v, mask=inside)
        a = tl.abs(v)
        af = a.to(tl.float32)
        if SAMPLED:
            lim = _sampled_floor(hists_ptr, rank)
        else:
            lim = floor
        bad = ((af != af) | (af > 3.4028234663852886e38)) & inside
        hit = (af >= lim) & inside
        count = tl.sum(hit.to(tl.int32), 0)
        tl.store(partials_ptr + pid, tl.sum(af.to(tl.float64), 0))
        tl.store(partials_ptr + programs + pid, tl.max(af, 0).to(tl.float64))
        tl.store(partials_ptr + 2 * programs + pid, count.to(tl.float64))
        tl.store(partials_ptr + 3 * programs + pid, tl.sum(bad.to(tl.int32), 0).to(tl.float64))
        if GATHER:
            slot = tl.atomic_add(slots_ptr, count.to(tl.int64), sem="relaxed")
            position = slot + tl.cumsum(hit.to(tl.int32), 0).to(tl.int64) - 1
            keep = hit & (position < capacity)
            tl.store(idx_ptr + position, offs, mask=keep)
            tl.store(val_ptr + position, a, mask=keep)
            tl.store(chunks_ptr + pid, slot)
            tl.store(chunks_ptr + programs + pid, count.to(tl.int64))

    @triton.jit(do_not_specialize=["programs", "capacity", "floor", "rank"],
                do_not_specialize_on_alignment=["partials_ptr", "slots_ptr", "state_ptr", "hists_ptr", "src_idx_ptr",
                                                "src_val_ptr", "dst_idx_ptr", "dst_val_ptr"])
    def _order_kernel(chunks_ptr, programs, src_idx_ptr, src_val_ptr, dst_idx_ptr, dst_val_ptr, capacity,
                      partials_ptr, slots_ptr, state_ptr, floor, hists_ptr, rank, GROUP: tl.constexpr,
                      TILE: tl.constexpr, SCAN: tl.constexpr, REDUCE: tl.constexpr, SAMPLED: tl.constexpr,
                      GATHER: tl.constexpr):
        """Per program, ``GROUP`` of the pass's programs: their candidates copied to their place in
        index order (the prefix of the counts of the programs before, summed here; the group's
        chunks side by side, ``TILE`` elements of each a round). Program 0 also reduces
        the pass's figures in a fixed order into the state (count, sum, max, NaN/Inf, floor) and
        frees the slots for the next pass."""
        g = tl.program_id(0)
        first = g * GROUP
        if GATHER:
            lanes = tl.arange(0, SCAN)
            before = tl.zeros([SCAN], dtype=tl.int64)
            start = 0
            while start < first:  # (while loops: Triton's interpreter takes no tensor as a range bound)
                offs = start + lanes
                before += tl.load(chunks_ptr + programs + offs, mask=offs < first, other=0)
                start += SCAN
            prefix = tl.sum(before, 0)
            # the group's chunks side by side: row j copies program first + j's candidates, at the
            # prefix of the counts before it, TILE a round
            rows = first + tl.arange(0, GROUP)
            real = rows < programs
            slots = tl.load(chunks_ptr + rows, mask=real, other=0)
            counts = tl.load(chunks_ptr + programs + rows, mask=real, other=0)
            starts = prefix + tl.cumsum(counts, 0) - counts
            longest = tl.max(counts, 0)
            copy = tl.arange(0, TILE)
            done = 0
            while done < longest:
                o = done + copy
                ok = (o[None, :] < counts[:, None]) & (slots[:, None] + o[None, :] < capacity) \
                    & (starts[:, None] + o[None, :] < capacity)
                src = slots[:, None] + o[None, :]
                dst = starts[:, None] + o[None, :]
                tl.store(dst_idx_ptr + dst, tl.load(src_idx_ptr + src, mask=ok), mask=ok)
                tl.store(dst_val_ptr + dst, tl.load(src_val_ptr + src, mask=ok), mask=ok)
                done += TILE
        if g == 0:
            part = tl.arange(0, REDUCE)
            total = tl.zeros([REDUCE], dtype=tl.float64)
            top = tl.zeros([REDUCE], dtype=tl.float64)
            hits = tl.zeros([REDUCE], dtype=tl.float64)
            bad = tl.zeros([REDUCE], dtype=tl.float64)
            start = 0
            while start < programs:
                offs = start + part
                ok = offs < programs
                total += tl.load(partials_ptr + offs, mask=ok, other=0.0)
                top = tl.maximum(top, tl.load(partials_ptr + programs + offs, mask=ok, other=0.0))
                hits += tl.load(partials_ptr + 2 * programs + offs, mask=ok, other=0.0)
                bad += tl.load(partials_ptr + 3 * programs + offs, mask=ok, other=0.0)
                start += REDUCE
            tl.store(state_ptr + 0, tl.sum(hits, 0))
            tl.store(state_ptr + 1, tl.sum(total, 0))
            tl.store(state_ptr + 2, tl.max(top, 0))
            tl.store(state_ptr + 3, tl.sum(bad, 0))
            if SAMPLED:
                tl.store(state_ptr + 4, _sampled_floor(hists_ptr, rank).to(tl.float64))
            else:
                tl.store(state_ptr + 4, tl.cast(floor, tl.float64))
            # the searches' starting point (:mod:`.triton_select`): no flag, the bracket [0, 1], no
            # threshold on either side yet (MSTopK's thres1 = +inf, thres2 = 0 with every candidate)
            tl.store(state_ptr + 5, 0.0)
            tl.store(state_ptr + 6, 0.0)
            tl.store(state_ptr + 7, 1.0)
            tl.store(state_ptr + 8, float("inf"))
            tl.store(state_ptr + 9, 0.0)
            tl.store(state_ptr + 10, 0.0)
            tl.store(state_ptr + 11, tl.sum(hits, 0))
            tl.store(state_ptr + 12, 0.0)
            tl.store(state_ptr + 16, 0.0)
            tl.store(slots_ptr, 0)


    @triton.jit(do_not_specialize=["m", "n"], do_not_specialize_on_alignment=["x_ptr", "out_ptr"])
    def _take_clear_kernel(idx_ptr, x_ptr, out_ptr, m, n, BLOCK: tl.constexpr):
        """``out[j] = x[idx[j]]``, then ``x[idx[j]] = 0``, for this program's ``BLOCK`` indices
        (distinct; one outside ``[0, n)`` reads 0 and writes nothing)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < m
        i = tl.load(idx_ptr + offs, mask=ok, other=0).to(tl.int64)
        inside = ok & (i >= 0) & (i < n)
        tl.store(out_ptr + offs, tl.load(x_ptr + i, mask=inside, other=0.0), mask=ok)
        tl.store(x_ptr + i, tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty), mask=inside)


#: an empty tensor: a buffer not allocated yet
_NONE = torch.empty(0)


class Buffers:
    """Device buffers of the pass and the searches (one set per selector scratch, reused across calls).

    ``state`` (float64): the figures and the searches' results (:data:`STATE`); ``hists`` (int32): the
    histograms (:data:`HISTS`), zero between calls: each pipeline's last kernel clears what it used,
    and a pipeline the host left midway marks them ``dirty`` (zeroed before the next one);
    ``partials``/``chunks``: the pass's per-program figures and candidate slots; the candidates,
    unordered as the pass writes them and in index order; the sample; a pinned copy of the state."""

    #: CUDA graphs kept per buffer set (the oldest is dropped past this)
    GRAPHS_KEPT = 8

    def __init__(self) -> None:
        self.device: torch.device | None = None  # None until the first call fits the buffers to one
        self.state = self.hists = self.slots = self.sample = self.host = self.draw = self.draw_host = _NONE
        self.partials = self.chunks = self.block_counts = _NONE
        self.loose_idx = self.loose_val = self.idx = self.val = _NONE
        self.dirty = True
        #: candidates of the previous gathering call (sizes the next output)
        self.last_count = 0
        #: (n, sample plan) -> candidates a call needed room for (grown when one overflowed)
        self.needed: dict = {}
        #: the pipelines' CUDA graphs: key -> (graph, its output tensors); the keys run once already
        self.graphs: dict = {}
        self.seen: set = set()

    def prepare(self, x: Tensor, programs: int) -> None:
        """Fit the fixed buffers to ``x``'s device and ``programs`` programs of the pass; zero the
        histograms if a pipeline left them dirty."""
        if self.device != x.device:
            self.forget_graphs()
            self.device = x.device
            self.state = torch.zeros(_STATE_SIZE, dtype=torch.float64, device=x.device)
            self.hists = torch.zeros(_HISTS_SIZE, dtype=torch.int32, device=x.device)
            self.slots = torch.zeros(1, dtype=torch.int64, device=x.device)
            self.draw = torch.zeros(1, dtype=torch.int64, device=x.device)
            self.sample = self.partials = self.chunks = self.block_counts = _NONE
            self.loose_idx = self.loose_val = self.idx = self.val = _NONE
            self.host = torch.empty(_STATE_SIZE, dtype=torch.float64, pin_memory=x.is_cuda)
            self.draw_host = torch.empty(1, dtype=torch.int64, pin_memory=x.is_cuda)
            self.dirty = False
        if self.partials.numel() < 4 * programs:
            self.forget_graphs()
            self.partials = torch.empty(4 * programs, dtype=torch.float64, device=x.device)
            self.chunks = torch.empty(2 * programs, dtype=torch.int64, device=x.device)
        self.prepare_histograms()

    def prepare_histograms(self) -> None:
        """Zero the histograms and the slot counter if a pipeline left them dirty."""
        if self.dirty and self.device is not None:
            self.hists.zero_()
            self.slots.zero_()
            self.dirty = False

    def candidates(self, capacity: int, dtype: torch.dtype, ordered: bool = True) -> None:
        """Candidate buffers of at least ``capacity`` elements of ``dtype`` (unordered, and with
        ``ordered`` the ordered ones the pipelines reuse)."""
        if self.loose_idx.numel() < capacity or self.loose_val.dtype != dtype:
            self.forget_graphs()
            size = max(capacity, _MIN_CAPACITY)
            self.loose_idx = torch.empty(size, dtype=torch.int64, device=self.device)
            self.loose_val = torch.empty(size, dtype=dtype, device=self.device)
        if ordered and (self.idx.numel() < capacity or self.val.dtype != dtype):
            self.forget_graphs()
            self.idx = torch.empty(max(capacity, _MIN_CAPACITY), dtype=torch.int64, device=self.device)
            self.val = torch.empty(max(capacity, _MIN_CAPACITY), dtype=dtype, device=self.device)

    def sample_buffer(self, size: int) -> Tensor:
        if self.sample.numel() < size:
            self.forget_graphs()
            self.sample = torch.empty(size, dtype=torch.float32, device=self.device)
        return self.sample

    def counts_buffer(self, blocks: int) -> Tensor:
        if self.block_counts.numel() < 2 * blocks:
            self.forget_graphs()
            self.block_counts = torch.empty(2 * blocks, dtype=torch.int32, device=self.device)
        return self.block_counts

    def set_draw(self, x: Tensor, draw: int) -> None:
        """The call's random draw (MSTopK's window) into device memory, where the graphs read it."""
        self.prepare(x, max(1, -(-x.numel() // int(SHAPE["block"]))))
        self.draw_host[0] = draw
        self.draw.copy_(self.draw_host, non_blocking=True)

    def keep_graph(self, key: tuple, graph: Any, outputs: tuple) -> None:
        if len(self.graphs) >= self.GRAPHS_KEPT:
            self.graphs.pop(next(iter(self.graphs)))
        self.graphs[key] = (graph, outputs)

    def forget_graphs(self) -> None:
        """Drop the CUDA graphs: they hold the addresses of buffers about to be replaced."""
        self.graphs.clear()
        self.seen.clear()


_SAMPLE = Launcher(_sample_kernel) if triton is not None else None
_SAMPLE_FINE = Launcher(_sample_fine_kernel) if triton is not None else None
_PASS = Launcher(_pass_kernel) if triton is not None else None
_ORDER = Launcher(_order_kernel) if triton is not None else None
_TAKE_CLEAR = Launcher(_take_clear_kernel) if triton is not None else None


def floor_in(dtype: torch.dtype, floor: float) -> float:
    """``floor`` rounded to ``dtype`` (as torch.ge and the C kernel compare), as a Python float."""
    if dtype == torch.float32:
        return float(np.float32(floor))
    if dtype == torch.float16:
        return float(np.float16(floor))
    return float(torch.tensor(floor, dtype=torch.float64).to(dtype).to(torch.float64))


def launch_sample(x: Tensor, buffers: Buffers, runs: int, stride: int, rank: int, addend: Tensor | None = None
                  ) -> None:
    """Queue the sample of ``|x|`` (``|x + addend|``) in ``runs`` runs of :data:`SAMPLE_RUN` elements
    ``stride`` apart and its two histograms, from which the pass reads the floor above the sample's
    ``rank``-th largest magnitude. ``x`` float32."""
    assert _SAMPLE is not None and _SAMPLE_FINE is not None, "Triton is not installed"
    size = runs * SAMPLE_RUN
    sample = buffers.sample_buffer(size)
    per = int(SHAPE["sample_runs"])
    _SAMPLE(-(-runs // per), x, x if addend is None else addend, runs, stride, sample, buffers.hists, warps=4,
            RUNS=per, RUN=SAMPLE_RUN, ADD=addend is not None)
    tile = per * SAMPLE_RUN
    _SAMPLE_FINE(-(-size // tile), sample, size, buffers.hists, rank, warps=4, TILE=tile)


def launch_gather(x: Tensor, buffers: Buffers, *, floor: float = 0.0, rank: int | None = None,
                  capacity: int = 0, addend: Tensor | None = None, dest: Tensor | None = None,
                  gather: bool = True, fresh: bool = False) -> int:
    """Queue the pass and the order kernel over ``x`` (with ``addend``: over ``x + addend``, written to
    ``dest``, by default ``x``): the state's figures and, with ``gather``, the candidates
    ``|x| >= floor`` in increasing index order in ``buffers.idx``/``buffers.val`` (the first
    ``capacity``; more are counted, not kept), new tensors with ``fresh`` (for a caller that keeps
    them). ``rank``: the floor comes from the sample's histograms (:func:`launch_sample` queued
    first), not ``floor``. Returns the capacity used."""
    assert _PASS is not None and _ORDER is not None, "Triton is not installed"
    n = x.numel()
    block = int(SHAPE["block"])
    programs = max(1, -(-n // block))
    buffers.prepare(x, programs)
    if gather:
        capacity = min(n, max(capacity, _MIN_CAPACITY))
        buffers.candidates(capacity, x.dtype, ordered=not fresh)
        if fresh:
            buffers.idx = torch.empty(capacity, dtype=torch.int64, device=x.device)
            buffers.val = torch.empty(capacity, dtype=x.dtype, device=x.device)
    idx, val = (buffers.loose_idx, buffers.loose_val) if gather else (buffers.state, buffers.state)
    sampled = rank is not None
    floor_arg = 0.0 if rank is not None else floor_in(x.dtype, floor)
    rank_arg = int(rank) if rank is not None else 0
    target = x if dest is None else dest
    _PASS(programs, x, x if addend is None else addend, target, n, floor_arg, buffers.hists, rank_arg, idx, val,
          capacity, buffers.chunks, buffers.partials, buffers.slots, programs, warps=int(SHAPE["pass_warps"]),
          BLOCK=block, ADD=addend is not None, SAMPLED=sampled, GATHER=gather)
    group = int(SHAPE["group"])
    dst_idx, dst_val = (buffers.idx, buffers.val) if gather else (buffers.state, buffers.state)
    _ORDER(-(-programs // group) if gather else 1, buffers.chunks, programs, idx, val, dst_idx, dst_val, capacity,
           buffers.partials, buffers.slots, buffers.state, floor_arg, buffers.hists, rank_arg,
           warps=int(SHAPE["order_warps"]), GROUP=group, TILE=32, SCAN=2048, REDUCE=1024, SAMPLED=sampled,
           GATHER=gather)
    return capacity


def finish(buffers: Buffers) -> np.ndarray:
    """The state on the host: the call's one synchronization (a copy through a pinned buffer and a
    wait on the stream on a GPU)."""
    state = buffers.state
    if not state.is_cuda:
        return state.numpy().copy()
    buffers.host.copy_(state, non_blocking=True)
    torch.cuda.current_stream(state.device).synchronize()
    return buffers.host.numpy().copy()


def scan_ge(x: Tensor, floor: float, buffers: Buffers, *, gather: bool = True, expected: int = 0,
            addend: Tensor | None = None, dest: Tensor | None = None
            ) -> tuple[int, float, float, Tensor | None, Tensor | None]:
    """``(count, sum |x|, max |x|, indices, magnitudes)`` of ``|x| >= floor``, indices increasing: one
    read of ``x`` (:func:`launch_gather`; with ``addend`` (float32), of ``x + addend``, written to
    ``dest``, default ``x``, and scanned), then one synchronization. The candidate buffer is sized
    before the count is known: at least ``expected`` (the caller's guess) and 1.5 times the previous
    call's count; a call with more candidates than that gathers again into an exact buffer (a second
    read, of the sum). ``gather=False`` counts only; indices and magnitudes are then ``None``."""
    capacity = max(expected, buffers.last_count + buffers.last_count // 2)
    capacity = launch_gather(x, buffers, floor=floor, capacity=capacity, gather=gather, fresh=True, addend=addend,
                             dest=dest)
    if addend is not None:
        x = x if dest is None else dest
    indices, values = buffers.idx, buffers.val
    state = finish(buffers)
    count, total, top = int(state[STATE["count"]]), float(state[STATE["sum"]]), float(state[STATE["max"]])
    if not gather:
        return count, total, top, None, None
    buffers.last_count = count
    if count > capacity:  # more candidates than the guess: gather again, into buffers of the exact size
        launch_gather(x, buffers, floor=floor, capacity=count, fresh=True)
        indices, values = buffers.idx, buffers.val
        finish(buffers)
    buffers.idx = buffers.val = _NONE  # the caller owns them now
    return count, total, top, indices[:count], values[:count]


def take_and_clear(x: Tensor, indices: Tensor) -> Tensor:
    """``x[indices]`` (a new tensor), then ``x[indices] = 0``, in one kernel (``indices`` distinct,
    int32 or int64, on ``x``'s device; ``x`` contiguous): the values a message takes out of
    ``acc = residual + grad``, leaving the residual."""
    assert _TAKE_CLEAR is not None, "Triton is not installed"
    out = torch.empty(indices.numel(), dtype=x.dtype, device=x.device)
    if indices.numel():
        _TAKE_CLEAR(-(-indices.numel() // 1024), indices, x, out, indices.numel(), x.numel(), warps=4, BLOCK=1024)
    return out


def counts_ge(ascending: Tensor, thresholds: np.ndarray) -> np.ndarray:
    """Exact ``#{v >= t}`` for every ``t`` of the float64 array ``thresholds`` (no NaN), given the
    values sorted in increasing order: one binary search per threshold on the values' device and one
    synchronization. The thresholds are rounded to the values' dtype first, as the comparisons on the
    CPU are.
    """
    if thresholds.size == 0:
        return np.zeros(0, dtype=np.int64)
    rounded = torch.from_numpy(np.ascontiguousarray(thresholds, dtype=np.float64)).to(ascending.dtype)
    first_at_least = torch.searchsorted(ascending, rounded.to(ascending.device, non_blocking=True), right=False)
    return ascending.numel() - first_at_least.cpu().numpy()
