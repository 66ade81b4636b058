"""Block-wise top-K by L2 norm, S2 Reducer (Sparse-Sketch Reducer) section 2.2.

The vector is cut into consecutive blocks of ``block_size`` elements (the last may be shorter); the
blocks with the largest L2 norm are selected whole. ``ceil(k / block_size)`` blocks are taken, one
more if the short last block is among them and the count fell below ``k``, so the count lies in
``[k, k + block_size - 1]``. The indices come block after block, in increasing order.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.validate import check_int
from .base import Selector, assert_finite
from .exact import TopK
from .registry import register_selector
from .scan import compiled_block_energies

__all__ = ["BlockTopK", "block_sum", "gather_blocks", "zero_blocks"]


#: elements squared at a time by :meth:`BlockTopK.block_energies` (on a GPU a chunk of 64K elements
#: is a few microseconds of work against tens of launch overhead: there it takes 4M at a time)
_CHUNK = 1 << 16
_CHUNK_CUDA = 1 << 22


@register_selector("block_topk")
class BlockTopK(Selector):
    """Whole blocks with the largest L2 norm: count in ``[k, k + block_size - 1]``.

    Args:
        block_size: elements per block (default 32).
    """

    def __init__(self, *, block_size: int = 32, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        check_int("block_topk: block_size", block_size, minimum=1)
        self.block_size = block_size
        self._squares: Tensor | None = None
        self._block_topk = TopK(check_finite=False)

    def block_energies(self, x: Tensor, addend: Tensor | None = None, dest: Tensor | None = None) -> Tensor:
        """Squared L2 norm of each block (float32 for half-precision input, which could overflow),
        summed in a canonical order (:func:`block_sum`), so that every implementation gives the same bits.

        With ``addend`` it is the energies of ``dest = x + addend`` (``dest``: ``x`` when ``None``), in
        one read of ``x`` and ``addend`` and one write of ``dest``: by the compiled kernel where it
        applies (:func:`~.scan.compiled_block_energies`), else chunk by chunk through a reused buffer of
        at most ``_CHUNK`` elements, each chunk added just before it is squared, while it is in cache
        (the selector keeps no gradient-sized buffer between calls)."""
        compiled = compiled_block_energies(x, self.block_size, addend, dest)
        if compiled is not None:
            return compiled
        dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        n, size = x.numel(), self.block_size
        chunk = max(size, (_CHUNK_CUDA if x.is_cuda else _CHUNK) // size * size)
        buf = self._squares
        if buf is None or buf.numel() < min(chunk, n) or buf.dtype != dtype or buf.device != x.device:
            self._squares = buf = torch.empty(min(chunk, n), dtype=dtype, device=x.device)
        energies = torch.empty(math.ceil(n / size), dtype=dtype, device=x.device)
        target = x if dest is None else dest
        for start in range(0, n, chunk):
            part = x[start:start + chunk]
            if addend is not None:
                part = torch.add(part, addend[start:start + chunk], out=target[start:start + chunk])
            squares = torch.square(part.to(dtype), out=buf[:part.numel()])
            full = part.numel() // size
            first = start // size
            energies[first:first + full] = block_sum(squares[:full * size].view(full, size), size)
            if full * size < part.numel():
                energies[first + full] = block_sum(squares[full * size:].view(1, -1), size)[0]
        return energies

    def select(self, x: Tensor, k: int) -> Tensor:
        return self.elements(self.select_blocks(x, k), x.numel())

    def select_blocks(self, x: Tensor, k: int) -> Tensor:
        """The ids of the selected blocks, in increasing order, for ``k >= 1`` (every block when ``k >= n``)."""
        return self._largest_blocks(x, self.block_energies(x), k)

    def accumulate_blocks(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None = None) -> Tensor:
        """``dest = x + addend`` (``dest``: ``x`` when ``None``), then :meth:`select_blocks` of it, in one
        read of each vector (:meth:`block_energies` adds chunk by chunk)."""
        return self._largest_blocks(x if dest is None else dest, self.block_energies(x, addend, dest), k)

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        return self.elements(self.accumulate_blocks(x, addend, k, dest), x.numel())

    def elements(self, blocks: Tensor, n: int) -> Tensor:
        """The int64 indices of the elements of ``blocks`` below ``n``, block after block."""
        size = self.block_size
        offsets = torch.arange(size, dtype=torch.int64, device=blocks.device)
        indices = (blocks.unsqueeze(1) * size + offsets).flatten()
        return indices[indices < n] if n % size else indices

    def _largest_blocks(self, x: Tensor, energies: Tensor, k: int) -> Tensor:
        n, size = x.numel(), self.block_size
        if self.check_finite and not math.isfinite(float(energies.sum())):
            assert_finite(x, self.name)  # raises on NaN/Inf; a finite input only overflowed the sum
        if k >= n:
            return torch.arange(energies.numel(), dtype=torch.int64, device=x.device)
        n_blocks = math.ceil(k / size)
        blocks = self._block_topk(energies, n_blocks)
        short = (size - n % size) % size  # elements the last block lacks
        if short and n_blocks * size - short < k and bool((blocks == energies.numel() - 1).any()):
            blocks = self._block_topk(energies, n_blocks + 1)
        return torch.sort(blocks).values


def block_sum(rows: Tensor, size: int) -> Tensor:
    """The sum of each row of ``rows`` (blocks of at most ``size`` elements) in the canonical pairwise
    order of the block energies: the row padded with +0.0 to the power of two ``w >= size``, then, while
    ``w > 1``, element ``i`` added to element ``i + w/2`` for ``i < w/2``. The compiled kernel sums in the
    same order, so both give the same bits (``row.sum()`` would leave the order to the backend)."""
    width = 1 << max(0, size - 1).bit_length()
    if rows.shape[1] < width:
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]))
    while width > 1:
        width //= 2
        rows = rows[:, :width] + rows[:, width:2 * width]
    return rows[:, 0]


def _split(x: Tensor, blocks: Tensor, size: int) -> tuple[Tensor, Tensor, int]:
    """(``x``'s whole blocks as rows, the ids among ``blocks`` of whole blocks, the length of the short
    last block if ``blocks`` ends with it, else 0). ``blocks``: increasing ids."""
    whole = x.numel() // size
    tail = x.numel() - whole * size
    short = tail if tail and blocks.numel() and int(blocks[-1]) == whole else 0
    return x[:whole * size].view(whole, size), blocks[:-1] if short else blocks, short


def gather_blocks(x: Tensor, blocks: Tensor, size: int) -> Tensor:
    """The values of the blocks of ``size`` elements with the (increasing) ids ``blocks``, as a
    ``(len(blocks), size)`` tensor, zero past the end of ``x``."""
    rows, ids, short = _split(x, blocks, size)
    if not short:
        return rows.index_select(0, ids)
    values = torch.zeros(blocks.numel(), size, dtype=x.dtype, device=x.device)
    values[:-1] = rows.index_select(0, ids)
    values[-1, :short] = x[x.numel() - short:]
    return values


def zero_blocks(x: Tensor, blocks: Tensor, size: int) -> None:
    """Zero the blocks of ``size`` elements with the (increasing) ids ``blocks`` in ``x``."""
    rows, ids, short = _split(x, blocks, size)
    rows.index_fill_(0, ids, 0)
    if short:
        x[x.numel() - short:] = 0
