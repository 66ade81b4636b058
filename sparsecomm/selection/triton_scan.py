"""The selectors' passes on a GPU: Triton kernels that read the gradient once.

The CPU path reads ``x`` once with the C kernel; on CUDA the same contract is met by these kernels
(see :mod:`sparsecomm.selection.scan` for how the selectors use them):

* :func:`scan_ge` -- ``sum |x|`` (in float64, per program, then summed in a fixed order, so the
  result does not depend on scheduling), ``max |x|`` and the candidates ``|x| >= floor`` (indices
  and magnitudes, in increasing index order) in two reads of ``x``: one for the statistics and the
  count of each program, one to write each program's candidates at its prefix-sum offset. (A single
  read with an atomic slot reservation per program was measured too: its output is unordered, and
  sorting it cost more than the second read.)
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

__all__ = ["available", "installed", "interpreted", "scan_ge", "counts_ge", "CHUNK"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: the torch passes are used instead
    triton = None
    tl = None

#: elements per program of the scan: 16 tiles of 1024
_TILE = 1024
_TILES = 16
CHUNK = _TILE * _TILES
#: the gather's tiles are smaller: at the densities of a selection most of them hold no candidate
_GATHER_TILE = 256


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

    @triton.jit(do_not_specialize=["n", "floor", "programs"], do_not_specialize_on_alignment=["out_ptr"])
    def _stats_kernel(x_ptr, n, floor, out_ptr, programs, TILE: tl.constexpr, TILES: tl.constexpr):
        """Per program p, into the float64 array out: out[p] = sum |x| (float64), out[programs + p] =
        max |x|, out[2 programs + p] = #{|x| >= floor}, over its chunk of x (one host copy reads all)."""
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
            hits += ((a >= floor) & inside).to(tl.int32)
        tl.store(out_ptr + pid, tl.sum(total, axis=0))
        tl.store(out_ptr + programs + pid, tl.max(top, axis=0).to(tl.float64))
        tl.store(out_ptr + 2 * programs + pid, tl.sum(hits, axis=0).to(tl.float64))

    @triton.jit(do_not_specialize=["n", "floor"], do_not_specialize_on_alignment=["ends_ptr", "idx_ptr", "val_ptr"])
    def _gather_kernel(x_ptr, n, floor, ends_ptr, idx_ptr, val_ptr, TILE: tl.constexpr, TILES: tl.constexpr):
        """Per program: write the indices and magnitudes of |x| >= floor of its chunk, in order, from
        the slot ``ends[pid - 1]`` (``ends``: the inclusive prefix sum of the programs' counts)."""
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * (TILE * TILES)
        lanes = tl.arange(0, TILE)
        slot = tl.load(ends_ptr + pid - 1, mask=pid > 0, other=0.0).to(tl.int64)
        for t in range(TILES):
            offs = start + t * TILE + lanes
            inside = offs < n
            a = tl.abs(tl.load(x_ptr + offs, mask=inside, other=0.0))
            hit = (a >= floor) & inside
            hits = tl.sum(hit.to(tl.int32), axis=0)
            if hits > 0:  # most tiles of a sparse selection have none: no prefix sum for them
                position = slot + (tl.cumsum(hit.to(tl.int32), axis=0) - 1).to(tl.int64)
                tl.store(idx_ptr + position, offs, mask=hit)
                tl.store(val_ptr + position, a, mask=hit)
                slot += hits.to(tl.int64)


class _Launcher:
    """A Triton kernel compiled once per (device, dtype, 16-byte alignment of ``x``) and then launched
    straight through its compiled handle.

    Triton's own ``kernel[grid](...)`` binds and specializes the arguments on every call, about 50
    microseconds of Python in Triton 3.6 (measured on an H100): more than the kernel itself on
    gradients of a few million elements. The kernels here are declared not to specialize on their
    integer arguments nor on the alignment of any pointer but ``x``, so one compiled kernel serves
    every call with the same key. Under the interpreter (``TRITON_INTERPRET=1``) the plain launch is used.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}

    def __call__(self, programs: int, x: Tensor, *args, tile: int, tiles: int) -> None:
        grid = (programs, 1, 1)
        if interpreted() or not x.is_cuda:
            self.kernel[grid](x, *args, TILE=tile, TILES=tiles)
            return
        key = (x.device.index, x.dtype, x.data_ptr() % 16 == 0)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel.warmup(x, *args, TILE=tile, TILES=tiles, grid=grid)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            self.compiled[key] = compiled
        compiled[grid](x, *args, tile, tiles)


class _Buffers:
    """Per-scratch device buffer of the scan's per-program figures, reused across calls."""

    def __init__(self) -> None:
        self.figures: Tensor | None = None  # float64 [3 programs + 1]: sums, maxima, 0, counts


_STATS = _Launcher(_stats_kernel) if triton is not None else None
_GATHER = _Launcher(_gather_kernel) if triton is not None else None


def _floor_in(dtype: torch.dtype, floor: float) -> float:
    """``floor`` rounded to ``dtype`` (as torch.ge and the C kernel compare), as a Python float."""
    if dtype == torch.float32:
        return float(np.float32(floor))
    if dtype == torch.float16:
        return float(np.float16(floor))
    return float(torch.tensor(floor, dtype=torch.float64).to(dtype).to(torch.float64))


def scan_ge(x: Tensor, floor: float, buffers: _Buffers, *, gather: bool = True
            ) -> tuple[int, float, float, Tensor | None, Tensor | None]:
    """``(count, sum |x|, max |x|, indices, magnitudes)`` of ``|x| >= floor``, indices increasing.

    Two kernels: the first reads ``x`` for the statistics and each program's count; one copy of those
    per-program figures to the host (the only synchronization) gives the three scalars and sizes the
    output exactly; the second kernel reads ``x`` again and writes the candidates in index order at
    each program's prefix-sum offset (no atomics, no sort: the same result on every run).
    ``gather=False`` stops after the first (a count); indices and magnitudes are then ``None``.
    """
    assert _STATS is not None and _GATHER is not None, "Triton is not installed"
    n = x.numel()
    programs = max(1, -(-n // CHUNK))
    figures = buffers.figures
    if figures is None or figures.numel() < 3 * programs or figures.device != x.device:
        buffers.figures = figures = torch.empty(3 * programs, dtype=torch.float64, device=x.device)
    floor_arg = _floor_in(x.dtype, floor)
    _STATS(programs, x, n, floor_arg, figures, programs, tile=_TILE, tiles=_TILES)
    host = figures[:3 * programs].cpu().numpy()
    total = float(host[:programs].sum())
    top = float(host[programs:2 * programs].max())
    count = int(host[2 * programs:3 * programs].sum())
    if not gather:
        return count, total, top, None, None
    indices = torch.empty(count, dtype=torch.int64, device=x.device)
    values = torch.empty(count, dtype=x.dtype, device=x.device)
    if count:
        ends = figures[2 * programs:3 * programs].cumsum(0)  # exact: counts are integers below 2^53
        _GATHER(programs, x, n, floor_arg, ends, indices, values, tile=_GATHER_TILE, tiles=CHUNK // _GATHER_TILE)
    return count, total, top, indices, values


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
