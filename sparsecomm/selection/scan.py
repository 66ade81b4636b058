"""Passes over ``|x|`` shared by the selectors: the building blocks that make them fast on CPU.

On CPU a selector's time is its number of passes over the input, so every selector is written as few
passes as possible:

1. a threshold *floor* estimated from a strided sample of ``|x|`` (:func:`sample_floor`), placed so
   that more than the wanted count of elements lie above it with high probability;
2. one *scan* (:meth:`Scratch.scan`) giving, together, ``sum |x|`` (the mean of RedSync and MSTopK,
   and the finiteness check), ``max |x|`` and the *candidates* ``|x| >= floor`` (indices and
   magnitudes), wrapped in a :class:`MagnitudeView`.

After that, the threshold searches of the papers (RedSync Algorithms 2 and 3, MSTopK) run on the
candidates only: a count at a threshold at or above the floor is exact and costs O(#candidates); at a
threshold below the floor the count is at least #candidates, which is all those searches need to know
as long as #candidates exceeds their target, and otherwise a full scan gives the exact count. The
results are therefore exactly those of the algorithms as written, only cheaper.

The scan has two implementations with the same results:

* the fused C kernel ``sparsecomm.selection._scan`` (built at install, optional): one read of ``x``,
  AVX-512 or AVX2 where the CPU has them (chosen at run time), else portable C, on the calling
  thread; used for contiguous float32 tensors on the CPU (of fewer than 2^31 elements);
* torch operations for everything else (CUDA tensors, other dtypes, or no compiled kernel):
  ``|x|`` into a reused buffer (:class:`Scratch`; fresh 100 MB buffers would page-fault every call),
  a sum, a compare into a reused mask, and index extraction by a word trick (the boolean mask viewed
  as int64 words, ``nonzero`` on the 8x shorter word array, only the words holding a hit expanded).

``SPARSECOMM_SCAN=auto|avx512|avx2|scalar|torch`` (environment, read at import) or :func:`use_kernel`
picks the implementation; ``auto`` (default) takes the fastest available. :func:`kernel` tells which is
in use.

The exact top-k of the candidates (:func:`largest_in_order`) has two implementations with the same
results too: where the kernel is in use, a radix select on the magnitudes' bit patterns and one
compaction pass in C (``_scan.select_largest``); else ``torch.topk`` and torch compares.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..core.optional import compiled_extension
from ..transport.chunk import SparseChunk
from . import triton_scan, triton_select
from .base import assert_finite

__all__ = ["Scratch", "ScanResult", "MagnitudeView", "sample_floor", "sample_plan", "device_plan", "sampled_magnitudes",
           "kth_largest",
           "above_float32", "kernel", "available_kernels",
           "use_kernel", "take_and_clear", "split_largest", "largest_of_chunk",
           "compiled_block_energies"]

log = logging.getLogger(__name__)

#: the optional C extension (built by setup.py where a compiler is found: else None), refused when
#: built from other sources than the _scan.c beside it
_compiled: Any = compiled_extension(__package__, "_scan")

#: the variants of the compiled kernel, fastest first
_COMPILED_KERNELS = ("avx512", "avx2", "scalar")

#: the compiled kernel takes vectors shorter than this (it writes the candidates' indices as int32)
_COMPILED_MAX_N = 1 << 31

#: the device searches take vectors shorter than this (their counts, up to twice k, stay int32)
_DEVICE_SEARCH_MAX_N = 1 << 30

#: the kernel's output buffers keep at most this many candidates (or 4x the expected count, or the last
#: scan's count up to 1/_KEEP_FRACTION of the input) between calls, so that a rare scan at a low
#: threshold does not leave a gradient-sized buffer behind
_KEEP_CAPACITY = 1 << 18
#: a scan's own count is kept room for up to this fraction of its input (8 bytes a candidate, 1/16 of
#: the vector's size): a caller whose guess stays too low (RedSync's reused threshold in `bench step`,
#: 17x its k at n = 25M, 0.1%) then overflows once, not at every call (each overflow scans the vector again)
_KEEP_FRACTION = 32

#: sample_floor reads its sample in runs of this many adjacent elements
_SAMPLE_RUN = 4

#: a sample is at most this fraction of the input, and at most _MAX_SAMPLE elements
_MAX_SAMPLE_FRACTION = 1 / 8
_MAX_SAMPLE = 1 << 16


def available_kernels() -> list:
    """The scan implementations this installation can run, fastest first; ``"torch"`` is always there."""
    return (_compiled.variants() if _compiled is not None else []) + ["torch"]


def _choose(name: str) -> str:
    if name == "auto":
        return available_kernels()[0]
    if name == "triton":  # CUDA tensors use it whenever it is installed; this forces it on CPU tensors too
        if not (triton_scan.installed() and triton_scan.interpreted()):
            raise ValueError("scan kernel 'triton' on CPU tensors needs Triton installed and TRITON_INTERPRET=1 "
                             "(CUDA tensors use Triton by themselves where it is installed)")
        return name
    if name not in _COMPILED_KERNELS + ("torch",):
        raise ValueError(f"scan kernel must be 'auto', 'avx512', 'avx2', 'scalar', 'torch' or 'triton', got {name!r}")
    if name not in available_kernels():
        raise ValueError(f"scan kernel {name!r} is not available here (available: {available_kernels()}); "
                         "'avx512' needs an x86-64 CPU with AVX512F, 'avx2' one with AVX2, and all three the "
                         "compiled extension sparsecomm.selection._scan (reinstall with a C compiler)")
    return name


_kernel = _choose(os.environ.get("SPARSECOMM_SCAN", "auto"))
if _compiled is None:
    log.info("sparsecomm.selection._scan is not built: selectors use torch passes (slower on CPU)")


def kernel() -> str:
    """The scan implementation used for contiguous float32 CPU tensors: 'avx512', 'avx2', 'scalar',
    'torch' or 'triton' (Triton's interpreter, for tests). CUDA tensors use Triton where it is installed, else torch."""
    return _kernel


@contextlib.contextmanager
def use_kernel(name: str) -> Iterator[str]:
    """Use the scan implementation ``name`` ('auto', 'avx512', 'avx2', 'scalar', 'torch', 'triton') inside
    the block."""
    global _kernel
    previous, _kernel = _kernel, _choose(name)
    try:
        yield _kernel
    finally:
        _kernel = previous


class ScanResult(NamedTuple):
    """What one scan of ``x`` gives: the candidates ``|x| >= floor`` and statistics of ``|x|``."""

    #: increasing int64 indices of the candidates (a fresh tensor)
    indices: Tensor
    #: ``|x|`` at those indices, in x's dtype
    values: Tensor
    #: ``sum |x|``: ``nan`` when the torch path was not asked for it, else non-finite only for NaN/Inf input
    total: float
    #: ``max |x|``, or ``None`` when the torch path did not compute it
    max: float | None


class Scratch:
    """Reusable buffers for one selector: ``|x|`` and a bool mask (torch path), the kernel's output.

    Buffers are reallocated only when the input's size, dtype or device changes (or, for the kernel's
    output, when more candidates come than fit).
    """

    def __init__(self) -> None:
        self._abs: Tensor | None = None
        self._mask: Tensor | None = None  # length rounded up to a multiple of 8, tail always False
        self._out_indices = torch.empty(0, dtype=torch.int32)  # the kernel's int32 output, widened when copied out
        self._out_values = torch.empty(0, dtype=torch.float32)
        self._candidates: Scratch | None = None
        self._triton = triton_scan.Buffers()

    @property
    def candidates(self) -> Scratch:
        """A second scratch, for scans of the candidates that a scan of this one gathered."""
        if self._candidates is None:
            self._candidates = Scratch()
        return self._candidates

    # -- the scan ---------------------------------------------------------------------------------------
    def scan(self, x: Tensor, floor: float, *, name: str, check_finite: bool, need_total: bool = True,
             expected: int = 0, addend: Tensor | None = None, dest: Tensor | None = None) -> ScanResult:
        """Candidates ``|x| >= floor`` with ``sum |x|`` and ``max |x|``, in one pass where possible.

        With ``addend`` (same shape as ``x``), ``x + addend`` is written first, to ``dest`` (a tensor
        shaped like ``x``; default ``x`` itself, ``x += addend``), in the same pass on the kernel's path
        (error feedback's ``acc = residual + grad`` and the scan in one read of each), and the scan is
        of the sum. A ``dest`` other than ``x`` leaves ``x`` as it was (it must not overlap ``x`` or
        ``addend`` partially). ``dest`` needs ``addend``.

        With ``check_finite``, NaN or Inf in ``x`` raises :class:`~sparsecomm.selection.NonFiniteInputError`
        (naming the selector ``name``). ``expected`` sizes the kernel's output buffer (a guess; more
        candidates cost a second pass). ``need_total=False`` lets the torch path skip the sum when the
        caller needs neither the mean nor the check.
        """
        if dest is not None and (addend is None or dest.shape != x.shape or dest.dtype != x.dtype
                                 or dest.device != x.device):
            raise ValueError("scan: dest needs an addend and the shape, dtype and device of x")
        if addend is not None and not (addend.shape == x.shape
                                       and (self.uses_compiled(x, addend, *([] if dest is None else [dest]))
                                            or self._fuses_on_device(x, addend, dest))):
            x = x.add_(addend) if dest is None else torch.add(x, addend, out=dest)
            addend = dest = None
        if self._use_compiled(x):
            result = self._scan_compiled(x, floor, expected, addend, dest)
            x = x if dest is None else dest
        elif self.uses_triton(x):
            result = self._scan_triton(x, floor, expected, addend, dest)
            x = x if dest is None else dest
        else:
            a = self.magnitudes(x)
            total = _sum_of_magnitudes(a) if need_total or check_finite else math.nan
            indices = self.indices_ge(a, floor)
            result = ScanResult(indices, a.index_select(0, indices), total, None)
        if check_finite and not math.isfinite(result.total):
            assert_finite(x, name)  # raises: with finite input the sums above cannot overflow
        return result

    def count_ge(self, x: Tensor, t: float) -> int:
        """Exact ``#{i : |x_i| >= t}`` (one pass, no indices kept)."""
        if self._use_compiled(x):
            return self._run_compiled(x, t, 0)[0]
        if self.uses_triton(x):
            return triton_scan.scan_ge(x, t, self._triton, gather=False)[0]
        return int(torch.count_nonzero(self._mask_ge(self.magnitudes(x), t)))

    def _scan_triton(self, x: Tensor, floor: float, expected: int, addend: Tensor | None = None,
                     dest: Tensor | None = None) -> ScanResult:
        """The GPU scan (:func:`.triton_scan.scan_ge`): one read of ``x`` (and ``addend``, the sum
        written to ``dest``), candidates in increasing index order."""
        count, total, top, indices, values = triton_scan.scan_ge(x, floor, self._triton, expected=expected,
                                                                 addend=addend, dest=dest)
        assert indices is not None and values is not None
        return ScanResult(indices, values, total, top)

    @staticmethod
    def uses_triton(x: Tensor) -> bool:
        """Whether scans of ``x`` run the Triton kernels (CUDA tensors where Triton is installed)."""
        return triton_scan.available(x, on_cpu=_kernel == "triton")

    @classmethod
    def searches_on_device(cls, x: Tensor, *others: Tensor | None) -> bool:
        """Whether the threshold searches of ``x`` run on the device (:mod:`.triton_select`): a
        float32 tensor the Triton kernels scan, with ``others`` (an addend, a destination) alike."""
        return (cls.uses_triton(x) and x.dtype == torch.float32 and x.numel() < _DEVICE_SEARCH_MAX_N
                and all(t is None or (t.dtype == x.dtype and t.device == x.device and t.shape == x.shape
                                      and t.is_contiguous()) for t in others))

    @classmethod
    def _fuses_on_device(cls, x: Tensor, addend: Tensor, dest: Tensor | None) -> bool:
        """Whether the Triton pass adds ``addend`` itself (float32, alike tensors)."""
        return cls.searches_on_device(x, addend, dest)

    @property
    def device_buffers(self) -> triton_scan.Buffers:
        """The Triton pipelines' device buffers (reused across calls)."""
        return self._triton

    @staticmethod
    def _use_compiled(x: Tensor) -> bool:
        return _compiled_applies(x, torch.float32)

    @classmethod
    def uses_compiled(cls, *tensors: Tensor) -> bool:
        """Whether a scan of these tensors (``x``, ``addend``, ``dest``) runs the C kernel."""
        return all(cls._use_compiled(t) for t in tensors)

    def _run_compiled(self, x: Tensor, floor: float, capacity: int, addend: Tensor | None = None,
                      dest: Tensor | None = None) -> tuple:
        """(count, total, max) of one kernel call writing up to ``capacity`` candidates (and, with
        ``addend``, ``dest = x + addend`` in the same pass, ``dest`` defaulting to ``x``)."""
        idx_ptr = val_ptr = 0
        if capacity:
            idx_ptr, val_ptr = self._out_indices.data_ptr(), self._out_values.data_ptr()
        return _compiled.scan_ge(x.data_ptr(), x.numel(), float(floor), idx_ptr, val_ptr, capacity, _kernel,
                                 0 if addend is None else addend.data_ptr(), 0 if dest is None else dest.data_ptr())

    def _scan_compiled(self, x: Tensor, floor: float, expected: int, addend: Tensor | None = None,
                       dest: Tensor | None = None) -> ScanResult:
        if self._out_indices.numel() < expected:
            self._grow(max(expected, 1024))
        count, total, top = self._run_compiled(x, floor, self._out_indices.numel(), addend, dest)
        if count > self._out_indices.numel():  # more candidates than fit: grow and scan the sum again
            log.debug("scan: %d candidates overflowed a buffer of %d; scanning again", count,
                      self._out_indices.numel())
            self._grow(count + count // 4)
            summed = x if addend is None else (x if dest is None else dest)
            count, total, top = self._run_compiled(summed, floor, self._out_indices.numel())
        result = ScanResult(self._out_indices[:count].to(torch.int64), self._out_values[:count].clone(), total, top)
        recent = min(count + count // 4, x.numel() // _KEEP_FRACTION)
        if self._out_indices.numel() > max(4 * expected, _KEEP_CAPACITY, recent):
            self._grow(max(expected, recent, 1024))  # a rare large gather: do not keep 8 bytes per element of it
        return result

    def _grow(self, capacity: int) -> None:
        self._out_indices = torch.empty(capacity, dtype=torch.int32)
        self._out_values = torch.empty(capacity, dtype=torch.float32)

    # -- torch path -------------------------------------------------------------------------------------
    def magnitudes(self, x: Tensor) -> Tensor:
        """``|x|`` written into the reused buffer (valid until the next call)."""
        n = x.numel()
        buf = self._abs
        if buf is None or buf.numel() != n or buf.dtype != x.dtype or buf.device != x.device:
            self._abs = buf = torch.empty(n, dtype=x.dtype, device=x.device)
            self._mask = torch.zeros(-(-n // 8) * 8, dtype=torch.bool, device=x.device)
        return torch.abs(x, out=buf)

    def _mask_ge(self, a: Tensor, t: float) -> Tensor:
        mask = self._mask
        assert mask is not None, "magnitudes() sizes the mask first"
        torch.ge(a, t, out=mask[: a.numel()])
        return mask

    def indices_ge(self, a: Tensor, t: float) -> Tensor:
        """Increasing int64 indices of ``a >= t`` for ``a`` returned by :meth:`magnitudes` (one compare
        pass, then ``nonzero`` on int64 words)."""
        mask = self._mask_ge(a, t)
        words = torch.nonzero(mask.view(torch.int64)).squeeze(1)
        row, col = torch.nonzero(mask.view(-1, 8).index_select(0, words), as_tuple=True)
        return words.index_select(0, row).mul_(8).add_(col)


def _compiled_applies(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether the compiled kernel is in use and takes ``t``: a contiguous CPU tensor of ``dtype`` with
    fewer than 2^31 elements."""
    return (_kernel in _COMPILED_KERNELS and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
            and t.numel() < _COMPILED_MAX_N)


def _sum_of_magnitudes(a: Tensor) -> float:
    """``sum a`` for ``a = |x|``; a float32 sum that overflows with finite input is redone in float64."""
    acc = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    total = float(a.sum(dtype=acc))
    if math.isfinite(total) or not bool(torch.isfinite(a).all()):
        return total
    return float(a.sum(dtype=torch.float64))


def above_float32(t: float) -> float:
    """The least float32 above ``t`` rounded to float32: for float32 magnitudes ``a``, ``a > t`` as
    torch compares it (``t`` cast to the tensor's dtype) is ``a >= above_float32(t)``, a floor the scan
    takes. ``t`` itself when it rounds to infinity."""
    return float(np.nextafter(np.float32(t), np.float32(np.inf)))


def sample_floor(x: Tensor, count: int, *, min_hits: int = 256, sigmas: float = 4.0,
                 addend: Tensor | None = None) -> float | None:
    """A threshold with more than ``count`` elements of ``|x|`` at or above it, with high probability
    (of ``|x + addend|`` with ``addend``: the sampled elements are added, nothing is written).

    Takes a strided sample of ``|x|`` large enough to hold about ``min_hits`` elements above the
    ``count``-th largest value, in runs of ``_SAMPLE_RUN`` adjacent elements (a cold cache line costs
    the same for one element as for four, and most of the sampled lines are cold), and returns the
    sample's order statistic ``sigmas`` standard deviations below that, the deviation that of a
    binomial over the runs (``sqrt(_SAMPLE_RUN)`` times the elements': adjacent elements of a
    gradient may have alike magnitudes, so a run is counted as one draw). The sample holds at most
    ``_MAX_SAMPLE`` elements and 1/8 of ``x``: where
    ``count`` would need more, the floor is placed for the larger count such a sample resolves (more
    candidates than asked for, which the kernel gathers cheaply, instead of a large ``torch.topk``).
    Returns ``None`` when that count is not much below ``n`` (small inputs: the caller then scans ``x``
    whole). The answer is a guess: callers check the real count.
    """
    plan = sample_plan(x.numel(), count, min_hits=min_hits, sigmas=sigmas)
    if plan is None:
        return None
    runs, stride, rank = plan
    return kth_largest(_sampled_magnitudes(x, runs, stride, addend), rank)


def sample_plan(n: int, count: int, *, min_hits: int = 256, sigmas: float = 4.0) -> tuple[int, int, int] | None:
    """:func:`sample_floor`'s sample for ``count`` of ``n`` elements: (runs, their stride, the rank in
    the sample of the floor), or ``None`` where it takes no sample. A function of the sizes alone."""
    if count <= 0 or count >= n:
        return None
    size = min(math.ceil(min_hits * n / count), _MAX_SAMPLE, int(n * _MAX_SAMPLE_FRACTION))
    if size < min_hits:
        return None
    count = max(count, math.ceil(min_hits * n / size))
    if count > n * _MAX_SAMPLE_FRACTION:
        return None
    runs = -(-size // _SAMPLE_RUN)
    sampled = runs * _SAMPLE_RUN
    hits = count * sampled / n
    return runs, n // runs, min(sampled, int(hits + sigmas * math.sqrt(_SAMPLE_RUN * hits)) + 2)


def device_plan(n: int, count: int) -> triton_select.SamplePlan | None:
    """The device searches' sample (:func:`sample_plan`'s, with the candidates it leads to expect):
    the floor is placed on the device from it, with no host round trip (:mod:`.triton_select`)."""
    plan = sample_plan(n, count)
    if plan is None:
        return None
    runs, stride, rank = plan
    return triton_select.SamplePlan(runs, stride, rank, triton_select.sample_expected(n, runs, rank))


#: :func:`kth_largest` scans from this many elements on (below it the radix select of all is as fast)
_KTH_SCAN_MIN = 1 << 16


def kth_largest(a: Tensor, rank: int) -> float:
    """The ``rank``-th largest element of the magnitudes ``a`` (1-D, ``>= 0``; ``1 <= rank <= a.numel()``):
    the value ``torch.topk(a, rank).values.min()`` gives.

    Where the compiled kernel takes ``a`` it is a radix select on the values' bit patterns (``_scan.kth_largest``:
    for non-negative floats, +Inf included, the bits order as the values do); from 65536 elements on, of
    the candidates above a sampled floor only (:func:`sample_floor`, one scan of ``a``): the rank-th
    largest is at or above the floor whenever at least ``rank`` elements are, so the value is the same,
    and the select reads a small fraction of ``a`` where ``torch.topk`` sorts all of it. NaN in ``a``, a
    sample that misjudged, or other tensors: ``torch.topk``'s answer.
    """
    if a.dim() == 1 and _compiled_applies(a, torch.float32):
        if a.numel() >= _KTH_SCAN_MIN:
            floor = sample_floor(a, rank)
            if floor is not None:
                candidates = Scratch().scan(a, floor, name="kth_largest", check_finite=False, expected=8 * rank)
                if math.isfinite(candidates.total) and candidates.values.numel() >= rank:
                    a = candidates.values
        bits = _compiled.kth_largest(a.data_ptr(), a.numel(), rank)
        if bits >= 0:
            return struct.unpack("<f", struct.pack("<I", bits))[0]  # the float32 of those bits
    return float(torch.topk(a, rank, sorted=False).values.min())


def sampled_magnitudes(x: Tensor, size: int, addend: Tensor | None = None) -> Tensor:
    """About ``size`` elements of ``|x|`` (of ``|x + addend|`` with ``addend``, nothing written), spread
    evenly over the 1-D ``x`` in runs of ``_SAMPLE_RUN`` adjacent elements, as :func:`sample_floor`
    samples (the C kernel's lines are prefetched ahead: a strided torch read waits for each cold line in
    turn, several times as long). Needs ``x.numel() >= 2 * size``."""
    runs = -(-size // _SAMPLE_RUN)
    if x.dim() != 1 or x.numel() < 2 * runs * _SAMPLE_RUN:
        raise ValueError(f"sampled_magnitudes: x must be 1-D with at least {2 * runs * _SAMPLE_RUN} elements, "
                         f"got shape {tuple(x.shape)}")
    return _sampled_magnitudes(x, runs, x.numel() // runs, addend)


def _sampled_magnitudes(x: Tensor, runs: int, stride: int, addend: Tensor | None) -> Tensor:
    """``|x + addend|`` (``|x|`` without ``addend``) at the ``_SAMPLE_RUN`` elements from ``r * stride`` on,
    for ``r < runs`` (``stride >= _SAMPLE_RUN``, inside ``x``): by the C kernel where it takes the
    tensors (the lines prefetched ahead, the same bits), else by torch."""
    if x.dim() == 1 and _compiled_applies(x, torch.float32) and (
            addend is None or (_compiled_applies(addend, torch.float32) and addend.shape == x.shape)):
        sample = torch.empty(runs * _SAMPLE_RUN, dtype=torch.float32)
        _compiled.sample_magnitudes(x.data_ptr(), 0 if addend is None else addend.data_ptr(), stride, runs,
                                    _SAMPLE_RUN, sample.data_ptr())
        return sample
    positions = (torch.arange(runs, device=x.device) * stride).repeat_interleave(_SAMPLE_RUN)
    positions += torch.arange(_SAMPLE_RUN, device=x.device).repeat(runs)
    picked = x.reshape(-1).index_select(0, positions)
    if addend is not None:
        picked += addend.reshape(-1).index_select(0, positions)
    return picked.abs_()


class MagnitudeView:
    """Exact counts and index sets of ``|x| >= t``, cheap at thresholds above a floor.

    Built with one scan (:meth:`Scratch.scan`) gathering the candidates ``|x| >= floor`` and the sum
    and max of ``|x|``; with ``floor=None`` every element is a candidate. With ``addend`` the scan
    first writes ``x + addend`` to ``dest`` (default ``x``: ``x += addend``), and the view is of the
    sum (its :attr:`x` is ``dest``). ``count`` is the number of elements the floor was placed above (it
    sizes the scan's output buffer).
    """

    def __init__(self, x: Tensor, scratch: Scratch, floor: float | None, *, name: str, check_finite: bool,
                 count: int = 0, need_mean: bool = True, addend: Tensor | None = None,
                 dest: Tensor | None = None) -> None:
        scan = scratch.scan(x, math.inf if floor is None else floor, name=name, check_finite=check_finite,
                            need_total=need_mean, expected=count + count // 2, addend=addend, dest=dest)
        self.x = x if dest is None else dest
        self.scratch = scratch
        self.floor = floor
        self.name = name
        self.mean = scan.total / max(1, x.numel())
        self._max = scan.max
        self._sorted: tuple | None = None
        if floor is None:
            self.indices: Tensor | None = None
            self.values = scratch.magnitudes(self.x)
        else:
            self.indices = scan.indices
            self.values = scan.values

    @property
    def n_candidates(self) -> int:
        return self.values.numel()

    def _covers(self, t: float) -> bool:
        """Whether the candidates answer for threshold ``t``: at or above the floor, or NaN (a NaN
        threshold, from NaN/Inf input under ``check_finite=False``, selects nothing anywhere)."""
        return self.floor is None or not t < self.floor

    def max(self) -> float:
        """max |x| (from the scan, or from the candidates, which hold it, when there are any)."""
        if self._max is None:
            self._max = float(self.values.max() if self.n_candidates else self.x.abs().max())
        return self._max

    def count(self, t: float) -> int:
        """Exact #{|x| >= t}: a scan of the candidates, or of all of ``x`` when ``t`` is below the floor."""
        if self._covers(t):
            return self.scratch.candidates.count_ge(self.values, t)
        return self.scratch.count_ge(self.x, t)

    @property
    def batched(self) -> bool:
        """Whether each count costs a device round trip (a GPU): searches then ask :meth:`counts`
        for many thresholds at once instead of calling :meth:`count` once per step."""
        return self.scratch.uses_triton(self.values) or self.scratch.uses_triton(self.x)

    def counts(self, thresholds: np.ndarray) -> np.ndarray:
        """Exact ``#{|x| >= t}`` for every ``t`` of the float64 array ``thresholds`` at or above the
        floor, from the candidates sorted once by magnitude (one device synchronization); -1 for a
        threshold below the floor (answer those with :meth:`count_exceeds`). A NaN threshold counts 0."""
        thresholds = np.asarray(thresholds, dtype=np.float64)
        result = np.full(thresholds.shape, -1, dtype=np.int64)
        nan = np.isnan(thresholds)
        result[nan] = 0
        covered = ~nan if self.floor is None else (~nan & (thresholds >= self.floor))
        result[covered] = triton_scan.counts_ge(self._by_magnitude()[0], thresholds[covered])
        return result

    def _by_magnitude(self) -> tuple:
        """The candidates' magnitudes in increasing order and their positions (sorted once)."""
        if self._sorted is None:
            self._sorted = torch.sort(self.values)
        return self._sorted

    def count_exceeds(self, t: float, m: int) -> tuple:
        """``(count(t) > m, count)``; without a pass when ``t`` is below the floor and the candidates
        alone exceed ``m`` (then the returned count is only the lower bound #candidates)."""
        if not self._covers(t) and self.n_candidates > m:
            return True, self.n_candidates
        c = self.count(t)
        return c > m, c

    def _at_or_above(self, t: float, expected: int = 0) -> ScanResult:
        """Increasing indices into ``x`` and magnitudes of ``|x| >= t``: a scan of the candidates, or
        of all of ``x`` when ``t`` is below the floor (the input was checked by the first scan).
        ``expected``: how many the caller expects (sizes the scan's output; more cost a second pass)."""
        if not self._covers(t):
            return self.scratch.scan(self.x, t, name=self.name, check_finite=False, need_total=False,
                                     expected=expected)
        if self.batched and t == t:
            # on a GPU: the top of the magnitude order, one search and one sort, no scan of the candidates
            ascending, positions = self._by_magnitude()
            count = int(triton_scan.counts_ge(ascending, np.array([t]))[0])
            picked = torch.sort(positions[ascending.numel() - count:]).values
            within = ScanResult(picked, self.values.index_select(0, picked), math.nan, None)
        else:
            within = self.scratch.candidates.scan(self.values, t, name=self.name, check_finite=False,
                                                  need_total=False, expected=expected)
        if self.indices is None:
            return within
        return within._replace(indices=self.indices.index_select(0, within.indices))

    def indices_ge(self, t: float, expected: int = 0) -> Tensor:
        """Increasing indices of ``|x| >= t`` (``expected``: their count, a guess that sizes the scan)."""
        return self._at_or_above(t, expected).indices

    def indices_and_values_ge(self, t: float, expected: int = 0) -> tuple[Tensor, Tensor]:
        """(increasing indices of ``|x| >= t``, those magnitudes ``|x_i|``), from one scan
        (``expected`` as for :meth:`indices_ge`): the magnitudes without a gather from ``x``."""
        above = self._at_or_above(t, expected)
        return above.indices, above.values

    def values_ge(self, t: float, expected: int = 0) -> Tensor:
        """The magnitudes ``|x_i| >= t``, in increasing ``i`` (``expected`` as for :meth:`indices_ge`;
        on the CPU no index is mapped back into ``x``)."""
        if self._covers(t) and not self.batched:
            return self.scratch.candidates.scan(self.values, t, name=self.name, check_finite=False, need_total=False,
                                                expected=expected).values
        return self._at_or_above(t, expected).values

    def count_and_sum_ge(self, t: float) -> tuple[int, float]:
        """``(#{|x| >= t}, sum of those |x_i| in float64)``, for a fit on the exceedances (SIDCo's later
        stages): one read of the candidates' magnitudes, nothing written (the C kernel's ``sum_ge``: eight
        partial sums by position, the same bits in every variant); torch's sum elsewhere, which may round
        the last bit differently."""
        values = self.values if self._covers(t) else self._at_or_above(t).values
        if _compiled_applies(values, torch.float32):
            number, total = _compiled.sum_ge(values.data_ptr(), values.numel(), t, _kernel)
            return int(number), float(total)
        above = values[values >= t]
        return above.numel(), float(above.sum(dtype=torch.float64))

    def indices_ge_marking(self, lo: float, hi: float) -> tuple[Tensor, Tensor]:
        """(increasing indices of ``|x| >= lo``, the mask of those at or above ``hi`` among them), from
        one scan: e.g. every entry above ``hi`` and a window of those in ``[lo, hi)``, in index order."""
        above = self._at_or_above(lo)
        return above.indices, above.values >= hi

    def topk_at_or_above(self, t: float, k: int) -> Tensor:
        """Increasing indices of the ``k`` largest elements among ``|x| >= t`` (needs ``count(t) >= k``).

        When ``t`` is at or below the floor and the candidates number at least ``k``, the candidates
        hold the ``k`` largest elements of all of ``|x|``, so they answer without a pass.
        """
        if self.indices is not None and self.floor is not None and t <= self.floor and self.n_candidates >= k:
            return largest_in_order(self.indices, self.values, k)
        above = self._at_or_above(t)
        return largest_in_order(above.indices, above.values, k)


#: the largest block the compiled block energies take (its BLOCK_ENERGY_MAX)
_BLOCK_ENERGY_MAX = 4096


def compiled_block_energies(x: Tensor, size: int, addend: Tensor | None = None,
                            dest: Tensor | None = None) -> Tensor | None:
    """The squared L2 norm of every block of ``size`` elements of ``x`` (of ``dest = x + addend``,
    written in the same pass, where ``addend`` is given; ``dest`` defaults to ``x``) summed in
    :mod:`.block`'s canonical pairwise order, by the compiled kernel (one read of ``x`` and ``addend``);
    ``None`` where the kernel does not take these tensors (the caller's torch path gives the same bits)."""
    tensors = [t for t in (x, addend, dest) if t is not None]
    if not (0 < size <= _BLOCK_ENERGY_MAX and all(_compiled_applies(t, torch.float32) and t.shape == x.shape
                                                  for t in tensors)):
        return None
    energies = torch.empty(-(-x.numel() // size), dtype=torch.float32)
    _compiled.block_energies(x.data_ptr(), x.numel(), size, 0 if addend is None else addend.data_ptr(),
                             0 if addend is None or dest is None else dest.data_ptr(), energies.data_ptr(), _kernel)
    return energies


def take_and_clear(x: Tensor, indices: Tensor) -> Tensor:
    """``x[indices]`` (a fresh tensor), then ``x[indices] = 0``: a message's values taken out of
    ``acc = residual + grad``, which leaves the residual of error feedback. ``indices``: int64, distinct
    (as a selection returns them), any order.

    Where the compiled kernel is in use (float32 ``x`` on the CPU) one C loop visits each touched cache
    line once (``_scan.take_and_clear``); on a GPU one Triton kernel reads and clears the entries
    (:func:`.triton_scan.take_and_clear`); else ``index_select`` and ``index_fill_``, with the same
    result."""
    if _compiled_applies(x, torch.float32) and indices.dtype == torch.int64 and indices.device.type == "cpu" \
            and indices.is_contiguous():
        values = torch.empty(indices.numel(), dtype=x.dtype)
        if _compiled.take_and_clear(x.data_ptr(), x.numel(), indices.data_ptr(), indices.numel(),
                                    values.data_ptr()) != 0:
            raise IndexError(f"take_and_clear: an index lies outside the {x.numel()} elements of x")
        return values
    if (Scratch.uses_triton(x) and x.dim() == 1 and indices.dim() == 1 and indices.device == x.device
            and indices.dtype in (torch.int32, torch.int64) and x.numel() < _COMPILED_MAX_N):
        return triton_scan.take_and_clear(x, indices.contiguous())
    values = x.index_select(0, indices)
    x.index_fill_(0, indices, 0)
    return values


def split_largest(indices: Tensor, values: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(indices, values) of the ``k`` pairs largest in magnitude and of the others, each in the pairs'
    order; among values tied in magnitude with the k-th largest the first ones are kept (the rule of
    :func:`largest_in_order`). ``0 < k < len(values)``.

    Where the compiled kernel is in use (float32 values on the CPU, int32 or int64 indices) a radix
    select on the magnitudes' bits and one pass writing both parts (``_scan.split_largest``); else
    ``torch.topk`` and masks, with the same result. NaN among the values: torch.topk's choice."""
    count = values.numel()
    if not 0 < k < count:
        raise ValueError(f"split_largest: needs 0 < k < {count} (the pairs), got k={k}")
    if (_compiled_applies(values, torch.float32) and indices.device.type == "cpu" and indices.is_contiguous()
            and indices.dtype in (torch.int32, torch.int64) and indices.numel() == count):
        kept_idx, dropped_idx = indices.new_empty(k), indices.new_empty(count - k)
        kept_val, dropped_val = values.new_empty(k), values.new_empty(count - k)
        if _compiled.split_largest(values.data_ptr(), count, k, indices.data_ptr(), indices.dtype == torch.int64,
                                   kept_idx.data_ptr(), kept_val.data_ptr(), dropped_idx.data_ptr(),
                                   dropped_val.data_ptr()) == k:
            return kept_idx, kept_val, dropped_idx, dropped_val
    magnitudes = values.abs()
    keep = _first_largest(magnitudes, k)
    if keep is None:  # NaN among the values: torch.topk's own choice
        keep = torch.zeros(count, dtype=torch.bool, device=values.device)
        keep[torch.topk(magnitudes, k, sorted=False).indices] = True
    return indices[keep], values[keep], indices[~keep], values[~keep]


def _first_largest(values: Tensor, k: int) -> Tensor | None:
    """The mask of the ``k`` largest ``values`` (``0 < k < len(values)``), the first ones among ties with
    the k-th kept (torch operations); ``None`` when NaN among the values leaves no such set."""
    kth = torch.topk(values, k, sorted=False).values.min()
    keep = values > kth
    short = k - int(keep.sum())
    if short > 0:
        keep[torch.nonzero(values == kth).squeeze(1)[:short]] = True
    return keep if int(keep.sum()) == k else None


def largest_of_chunk(chunk: SparseChunk, k: int) -> tuple[SparseChunk, SparseChunk]:
    """Split a sparse chunk into (its ``k`` entries largest in magnitude, the rest), both in index
    order, the first entries tied with the k-th kept (:func:`split_largest`): gTop-k's and Ok-Topk's
    merges of received chunks."""
    if k >= chunk.nnz:
        return chunk, SparseChunk(chunk.indices[:0], chunk.values[:0])
    if k <= 0:
        return SparseChunk(chunk.indices[:0], chunk.values[:0]), chunk
    kept_idx, kept_val, dropped_idx, dropped_val = split_largest(chunk.indices, chunk.values, k)
    return SparseChunk(kept_idx, kept_val), SparseChunk(dropped_idx, dropped_val)


def largest_in_order(indices: Tensor, values: Tensor, k: int) -> Tensor:
    """The ``indices`` (increasing) of the ``k`` largest ``values`` (magnitudes), still in increasing
    order, so the senders that need sorted indices sort nothing. Among values tied with the k-th
    largest the first ones are kept.

    Where the compiled kernel is in use (float32 values on the CPU) the k-th largest value comes from a
    radix select on the values' bit patterns and the compaction is one pass in C
    (``_scan.select_largest``); else from ``torch.topk``, then torch compares. NaN among the values
    (unchecked input) makes both take torch.topk's own choice, sorted."""
    if k >= values.numel():
        return indices
    if (k > 0 and _compiled_applies(values, torch.float32) and _compiled_applies(indices, torch.int64)
            and indices.numel() == values.numel()):
        chosen = torch.empty(k, dtype=torch.int64)
        if _compiled.select_largest(indices.data_ptr(), values.data_ptr(), values.numel(), k,
                                    chosen.data_ptr(), _kernel) == k:
            return chosen
    keep = _first_largest(values, k)
    if keep is None:  # NaN among the values (unchecked input): torch.topk's own choice, sorted
        return torch.sort(indices.index_select(0, torch.topk(values, k, sorted=False).indices)).values
    return indices[keep]
