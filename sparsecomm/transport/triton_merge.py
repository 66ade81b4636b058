"""Decompression on a GPU: the P sorted chunks a rank receives, averaged into its output in one kernel.

:func:`average_sorted_into` is :func:`~sparsecomm.transport.merge.average_into` for chunks whose
indices are each strictly increasing (what the senders send), on CUDA tensors: one program per block
of the output merges the chunks' entries that fall in it, chunk after chunk (a barrier between two
chunks orders each index's additions as one ``index_add_`` per chunk orders them), then divides
every touched entry once (the first chunk to claim an index in a bitmap of the output divides it;
the bitmap is cleared on the way out). The bits are those of the torch path on every rank; no host
synchronization, one launch besides the concatenation of the chunks and their offsets.

Each program finds its block's slice of every chunk by a binary search (the chunks side by side in
the lanes). ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (the test suite checks it there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .triton_launch import Launcher, interpreted

__all__ = ["applies", "average_sorted_into", "MAX_CHUNKS"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None
    tl = None

#: chunks one launch merges (the lanes of the binary search)
MAX_CHUNKS = 64
#: output elements per program (a multiple of 32: a bitmap word belongs to one program)
_BLOCK = 32768
_TILE = 1024


def applies(out: Tensor, indices: Sequence[Tensor], values: Sequence[Tensor]) -> bool:
    """Whether the kernel takes these: Triton, a contiguous float32 ``out`` on CUDA (or on the CPU
    under the interpreter), 1 to :data:`MAX_CHUNKS` chunks of int32/int64 indices and float32 values
    on its device, fewer than 2^31 elements."""
    if triton is None or not 0 < len(indices) <= MAX_CHUNKS or out.dtype != torch.float32 \
            or not out.is_contiguous() or out.numel() >= 1 << 31:
        return False
    if not (out.is_cuda or (interpreted() and out.device.type == "cpu")):
        return False
    index_dtype = indices[0].dtype
    return index_dtype in (torch.int32, torch.int64) and all(
        i.device == out.device and v.device == out.device and i.dtype == index_dtype and v.dtype == out.dtype
        and i.dim() == 1 and i.numel() == v.numel() for i, v in zip(indices, values, strict=True))


if triton is not None:

    @triton.jit
    def _lower_bound(idx_ptr, lo, hi, target):
        """Per lane, the first position in ``[lo, hi)`` of the sorted indices holding ``>= target``."""
        a = lo
        z = hi
        while tl.max(z - a, 0) > 0:
            open_ = a < z
            mid = (a + z) // 2
            v = tl.load(idx_ptr + mid, mask=open_, other=0).to(tl.int64)
            right = open_ & (v < target)
            z = tl.where(open_ & ~right, mid, z)
            a = tl.where(right, mid + 1, a)
        return a

    @triton.jit
    def _lane(vector, lanes, c):
        return tl.sum(tl.where(lanes == c, vector, 0), 0)

    @triton.jit(do_not_specialize=["chunks", "n", "divisor"],
                do_not_specialize_on_alignment=["val_ptr", "offsets_ptr", "out_ptr", "bitmap_ptr"])
    def _average_kernel(idx_ptr, val_ptr, offsets_ptr, chunks, out_ptr, bitmap_ptr, n, divisor,
                        BLOCK: tl.constexpr, TILE: tl.constexpr, LANES: tl.constexpr, KEEP_SIGN: tl.constexpr,
                        DIVIDE: tl.constexpr):
        """One block of the output: the chunks' entries in it added in chunk order (from -0.0 with
        ``KEEP_SIGN``), then each touched entry divided by ``divisor`` once."""
        b0 = tl.program_id(0).to(tl.int64) * BLOCK
        lanes = tl.arange(0, LANES)
        real = lanes < chunks
        lo = tl.load(offsets_ptr + lanes, mask=real, other=0)
        hi = tl.load(offsets_ptr + lanes + 1, mask=real, other=0)
        starts = _lower_bound(idx_ptr, lo, hi, b0)
        stops = _lower_bound(idx_ptr, starts, hi, b0 + BLOCK)
        tile = tl.arange(0, TILE)
        if KEEP_SIGN:  # every touched entry starts from -0.0, as an assignment of its first value would
            c = 0
            while c < chunks:
                j = _lane(starts, lanes, c)
                stop = _lane(stops, lanes, c)
                while j < stop:
                    o = j + tile
                    m = o < stop
                    i = tl.load(idx_ptr + o, mask=m, other=0)
                    negative_zero = tl.full([TILE], -2147483648, tl.int32).to(tl.float32, bitcast=True)
                    tl.store(out_ptr + i, negative_zero, mask=m)
                    j += TILE
                c += 1
            tl.debug_barrier()
        c = 0
        while c < chunks:
            j = _lane(starts, lanes, c)
            stop = _lane(stops, lanes, c)
            while j < stop:
                o = j + tile
                m = o < stop
                i = tl.load(idx_ptr + o, mask=m, other=0)
                v = tl.load(val_ptr + o, mask=m, other=0.0)
                tl.store(out_ptr + i, tl.load(out_ptr + i, mask=m, other=0.0) + v, mask=m)
                j += TILE
            tl.debug_barrier()  # the next chunk adds to these sums
            c += 1
        if DIVIDE:
            c = 0
            while c < chunks:
                j = _lane(starts, lanes, c)
                stop = _lane(stops, lanes, c)
                while j < stop:
                    o = j + tile
                    m = o < stop
                    i = tl.load(idx_ptr + o, mask=m, other=0).to(tl.int64)
                    bit = (1 << (i & 31)).to(tl.int32)
                    old = tl.atomic_or(bitmap_ptr + (i >> 5), bit, mask=m, sem="relaxed")
                    first = m & ((old & bit) == 0)
                    s = tl.load(out_ptr + i, mask=first, other=0.0)
                    tl.store(out_ptr + i, tl.math.div_rn(s, divisor), mask=first)
                    j += TILE
                c += 1
            tl.debug_barrier()
            c = 0
            while c < chunks:
                j = _lane(starts, lanes, c)
                stop = _lane(stops, lanes, c)
                while j < stop:
                    o = j + tile
                    m = o < stop
                    i = tl.load(idx_ptr + o, mask=m, other=0).to(tl.int64)
                    tl.store(bitmap_ptr + (i >> 5), tl.zeros([TILE], dtype=tl.int32), mask=m)
                    j += TILE
                c += 1


_AVERAGE = Launcher(_average_kernel) if triton is not None else None

#: the claim bitmaps, one per (device, output size), zero between calls
_BITMAPS: dict[tuple, Tensor] = {}


def _bitmap(out: Tensor) -> Tensor:
    key = (out.device, out.numel())
    bitmap = _BITMAPS.get(key)
    if bitmap is None:
        bitmap = _BITMAPS[key] = torch.zeros(-(-out.numel() // 32), dtype=torch.int32, device=out.device)
    return bitmap


def average_sorted_into(out: Tensor, indices: Sequence[Tensor], values: Sequence[Tensor], divisor: int, *,
                        keep_sign: bool = False) -> Tensor:
    """``out[i] = (start + the chunks' values at i, in chunk order) / divisor`` at every index of the
    chunks, ``out`` left as it is elsewhere (the caller zeroed it); ``start`` ``+0.0``, or ``-0.0``
    with ``keep_sign``. Each chunk's indices strictly increasing (:func:`applies` must hold). Returns
    the chunks' indices concatenated (where ``out`` may now be non-zero)."""
    union = torch.cat(list(indices)) if len(indices) > 1 else indices[0]
    flat = torch.cat(list(values)) if len(values) > 1 else values[0]
    lengths = [0]
    for chunk in indices:
        lengths.append(lengths[-1] + chunk.numel())
    offsets = torch.tensor(lengths, dtype=torch.int64)
    if out.is_cuda:
        offsets = offsets.pin_memory().to(out.device, non_blocking=True)
    assert _AVERAGE is not None
    n = out.numel()
    lanes = max(2, 1 << (len(indices) - 1).bit_length())
    _AVERAGE(-(-n // _BLOCK), union, flat, offsets, len(indices), out, _bitmap(out), n, float(divisor), warps=4,
             BLOCK=_BLOCK, TILE=_TILE, LANES=lanes, KEEP_SIGN=keep_sign, DIVIDE=divisor != 1)
    return union
