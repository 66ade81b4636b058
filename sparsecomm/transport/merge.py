"""Decompression in one ordered pass: the P sorted chunks a rank receives, merged instead of sorted.

Every sparse method ends by adding the chunks it received index by index, in rank order, and (for
its result) dividing each sum by P. Each chunk's indices arrive sorted (the senders sort their
selections), so on the CPU the union is a P-way merge (:mod:`._merge`, a C extension built at
install): every index's sum is accumulated as ``0 + v_0 + v_1 + ...`` in chunk order, exactly what
one ``index_add_`` per chunk gives, so the bits are those of the torch paths below on every rank.

* :func:`merge_sum`: the coalesced sum of sorted chunks (what :func:`.chunk.add_chunks` returns);
* :func:`average_into`: the average written straight into a dense output, ``out[i] = sum_i / P``
  at every index of the union (one write per index, the division on the way), returning the sorted
  union and the number of non-zero results, so no caller sorts or counts again.

Both fall back to torch operations (the same bits) for CUDA tensors, half-precision values, mixed
dtypes, unsorted chunks, or where the extension is not built: ``index_add_`` of one chunk after the
other (deterministic even with CUDA's atomics, the positions of one sorted unique chunk being
distinct) and a division of the touched entries.

Cost on the CPU path: one sequential read of the indices (the order and range check), then
``O(m log P)`` for ``m`` received pairs, one read of each pair and one write per output index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge_sum", "average_into", "ascending", "compiled"]

log = logging.getLogger(__name__)

try:
    from . import _merge as _compiled  # type: ignore[attr-defined]  # the optional C extension
except ImportError:  # built optionally (setup.py): no compiler at install time
    _compiled = None

_VALUE_TYPES = (torch.float32, torch.float64)
_INDEX_TYPES = (torch.int32, torch.int64)
_MAX_CHUNKS = 4096


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


def average_into(out: Tensor, indices: Sequence[Tensor], values: Sequence[Tensor],
                 divisor: int) -> tuple[Tensor, int | None]:
    """Write ``out[i] = (sum over the chunks, in order, of their values at i) / divisor`` at every
    index ``i`` of the chunks; returns (the int64 indices written, the non-zero results or None).

    ``out`` must be zero at those indices (the method's output buffer is). On the C path the indices
    come back sorted and unique and the non-zero count exact; on the torch path they may repeat
    (concatenated as received) and the count is ``None`` (whoever needs it counts). The result is
    bit-identical either way.
    """
    n = out.numel()
    if out.is_contiguous() and out.device.type == "cpu" and _mergeable(indices, values, out.dtype):
        total = sum(i.numel() for i in indices)
        written = torch.empty(total, dtype=torch.int64)
        count, nonzero = _compiled.merge_average(*_pointers(indices, values), indices[0].dtype == torch.int64,
                                                 out.dtype == torch.float64, out.data_ptr(), n, float(divisor),
                                                 written.data_ptr())
        if count == -2:
            raise IndexError(f"average_into: an index lies outside the output of {n} elements")
        if count >= 0:
            return written[:count], nonzero
    touched = []
    for idx, vals in zip(indices, values, strict=True):
        idx = idx.long()
        out.index_add_(0, idx, vals.to(out.dtype))
        touched.append(idx)
    union = torch.cat(touched) if touched else torch.empty(0, dtype=torch.int64, device=out.device)
    if divisor != 1 and union.numel():
        out[union] = out[union].div_(divisor)  # repeats write the same quotient again
    return union, None
