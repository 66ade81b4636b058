"""Decompression without a sort: the P sorted chunks a rank receives, merged into its output.

Every sparse method ends by adding the chunks it received index by index, in rank order, and (for
its result) dividing each sum by P. Each chunk's indices arrive sorted (the senders sort their
selections), so on the CPU nothing is sorted again (:mod:`._merge`, a C extension built at install):
every index's sum is accumulated as ``0 + v_0 + v_1 + ...`` in chunk order, exactly what one
``index_add_`` per chunk gives, so the bits are those of the torch paths below on every rank.

* :func:`merge_sum`: the coalesced sum of sorted chunks (what :func:`.chunk.add_chunks` returns), by a
  P-way heap merge;
* :func:`average_into`: the average written straight into a dense output, ``out[i] = sum_i / P`` on the
  union and zero elsewhere, by one ordered sweep over the output in blocks of 4096 elements that also
  zeroes what the previous call wrote (its :class:`GroupMask`), divides on the way and counts the
  non-zero results. A block with little to touch is written in place (only the cache lines of a stale
  group or a received index, each fetched once); a fuller one is built in an L1 scratch block and
  streamed out whole (one write per cache line, no read of the output).

* :func:`average_blocks_into`: the same for one chunk made of whole blocks, given by their ids and a block
  size (OmniReduce's and S2 Reducer's results), without the index of every element.

Beside them, the count-sketch kernels of S2 Reducer's decompression (:func:`sketch_insert`,
:func:`sketch_query_blocks`; :class:`sparsecomm.selection.sketch.CountSketch` calls them): sixteen
indices hashed at a time where the CPU has AVX-512, eight where it has AVX2, else one by one, all with
the same bits (:func:`sketch_variants`; the fastest by default).

The merges fall back to torch operations (the same bits) for CUDA tensors, half-precision values, mixed
dtypes, unsorted chunks, or where the extension is not built: ``index_add_`` of one chunk after the
other (deterministic even with CUDA's atomics, the positions of one sorted unique chunk being
distinct) and a division of the touched entries.

Cost of :func:`average_into` on the C path, for ``m`` received pairs over ``n`` elements: one
sequential read of the pairs (and of the indices for the order and range check) and, per block, its
touched cache lines or one streaming write of it: at most about one write of the output plus the
pairs, however many chunks; ``O(n / 4096 + m)`` operations.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..core.optional import compiled_extension
from . import triton_merge

__all__ = ["merge_sum", "average_into", "average_sorted_into", "average_blocks_into", "clear", "GroupMask", "Stale",
           "GROUP", "ascending",
           "strictly_increasing", "compiled", "IN_PLACE_SHARE", "sketch_insert", "sketch_query_blocks",
           "sketch_variants", "members", "nonzero_positions"]

log = logging.getLogger(__name__)

#: the optional C extension (built by setup.py where a compiler is found: else None), refused when
#: built from other sources than the _merge.c beside it
_compiled: Any = compiled_extension(__package__, "_merge")

_VALUE_TYPES = (torch.float32, torch.float64)
_INDEX_TYPES = (torch.int32, torch.int64)
_MAX_CHUNKS = 4096
#: elements per bit of a :class:`GroupMask` (as in _merge.c)
GROUP = 16
#: the sweep writes a block of the output in place when the groups it must touch are at most this share
#: of the block's groups, else it streams the whole block out (_merge.c's DENSE_NUM / DENSE_DEN; the
#: simulator models the sweep's memory traffic with it)
IN_PLACE_SHARE = _compiled.DENSE_NUM / _compiled.DENSE_DEN if _compiled is not None else 1 / 6


def compiled() -> bool:
    """Whether the C merge is built here (else every merge takes its torch path)."""
    return _compiled is not None


def _mergeable(indices: Sequence[Tensor], values: Sequence[Tensor], value_dtype: torch.dtype) -> bool:
    """Whether the C merge can take these chunks: CPU, contiguous, one index and one value dtype."""
    if _compiled is None or not indices or len(indices) > _MAX_CHUNKS or value_dtype not in _VALUE_TYPES:
        return False
    index_dtype = indices[0].dtype
    return index_dtype in _INDEX_TYPES and all(
        i.device.type == "cpu" and v.device.type == "cpu" and i.dtype == index_dtype and v.dtype == value_dtype
        and i.is_contiguous() and v.is_contiguous() and i.numel() == v.numel()
        for i, v in zip(indices, values, strict=True))


def _pointers(indices: Sequence[Tensor], values: Sequence[Tensor]) -> tuple[list[int], list[int], list[int]]:
    return [i.data_ptr() for i in indices], [v.data_ptr() for v in values], [i.numel() for i in indices]


def ascending(indices: Tensor) -> Tensor:
    """``indices`` in increasing order: as they are when they already are (one compare over them,
    as most selectors return them), else sorted."""
    if indices.numel() < 2 or bool((indices[1:] >= indices[:-1]).all()):
        return indices
    return torch.sort(indices).values


def strictly_increasing(indices: Tensor) -> bool:
    """Whether ``indices`` are sorted and distinct (a coalesced chunk's): one compare over them."""
    return indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all())


def nonzero_positions(bitmap: Tensor) -> Tensor:
    """The increasing int64 positions of the non-zero entries of the 1-D ``bitmap``, as
    ``torch.nonzero(bitmap).reshape(-1)`` gives them: in C where it is a contiguous CPU vector of
    uint8 or int32 (a union bitmap of S2 Reducer or the sparse embeddings: a count, then the
    positions, eight bytes tested at a time), else by torch."""
    if (_compiled is not None and bitmap.device.type == "cpu" and bitmap.dim() == 1 and bitmap.is_contiguous()
            and bitmap.dtype in (torch.uint8, torch.int32)):
        itemsize = bitmap.element_size()
        count = _compiled.nonzero_positions(bitmap.data_ptr(), bitmap.numel(), itemsize, 0)
        positions = torch.empty(count, dtype=torch.int64)
        _compiled.nonzero_positions(bitmap.data_ptr(), bitmap.numel(), itemsize, positions.data_ptr())
        return positions
    return torch.nonzero(bitmap).reshape(-1)


def members(indices: Tensor, sorted_set: Tensor) -> Tensor:
    """Bool mask of the entries of ``indices`` that occur in ``sorted_set`` (both 1-D integer tensors
    in increasing order): on the CPU one walk over both in C (O(len + len), sequential), else (or
    where ``indices`` turns out unsorted) a binary search per entry (``torch.searchsorted``), the same
    mask; no length-n mark vector either way."""
    if sorted_set.numel() == 0 or indices.numel() == 0:
        return torch.zeros(indices.numel(), dtype=torch.bool, device=indices.device)
    if (_compiled is not None and all(t.device.type == "cpu" and t.dtype in _INDEX_TYPES and t.is_contiguous()
                                      and t.dim() == 1 for t in (indices, sorted_set))):
        mask = torch.empty(indices.numel(), dtype=torch.bool)
        if _compiled.members(indices.data_ptr(), indices.numel(), indices.dtype == torch.int64,
                             sorted_set.data_ptr(), sorted_set.numel(), sorted_set.dtype == torch.int64,
                             mask.data_ptr()) == 0:
            return mask
    wanted = sorted_set.to(indices.dtype)
    at = torch.searchsorted(wanted, indices).clamp_(max=wanted.numel() - 1)
    return wanted[at] == indices


def merge_sum(indices: Sequence[Tensor], values: Sequence[Tensor]) -> tuple[Tensor, Tensor] | None:
    """(sorted unique indices, their sums in chunk order) of chunks whose indices are each sorted
    (repeats allowed), or ``None`` where the C merge does not apply (the caller's torch path does).

    The sums are bit-identical to one ``index_add_`` per chunk, in order, into zeros.
    """
    if not _mergeable(indices, values, values[0].dtype if values else torch.float32):
        return None
    total = sum(i.numel() for i in indices)
    out_indices = torch.empty(total, dtype=indices[0].dtype)
    out_values = torch.empty(total, dtype=values[0].dtype)
    count = _compiled.merge_sum(*_pointers(indices, values), indices[0].dtype == torch.int64,
                                values[0].dtype == torch.float64, out_indices.data_ptr(), out_values.data_ptr())
    if count < 0:  # a chunk out of order: the torch path sorts
        return None
    return out_indices[:count], out_values[:count]


class GroupMask:
    """Where an output written by :func:`average_into` may be non-zero: one bit per group of
    :data:`GROUP` consecutive elements (``words``: int64, bit ``g % 64`` of word ``g // 64`` for group
    ``g``), the output being zero outside the marked groups. About n/128 bytes; the C merge reads it to
    zero the last call's entries and rewrites it in place with this call's."""

    __slots__ = ("words", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self.words = torch.zeros(((n + GROUP - 1) // GROUP + 63) // 64, dtype=torch.int64)

    def indices(self) -> Tensor:
        """The int64 indices of every element of the marked groups (for a torch-side zeroing)."""
        bits = (self.words.unsqueeze(1) >> torch.arange(64)) & 1
        groups = torch.nonzero(bits.reshape(-1)).reshape(-1)
        elements = (groups.unsqueeze(1) * GROUP + torch.arange(GROUP)).reshape(-1)
        return elements[elements < self.n]


#: what a caller knows of the output tensor before :func:`average_into` writes it: where it may be
#: non-zero (``None``: nowhere, ``"all"``: anywhere, an index tensor, or the :class:`GroupMask` that the
#: previous call on it returned)
Stale = Tensor | GroupMask | Literal["all"] | None


def clear(out: Tensor, stale: Stale) -> None:
    """Zero ``out`` wherever ``stale`` says it may be non-zero (torch operations)."""
    if isinstance(stale, GroupMask):
        stale = stale.indices().to(out.device) if stale.n == out.numel() else "all"
    if isinstance(stale, Tensor):
        out.index_fill_(0, stale.to(device=out.device, dtype=torch.int64), 0)
    elif stale is not None:
        out.zero_()


def _mask_for_sweep(out: Tensor, stale: Stale) -> tuple[GroupMask, int]:
    """The :class:`GroupMask` the C sweep rewrites for ``out`` and the sweep's mode for ``stale``: 1 to
    zero the groups marked in that mask (``stale`` itself, for this ``out``), 2 to zero everything not
    written (``stale`` anywhere: ``"all"`` or another output's mask), 0 when nothing is stale. An index
    tensor is zeroed here first (mode 0)."""
    mask = stale if isinstance(stale, GroupMask) and stale.n == out.numel() else GroupMask(out.numel())
    if isinstance(stale, Tensor):
        clear(out, stale)
        return mask, 0
    return mask, 1 if mask is stale else 2 if stale is not None else 0


def average_into(out: Tensor, indices: Sequence[Tensor], values: Sequence[Tensor], divisor: int, *,
                 stale: Stale = None, keep_sign: bool = False) -> tuple[Tensor | GroupMask, int | None]:
    """Make ``out`` the average of the chunks: ``out[i] = (start + the chunks' values at i, in chunk
    order) / divisor`` at every index ``i`` of the chunks, and zero everywhere else.

    ``stale`` says where ``out`` may be non-zero before the call (see :data:`Stale`); those entries are
    zeroed on the way, in the same sweep on the C path. ``start`` is ``+0.0`` (what ``index_add_`` into
    zeros gives) or, with ``keep_sign``, ``-0.0`` (the first value itself: ``out[i] = v / divisor`` for a
    chunk of unique indices, as an assignment gives, signed zeros kept).

    Returns (where ``out`` may now be non-zero, the non-zero results or ``None``): on the C path a
    :class:`GroupMask` (``stale`` itself, rewritten, when it was one for this ``out``) and the exact count
    of non-zero results, taken while writing; on the torch path the int64 indices as received (repeats
    possible) and ``None`` (whoever needs the count counts). Pass the first back as ``stale`` on the next
    call on the same ``out`` if nothing wrote into ``out`` since. The result is bit-identical either way.
    """
    n = out.numel()
    if out.is_contiguous() and out.device.type == "cpu" and _mergeable(indices, values, out.dtype):
        mask, mode = _mask_for_sweep(out, stale)
        status, nonzero = _compiled.merge_average(*_pointers(indices, values), indices[0].dtype == torch.int64,
                                                  out.dtype == torch.float64, out.data_ptr(), n, float(divisor),
                                                  keep_sign, mask.words.data_ptr(), mode)
        if status == -2:
            raise IndexError(f"average_into: an index lies outside the output of {n} elements")
        if status == 0:
            return mask, nonzero
    clear(out, stale)
    touched = [idx.long() for idx in indices]
    union = torch.cat(touched) if touched else torch.empty(0, dtype=torch.int64, device=out.device)
    if keep_sign:
        out.index_fill_(0, union, -0.0)
    for idx, vals in zip(touched, values, strict=True):
        out.index_add_(0, idx, vals.to(out.dtype))
    if divisor != 1 and union.numel():
        out[union] = out[union].div_(divisor)  # repeats write the same quotient again
    return union, None


def average_sorted_into(out: Tensor, indices: Sequence[Tensor], values: Sequence[Tensor], divisor: int, *,
                        stale: Stale = None, keep_sign: bool = False) -> tuple[Tensor | GroupMask, int | None]:
    """:func:`average_into` for chunks whose indices are each strictly increasing (the caller
    guarantees it: the senders sort their selections), with the same result, bits and return values.

    On a CUDA ``out`` (float32, float32 values, at most :data:`~.triton_merge.MAX_CHUNKS` chunks) the
    merge is one Triton kernel (:func:`.triton_merge.average_sorted_into`: each block of the output
    adds its entries chunk after chunk and divides each touched entry once), after zeroing ``stale``:
    no host synchronization, four launches (the zeroing, the two concatenations, the kernel) where
    the torch path makes ``P + 4``. Elsewhere :func:`average_into` (the C merge on the CPU)."""
    if not out.is_cuda or not triton_merge.applies(out, indices, values):
        return average_into(out, indices, values, divisor, stale=stale, keep_sign=keep_sign)
    clear(out, stale)
    return triton_merge.average_sorted_into(out, indices, values, divisor, keep_sign=keep_sign), None


def average_blocks_into(out: Tensor, blocks: Tensor, block_size: int, values: Tensor, divisor: int, *,
                        stale: Stale = None, keep_sign: bool = False) -> tuple[Tensor | GroupMask, int | None]:
    """:func:`average_into` of one chunk made of whole blocks: element ``blocks[b] * block_size + j``
    (for ``j < block_size``, those below ``out.numel()``) takes ``values[b, j]`` (``values``: ``(len(blocks),
    block_size)``), everything else is zero. ``blocks``: strictly increasing block ids. Same result, bits
    and return values as :func:`average_into` given the index of every element, which the C path never
    builds: it writes the blocks and zeroes the stale groups (or, with ``stale="all"``, the gaps), touching
    only those."""
    n = out.numel()
    values = values.reshape(blocks.numel(), block_size)
    if (_compiled is not None and out.is_contiguous() and out.device.type == "cpu" and out.dtype in _VALUE_TYPES
            and values.dtype == out.dtype and values.device.type == "cpu" and values.is_contiguous()
            and blocks.device.type == "cpu" and blocks.dtype in _INDEX_TYPES and blocks.is_contiguous()):
        mask, mode = _mask_for_sweep(out, stale)
        status, nonzero = _compiled.average_blocks(blocks.data_ptr(), blocks.numel(), blocks.dtype == torch.int64,
                                                   block_size, values.data_ptr(), out.dtype == torch.float64,
                                                   out.data_ptr(), n, float(divisor), keep_sign,
                                                   mask.words.data_ptr(), mode)
        if status == -2:
            raise IndexError(f"average_blocks_into: a block lies outside the output of {n} elements")
        if status == 0:
            return mask, nonzero
    elements = blocks.long().unsqueeze(1) * block_size + torch.arange(block_size, device=blocks.device)
    inside = elements < n
    if not bool((blocks[1:] > blocks[:-1]).all()):
        order = torch.argsort(blocks)
        elements, inside, values = elements[order], inside[order], values[order]
    return average_into(out, [elements[inside]], [values[inside]], divisor, stale=stale, keep_sign=keep_sign)


#: the sketch kernels' variants this CPU runs, fastest first (asked once: the CPU does not change)
_SKETCH_VARIANTS: list[str] = list(_compiled.sketch_variants()) if _compiled is not None else []


def sketch_variants() -> list[str]:
    """The sketch kernels' variants this CPU runs, fastest first (``"avx512"``: sixteen lanes, ``"avx2"``:
    eight, ``"scalar"``: one); empty where the extension is not built. All give the same bits."""
    return list(_SKETCH_VARIANTS)


def _sketch_variant(variant: str | None) -> str:
    if variant is None:
        return _SKETCH_VARIANTS[0]
    if variant not in _SKETCH_VARIANTS:
        raise ValueError(f"sketch variant={variant!r} does not run here: choose one of {_SKETCH_VARIANTS}")
    return variant


def _sketch_args(keys: tuple[int, int, int, Sequence[int], Sequence[int], Sequence[int]]) -> tuple:
    cols, mask, shift, a, b, c = keys
    return int(cols), int(mask), int(shift), list(a), list(b), list(c)


def sketch_insert(keys: tuple[int, int, int, Sequence[int], Sequence[int], Sequence[int]], table: Tensor,
                  indices: Tensor, values: Tensor, variant: str | None = None) -> bool:
    """For :meth:`~sparsecomm.selection.sketch.CountSketch.insert` (``keys``: its columns, mask, shift and
    the multiply-xorshift keys a, b, c of the bucket mixers then the sign mixers): add ``values * sign``
    at each index's bucket of each row of ``table`` (rows x cols, contiguous), row by row, indices in
    order, the bits of ``index_add_``. Returns False, having done nothing, where the C kernel does not
    apply (the caller's torch path does). ``variant``: one of :func:`sketch_variants` (default the
    fastest)."""
    if not (_compiled is not None and table.device.type == "cpu" and table.is_contiguous()
            and table.dtype in _VALUE_TYPES and values.dtype == table.dtype and values.device.type == "cpu"
            and values.is_contiguous() and indices.device.type == "cpu" and indices.dtype in _INDEX_TYPES
            and indices.is_contiguous() and indices.numel() == values.numel()):
        return False
    _compiled.sketch_insert(*_sketch_args(keys), indices.data_ptr(), indices.numel(),
                            indices.dtype == torch.int64, values.data_ptr(), table.dtype == torch.float64,
                            table.data_ptr(), _sketch_variant(variant))
    return True


def sketch_query_blocks(keys: tuple[int, int, int, Sequence[int], Sequence[int], Sequence[int]], table: Tensor,
                        blocks: Tensor, block_size: int, n: int, variant: str | None = None) -> Tensor | None:
    """For :meth:`~sparsecomm.selection.sketch.CountSketch.query_blocks`: the estimate of every element of
    the blocks (``(len(blocks), block_size)``, 0 past ``n``; ``blocks`` inside ``[0, ceil(n / block_size))``),
    or ``None`` where the C kernel does not apply. ``variant`` as for :func:`sketch_insert`."""
    if not (_compiled is not None and table.device.type == "cpu" and table.is_contiguous()
            and table.dtype in _VALUE_TYPES and blocks.device.type == "cpu" and blocks.dtype in _INDEX_TYPES
            and blocks.is_contiguous()):
        return None
    out = torch.empty(blocks.numel(), block_size, dtype=table.dtype)
    _compiled.sketch_query_blocks(*_sketch_args(keys), blocks.data_ptr(), blocks.numel(),
                                  blocks.dtype == torch.int64, block_size, n, table.data_ptr(),
                                  table.dtype == torch.float64, out.data_ptr(), _sketch_variant(variant))
    return out
