"""The selectors' passes on a GPU: Triton kernels that read the gradient twice, with one host synchronization.

The CPU path reads ``x`` once with the C kernel; on CUDA the same contract is met by these kernels
(see :mod:`sparsecomm.selection.scan` for how the selectors use them):

* :func:`scan_ge` -- ``sum |x|`` (in float64, per program, then summed in a fixed order, so the
  result does not depend on scheduling), ``max |x|`` and the candidates ``|x| >= floor`` (indices
  and magnitudes, in increasing index order) in two reads of ``x`` and one host synchronization, at
  the end: a statistics kernel (the figures of each program and the count of each gather tile, 1024
  elements by default), a prefix sum of those counts on the device, and a gather kernel with one
  program per gather tile, which writes that tile's candidates at its prefix-sum offset (no
  atomics: the same result on every run).
  The three are queued back to back, so the host's launches overlap the GPU's work; the output is
  sized from the previous calls' counts, and a call that finds more candidates than fit gathers
  again into an exact buffer. (A single read with an atomic slot reservation per program was
  measured too: its output is unordered, and sorting it cost more than the second read.)
* :func:`counts_ge` -- the exact counts ``#{v >= t_j}`` at many thresholds at once, from the
  candidates sorted by magnitude (one binary search per threshold), so that a threshold bisection
  of depth ``L`` costs one launch and one host synchronization instead of ``L`` passes and syncs.

Comparisons are made in the input's dtype with the threshold rounded to it, exactly as the C kernel
and torch's ``ge`` do on the CPU, so counts and index sets are the same on both devices.

Triton ships with CUDA builds of PyTorch. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors
(slowly): the test suite uses it where Triton is installed, so the kernels are checked without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

__all__ = ["available", "installed", "interpreted", "scan_ge", "counts_ge", "SHAPE"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: the torch passes are used instead
    triton = None
    tl = None

#: elements per step of the statistics kernel's loop (its count is kept per gather tile, a divisor)
_TILE = 1024
#: the launch shape: tiles per program of the statistics kernel, elements per program of the gather
#: (a power of two up to the tile; the statistics count per such piece), warps per program of each
#: kernel, and whether the figures come to the host through a pinned buffer (``docs/gpu/tune_scan.py``
#: times the alternatives on a GPU)
SHAPE = {"tiles": 16, "gather_tile": 1024, "stats_warps": 4, "gather_warps": 4, "pinned": True}
#: the smallest output the gather is given before the count is known (elements)
_MIN_CAPACITY = 1 << 12


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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

    @triton.jit(do_not_specialize=["n", "floor", "programs"],
                do_not_specialize_on_alignment=["out_ptr", "tile_counts_ptr"])
    def _stats_kernel(x_ptr, n, floor, out_ptr, tile_counts_ptr, programs, TILE: tl.constexpr, TILES: tl.constexpr,
                      PIECE: tl.constexpr):
        """Per program p, into the float64 array out: out[p] = sum |x| (float64), out[programs + p] =
        max |x|, out[2 programs + p] = #{|x| >= floor}, over its chunk of x (one host copy reads all);
        and into the int32 array tile_counts, #{|x| >= floor} of each piece of PIECE elements (the
        gather's tile; a divisor of TILE) of its tiles."""
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * (TILE * TILES)
        lanes = tl.arange(0, TILE)
        total = tl.zeros([TILE], dtype=tl.float64)
        top = tl.zeros([TILE], dtype=tl.float32)
        hits = tl.zeros([TILE], dtype=tl.int32)
        for t in range(TILES):
            offs = start + t * TILE + lanes
            inside = offs < n
            a = tl.abs(tl.load(x_ptr + offs, mask=inside, other=0.0))
            total += a.to(tl.float64)
            top = tl.maximum(top, a.to(tl.float32))
            hit = ((a >= floor) & inside).to(tl.int32)
            pieces = tl.sum(tl.reshape(hit, [TILE // PIECE, PIECE]), axis=1)
            first = (pid * TILES + t) * (TILE // PIECE)
            tl.store(tile_counts_ptr + first + tl.arange(0, TILE // PIECE), pieces)
            hits += hit
        tl.store(out_ptr + pid, tl.sum(total, axis=0))
        tl.store(out_ptr + programs + pid, tl.max(top, axis=0).to(tl.float64))
        tl.store(out_ptr + 2 * programs + pid, tl.sum(hits, axis=0).to(tl.float64))

    @triton.jit(do_not_specialize=["n", "floor", "capacity"],
                do_not_specialize_on_alignment=["ends_ptr", "idx_ptr", "val_ptr"])
    def _gather_kernel(x_ptr, n, floor, ends_ptr, idx_ptr, val_ptr, capacity, TILE: tl.constexpr):
        """Per program, one tile of x: write the indices and magnitudes of its |x| >= floor, in order,
        from the slot ``ends[pid - 1]`` (``ends``: the inclusive prefix sum of the tiles' counts), those
        below ``capacity`` only. A tile without candidates is not read. (Loading every tile at once,
        beside the prefix sum, instead of after it was timed too: no faster, docs/gpu.md.)"""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = offs < n
        slot = tl.load(ends_ptr + pid - 1, mask=pid > 0, other=0)
        end = tl.load(ends_ptr + pid)
        if (end > slot) & (slot < capacity):
            a = tl.abs(tl.load(x_ptr + offs, mask=inside, other=0.0))
            hit = (a >= floor) & inside
            position = slot + (tl.cumsum(hit.to(tl.int32), axis=0) - 1).to(tl.int64)
            keep = hit & (position < capacity)
            tl.store(idx_ptr + position, offs, mask=keep)
            tl.store(val_ptr + position, a, mask=keep)


class _Launcher:
    """A Triton kernel compiled once per (device, dtype, 16-byte alignment of ``x``, warps, constexpr
    values) and then launched straight through its compiled handle, which takes the constexprs
    positionally: pass them as keywords in the kernel's own order.

    Triton's own ``kernel[grid](...)`` binds and specializes the arguments on every call, about 50
    microseconds of Python in Triton 3.6 (measured on an H100): more than the kernel itself on
    gradients of a few million elements. The kernels here are declared not to specialize on their
    integer arguments nor on the alignment of any pointer but ``x``, so one compiled kernel serves
    every call with the same key. Under the interpreter (``TRITON_INTERPRET=1``) the plain launch is used.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}

    def __call__(self, programs: int, x: Tensor, *args, warps: int, **constants: int) -> None:
        grid = (programs, 1, 1)
        if interpreted() or not x.is_cuda:
            self.kernel[grid](x, *args, **constants, num_warps=warps)
            return
        key = (x.device.index, x.dtype, x.data_ptr() % 16 == 0, warps, *constants.values())
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel.warmup(x, *args, **constants, num_warps=warps, grid=grid)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            self.compiled[key] = compiled
        compiled[grid](x, *args, *constants.values())


class _Buffers:
    """Per-scratch device buffers of the scan (reused across calls) and the size of its last output."""

    def __init__(self) -> None:
        self.figures: Tensor | None = None  # float64 [3 programs]: sums, maxima, counts
        self.tile_counts: Tensor | None = None  # int32 [pieces]: candidates per gather tile
        self.ends: Tensor | None = None  # int64 [pieces]: their inclusive prefix sum
        self.host: Tensor | None = None  # pinned float64 copy of the figures (CUDA only)
        self.last_count = 0  # candidates of the previous gathering call (sizes the next output)

    def fit(self, x: Tensor, programs: int, tiles: int) -> tuple[Tensor, Tensor, Tensor]:
        """The three device buffers for ``programs`` programs of the statistics and ``tiles`` gather
        tiles over ``x``'s device, grown when needed."""
        if (self.figures is None or self.tile_counts is None or self.ends is None or self.figures.device != x.device
                or self.figures.numel() < 3 * programs or self.tile_counts.numel() < tiles):
            self.figures = torch.empty(3 * programs, dtype=torch.float64, device=x.device)
            self.tile_counts = torch.empty(tiles, dtype=torch.int32, device=x.device)
            self.ends = torch.empty(tiles, dtype=torch.int64, device=x.device)
            self.host = None
        return self.figures[:3 * programs], self.tile_counts[:tiles], self.ends[:tiles]

    def to_host(self, figures: Tensor) -> np.ndarray:
        """The figures on the host (the call's one synchronization): through a pinned buffer and a
        wait on the stream where ``SHAPE["pinned"]`` and ``figures`` is on a GPU, else a plain copy."""
        if not (SHAPE["pinned"] and figures.is_cuda):
            return figures.cpu().numpy()
        if self.host is None or self.host.numel() < figures.numel():
            self.host = torch.empty(self.figures.numel() if self.figures is not None else figures.numel(),
                                    dtype=torch.float64, pin_memory=True)
        host = self.host[:figures.numel()]
        host.copy_(figures, non_blocking=True)
        torch.cuda.current_stream(figures.device).synchronize()
        return host.numpy()


_STATS = _Launcher(_stats_kernel) if triton is not None else None
_GATHER = _Launcher(_gather_kernel) if triton is not None else None


def _floor_in(dtype: torch.dtype, floor: float) -> float:
    """``floor`` rounded to ``dtype`` (as torch.ge and the C kernel compare), as a Python float."""
    if dtype == torch.float32:
        return float(np.float32(floor))
    if dtype == torch.float16:
        return float(np.float16(floor))
    return float(torch.tensor(floor, dtype=torch.float64).to(dtype).to(torch.float64))


def scan_ge(x: Tensor, floor: float, buffers: _Buffers, *, gather: bool = True, expected: int = 0
            ) -> tuple[int, float, float, Tensor | None, Tensor | None]:
    """``(count, sum |x|, max |x|, indices, magnitudes)`` of ``|x| >= floor``, indices increasing.

    The statistics kernel reads ``x`` for each program's figures and each gather tile's count; a
    prefix sum of those counts on the device gives every gather tile its first output slot; the gather kernel reads
    ``x`` again (the tiles holding a candidate) and writes the candidates there. All three are queued
    without waiting; the one synchronization, the copy of the per-program figures to the host, comes
    last and gives the three scalars. The output is sized before the count is known: at least
    ``expected`` (the caller's guess) and 1.5 times the previous call's count; a call with more
    candidates than that gathers again into an exact buffer (a third read). ``gather=False`` stops
    after the statistics (a count); indices and magnitudes are then ``None``.
    """
    assert _STATS is not None and _GATHER is not None, "Triton is not installed"
    n = x.numel()
    tiles_per_program = int(SHAPE["tiles"])
    programs = max(1, -(-n // (_TILE * tiles_per_program)))
    piece = int(SHAPE["gather_tile"])
    figures, tile_counts, ends = buffers.fit(x, programs, programs * tiles_per_program * (_TILE // piece))
    floor_arg = _floor_in(x.dtype, floor)
    _STATS(programs, x, n, floor_arg, figures, tile_counts, programs, warps=int(SHAPE["stats_warps"]), TILE=_TILE,
           TILES=tiles_per_program, PIECE=piece)
    gather_shape = {"warps": int(SHAPE["gather_warps"]), "TILE": piece}
    indices = values = None
    capacity = 0
    if gather:
        capacity = min(n, max(expected, buffers.last_count + buffers.last_count // 2, _MIN_CAPACITY))
        indices = torch.empty(capacity, dtype=torch.int64, device=x.device)
        values = torch.empty(capacity, dtype=x.dtype, device=x.device)
        torch.cumsum(tile_counts, 0, dtype=torch.int64, out=ends)
        _GATHER(ends.numel(), x, n, floor_arg, ends, indices, values, capacity, **gather_shape)
    host = buffers.to_host(figures)
    total = float(host[:programs].sum())
    top = float(host[programs:2 * programs].max())
    count = int(host[2 * programs:3 * programs].sum())
    if not gather:
        return count, total, top, None, None
    assert indices is not None and values is not None
    buffers.last_count = count
    if count > capacity:  # more candidates than the guess: gather again, into buffers of the exact size
        indices = torch.empty(count, dtype=torch.int64, device=x.device)
        values = torch.empty(count, dtype=x.dtype, device=x.device)
        _GATHER(ends.numel(), x, n, floor_arg, ends, indices, values, count, **gather_shape)
    return count, total, top, indices[:count], values[:count]


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
