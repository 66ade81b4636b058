"""Count-sketch of a sparse vector, the building block of S2 Reducer ([S2Reducer],
section 3.1, Algorithm 1).

A :class:`CountSketch` with ``rows`` x ``cols`` buckets over index space ``[0, n)``: row j adds
``s_j(i) * g(i)`` into bucket ``h_j(i)`` (:meth:`CountSketch.insert`); a query returns
``median_j s_j(i) * S[j, h_j(i)]`` (:meth:`CountSketch.query`). The table is linear in g, so the
sum of the tables of P vectors is the table of their sum: an all-reduce of tables sketches the sum.

Hashes: ``h_j`` and ``s_j`` come from a keyed multiply-xorshift mixer that is a *bijection* on
``[0, 2^w)``, ``w = max(1, ceil(log2 n))``: ``h_j(i) = mix(i) mod cols``, ``s_j(i) = +-1`` from the low
bit of a second mix. Keys are drawn from ``seed`` only, so every rank that builds the sketch with the
same seed hashes identically (integer arithmetic: the same on every device). Because the mixer is a
bijection, a sketch with ``cols >= 2^w`` has no collision and answers every query exactly; a smaller
one gives estimates whose error is zero in expectation over the keys (each pair of indices collides
with probability about 1/cols, with random signs). The mixer is not a proven 2-universal family.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.validate import check_int
from ..transport.merge import sketch_insert, sketch_query_blocks

__all__ = ["CountSketch", "index_bits"]

_GOLDEN = 0x9E3779B97F4A7C15  # seeds the key stream of a sketch from its seed


def index_bits(n: int) -> int:
    """w: the number of bits of the mixer's domain ``[0, 2^w)``, which holds ``[0, n)``."""
    return max(1, (n - 1).bit_length())


class _Mixer:
    """A keyed bijection of ``[0, 2^w)``: x -> (x*a + b), x ^= x >> s, x *= c, x ^= x >> s (mod 2^w),
    a and c odd (invertible mod 2^w), each xorshift invertible."""

    def __init__(self, bits: int, gen: torch.Generator) -> None:
        self.mask = (1 << bits) - 1
        self.shift = max(1, bits // 2)
        limit = min(self.mask, 2 ** 31 - 1) + 1
        a, b, c = (int(v) for v in torch.randint(0, limit, (3,), generator=gen, dtype=torch.int64))
        self.a, self.b, self.c = a | 1, b, c | 1

    def __call__(self, x: Tensor) -> Tensor:
        mask = self.mask
        x = (x * self.a + self.b) & mask
        x = x ^ (x >> self.shift)
        x = (x * self.c) & mask
        return x ^ (x >> self.shift)


class CountSketch:
    """A rows x cols count-sketch of vectors of length n; tables are plain tensors (see module doc).

    Args:
        n: length of the sketched vectors (indices in ``[0, n)``).
        rows, cols: shape of the table (``rows`` estimates per query, median taken).
        seed: determines every hash; equal seeds give equal hashes on every rank and device.
    """

    def __init__(self, n: int, rows: int, cols: int, seed: int) -> None:
        for name, value in (("n", n), ("rows", rows), ("cols", cols)):
            check_int(f"CountSketch: {name}", value, minimum=1)
        self.n, self.rows, self.cols = n, rows, cols
        gen = torch.Generator().manual_seed((int(seed) * _GOLDEN) % 2 ** 63)
        bits = index_bits(n)
        self._buckets: list[_Mixer] = [_Mixer(bits, gen) for _ in range(rows)]
        self._signs: list[_Mixer] = [_Mixer(bits, gen) for _ in range(rows)]

    @property
    def exact(self) -> bool:
        """True when no two indices of ``[0, n)`` share a bucket in any row (cols >= 2^w)."""
        return self.cols >= 1 << index_bits(self.n)

    def hashes(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """``(buckets, signs)``, each ``rows x len(indices)``: h_j(i) (int64) and s_j(i) (+-1, int64)."""
        idx = indices.to(torch.int64)
        buckets = torch.stack([mix(idx) % self.cols for mix in self._buckets])
        signs = torch.stack([1 - 2 * (mix(idx) & 1) for mix in self._signs])
        return buckets, signs

    def _keys(self) -> tuple:
        """(cols, mask, shift, a, b, c) for the C kernels: the keys of the bucket mixers, then the sign mixers."""
        mixers = self._buckets + self._signs
        first = mixers[0]
        return (self.cols, first.mask, first.shift, [m.a for m in mixers], [m.b for m in mixers],
                [m.c for m in mixers])

    def empty_table(self, dtype: torch.dtype, device=None) -> Tensor:
        return torch.zeros(self.rows, self.cols, dtype=dtype, device=device)

    def insert(self, table: Tensor, indices: Tensor, values: Tensor) -> Tensor:
        """Add ``values`` at ``indices`` into ``table`` (Algorithm 1 lines 3-7); returns ``table``.
        On the CPU a C kernel hashes and adds in one go (:func:`~sparsecomm.transport.merge.sketch_insert`,
        the same bits)."""
        if sketch_insert(self._keys(), table, indices, values):
            return table
        buckets, signs = self.hashes(indices)
        for row in range(self.rows):
            table[row].index_add_(0, buckets[row], values * signs[row].to(values.dtype))
        return table

    def query(self, table: Tensor, indices: Tensor) -> Tensor:
        """``median_j s_j(i) * table[j, h_j(i)]`` for each index (lines 10-15; the lower median when
        ``rows`` is even)."""
        buckets, signs = self.hashes(indices)
        estimates = torch.gather(table, 1, buckets) * signs.to(table.dtype)
        if self.rows == 1:
            return estimates[0]
        return estimates.median(dim=0).values

    def query_blocks(self, table: Tensor, blocks: Tensor, block_size: int) -> Tensor:
        """:meth:`query` of every element of the given blocks of ``block_size`` elements, as a
        ``(len(blocks), block_size)`` tensor (0 past n): the estimates of ``blocks[b] * block_size + j``.
        On the CPU a C kernel (:func:`~sparsecomm.transport.merge.sketch_query_blocks`, the same bits),
        without the index of every element."""
        blocks = blocks.reshape(-1)
        if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) * block_size >= self.n):
            raise IndexError(f"CountSketch.query_blocks: a block of {block_size} lies outside [0, {self.n})")
        estimates = sketch_query_blocks(self._keys(), table, blocks, block_size, self.n)
        if estimates is not None:
            return estimates
        elements = blocks.to(torch.int64).unsqueeze(1) * block_size + torch.arange(block_size, device=blocks.device)
        inside = elements < self.n
        estimates = torch.zeros(elements.shape, dtype=table.dtype, device=table.device)
        estimates[inside] = self.query(table, elements[inside])
        return estimates
