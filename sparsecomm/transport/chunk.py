"""Sparse chunks: global indices + values, the unit every sparse method sends.

Indices are int32 while the gradient length n < 2**31 (half the bytes of int64), else int64. A chunk
is *coalesced* when its indices are unique and sorted; :func:`add_chunks` returns coalesced chunks,
so the same inputs give the same output bit for bit on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .merge import merge_sum, strictly_increasing

__all__ = ["SparseChunk", "index_dtype", "pair_bytes", "add_chunks", "as_bytes", "bytes_as"]

_INT32_LIMIT = 2 ** 31


def index_dtype(n: int) -> torch.dtype:
    """int32 while every index of an n-element gradient fits, else int64."""
    return torch.int32 if n < _INT32_LIMIT else torch.int64


def pair_bytes(n: int, value: int | torch.dtype) -> int:
    """Bytes of one (index, value) pair of an n-element gradient: the index dtype's size plus the
    value's (``value`` an item size in bytes or a dtype)."""
    value_size = value.itemsize if isinstance(value, torch.dtype) else int(value)
    return index_dtype(n).itemsize + value_size


@dataclass
class SparseChunk:
    """Global ``indices`` (1-D integer) and their ``values`` (1-D float), the same length."""

    indices: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.indices.dim() != 1 or self.values.dim() != 1 or self.indices.numel() != self.values.numel():
            raise ValueError(f"SparseChunk needs 1-D indices and values of one length, got shapes "
                             f"{tuple(self.indices.shape)} and {tuple(self.values.shape)}")

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device=None) -> SparseChunk:
        return cls(torch.empty(0, dtype=index_dtype(n), device=device), torch.empty(0, dtype=dtype, device=device))

    @classmethod
    def gather(cls, dense: torch.Tensor, indices: torch.Tensor, offset: int = 0,
               n: int | None = None) -> SparseChunk:
        """The entries of ``dense`` at local ``indices``, stored with global index ``offset + i``."""
        n = dense.numel() + offset if n is None else n
        idx = indices.to(index_dtype(n))
        values = dense.index_select(0, indices)  # several times faster than dense[indices] on CPU
        return cls(idx + offset if offset else idx, values)

    def scatter_add_(self, dense: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Add the values into ``dense`` at ``indices - offset``; returns ``dense``."""
        idx = self.indices.long()
        if offset:
            idx = idx - offset
        dense.index_add_(0, idx, self.values.to(dense.dtype))
        return dense

    def to_dense(self, n: int, offset: int = 0) -> torch.Tensor:
        return self.scatter_add_(torch.zeros(n, dtype=self.values.dtype, device=self.values.device), offset)

    def select(self, mask: torch.Tensor) -> SparseChunk:
        """The pairs where the bool ``mask`` is true, in order: the chunk itself where it is true
        everywhere, else one ``nonzero`` for both tensors (boolean indexing would take one each)."""
        if bool(mask.all()):
            return self
        keep = torch.nonzero(mask).squeeze(1)
        return SparseChunk(self.indices.index_select(0, keep), self.values.index_select(0, keep))

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors that travel: (indices, values)."""
        return self.indices, self.values

    @classmethod
    def from_bytes(cls, block: torch.Tensor, index: torch.dtype, value: torch.dtype) -> SparseChunk:
        """The chunk whose :meth:`parts` were sent back to back as the ``uint8`` ``block``
        (:func:`bytes_as`: views where aligned)."""
        pair = index.itemsize + value.itemsize
        if block.numel() % pair:
            raise ValueError(f"a block of {block.numel()} bytes is not a whole number of ({index}, {value}) pairs")
        cut = block.numel() // pair * index.itemsize
        return cls(bytes_as(block[:cut], index), bytes_as(block[cut:], value))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s raw bytes, flat (a ``uint8`` view of it, or of a contiguous copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def bytes_as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``uint8`` tensor ``part`` read as ``dtype``: a view where its start is aligned for ``dtype``,
    else a copy (e.g. float64 values behind an odd number of int32 indices)."""
    return part.view(dtype) if part.storage_offset() % dtype.itemsize == 0 else part.clone().view(dtype)


def add_chunks(chunks: Iterable[SparseChunk]) -> SparseChunk:
    """Sum chunks by index: the result is coalesced (unique, sorted indices).

    Deterministic on every device: the chunks are added one after another in the order given, each
    with one ``index_add_`` whose target positions are distinct when the chunk is coalesced (so even
    CUDA's atomic adds have one operand per position); every rank that adds the same chunks in the
    same order gets the same bits. On the CPU, chunks whose indices are sorted (as every sender's
    are) are merged instead (:func:`.merge.merge_sum`, one ordered pass, no sort), with the same bits.
    A single chunk that is already coalesced is its own sum: its indices are returned as they are
    (not copied) with its values plus +0.0, the same bits without the merge's pass.
    """
    chunks = list(chunks)
    if not chunks:
        raise ValueError("add_chunks needs at least one chunk")
    if len(chunks) == 1 and strictly_increasing(chunks[0].indices):
        # already coalesced: its sum is itself (0.0 + v, as index_add_ into zeros, turns -0.0 into +0.0)
        return SparseChunk(chunks[0].indices, chunks[0].values + 0.0)
    merged = merge_sum([c.indices for c in chunks], [c.values for c in chunks])
    if merged is not None:
        return SparseChunk(*merged)
    indices = torch.cat([c.indices for c in chunks])
    values = torch.cat([c.values for c in chunks])
    if indices.numel() == 0:
        return SparseChunk(indices, values)
    unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=values.dtype, device=values.device)
    start = 0
    for chunk in chunks:
        stop = start + chunk.nnz
        summed.index_add_(0, inverse[start:stop], values[start:stop])
        start = stop
    return SparseChunk(unique, summed)
