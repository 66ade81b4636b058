"""Memory passes over ``|x|`` shared by the selectors: the building blocks that make them fast on CPU.

On CPU a selector's time is its number of passes over the input (25M floats: ~12 ms per pass here),
so every selector is written as few passes as possible:

1. ``|x|`` into a reused buffer (:class:`Scratch`; fresh 100 MB buffers would page-fault every call);
2. a threshold *floor* estimated from a strided sample of ``|x|`` (:func:`sample_floor`), placed so
   that more than the wanted count of elements lie above it with high probability;
3. one compare-and-compact pass gathering the *candidates* ``|x| >= floor`` (:class:`MagnitudeView`).

After that, the threshold searches of the papers (RedSync Algorithms 2 and 3, MSTopK) run on the
candidates only: a count at a threshold at or above the floor is exact and costs O(#candidates); at a
threshold below the floor the count is at least #candidates, which is all those searches need to know
as long as #candidates exceeds their target, and otherwise a full pass gives the exact count. The
results are therefore exactly those of the algorithms as written, only cheaper.

Index extraction uses a word trick: the boolean mask is viewed as int64 words, ``nonzero`` runs on
the 8x shorter word array, and only the words holding a hit are expanded (6x faster than ``nonzero``
on the mask at 0.1% density).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Scratch", "MagnitudeView", "sample_floor"]

#: a sample is used when it is at most this fraction of the input; below, the input is scanned whole
_MAX_SAMPLE_FRACTION = 1 / 8


class Scratch:
    """Reusable buffers for inputs of one size, dtype and device: ``|x|`` and a padded bool mask.

    A selector owns one; buffers are reallocated only when the input's size, dtype or device changes.
    """

    def __init__(self) -> None:
        self._abs: Optional[Tensor] = None
        self._mask: Optional[Tensor] = None  # length rounded up to a multiple of 8, tail always False

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
        if mask is None or mask.numel() < a.numel() or mask.device != a.device:
            raise RuntimeError("Scratch.magnitudes(x) must be called before a pass over |x|")
        torch.ge(a, t, out=mask[: a.numel()])
        return mask

    def count_ge(self, a: Tensor, t: float) -> int:
        """#{i : a[i] >= t} for ``a`` returned by :meth:`magnitudes` (one pass)."""
        return int(torch.count_nonzero(self._mask_ge(a, t)))

    def indices_ge(self, a: Tensor, t: float) -> Tensor:
        """Increasing int64 indices of ``a >= t`` (one compare pass, then ``nonzero`` on int64 words)."""
        mask = self._mask_ge(a, t)
        words = torch.nonzero(mask.view(torch.int64)).squeeze(1)
        row, col = torch.nonzero(mask.view(-1, 8).index_select(0, words), as_tuple=True)
        return words.index_select(0, row).mul_(8).add_(col)


def sample_floor(a: Tensor, count: int, *, min_hits: int = 256, sigmas: float = 4.0) -> Optional[float]:
    """A threshold with more than ``count`` elements of ``a`` at or above it, with high probability.

    Takes a strided sample of ``a`` large enough to hold about ``min_hits`` elements above the
    ``count``-th largest value, and returns the sample's order statistic ``sigmas`` standard deviations
    (binomial) below that. Returns ``None`` when such a sample would not be much smaller than ``a``
    (the caller then scans ``a`` whole). The answer is a guess: callers check the real count.
    """
    n = a.numel()
    if count <= 0 or count >= n:
        return None
    size = math.ceil(min_hits * n / count)
    if size > n * _MAX_SAMPLE_FRACTION:
        return None
    sample = a[:: n // size]
    hits = count * sample.numel() / n
    rank = min(sample.numel(), int(hits + sigmas * math.sqrt(hits)) + 2)
    return float(torch.topk(sample, rank, sorted=False).values.min())


class MagnitudeView:
    """Exact counts and index sets of ``a >= t`` for ``a = |x|``, cheap at thresholds above a floor.

    Built with one compare-and-compact pass gathering the candidates ``a >= floor`` (with
    ``floor=None`` every element is a candidate and nothing is gathered).
    """

    def __init__(self, a: Tensor, scratch: Scratch, floor: Optional[float]) -> None:
        self.a = a
        self.scratch = scratch
        self.floor = floor
        if floor is None:
            self.indices: Optional[Tensor] = None
            self.values = a
        else:
            self.indices = scratch.indices_ge(a, floor)
            self.values = a.index_select(0, self.indices)

    @property
    def n_candidates(self) -> int:
        return self.values.numel()

    def _covers(self, t: float) -> bool:
        return self.floor is None or t >= self.floor

    def max(self) -> float:
        """max |x| (from the candidates, which hold it, when there are any)."""
        return float((self.values if self.n_candidates else self.a).max())

    def count(self, t: float) -> int:
        """Exact #{a >= t}; a full pass when ``t`` is below the floor."""
        if self._covers(t):
            return int(torch.count_nonzero(self.values >= t))
        return self.scratch.count_ge(self.a, t)

    def count_exceeds(self, t: float, m: int) -> Tuple[bool, int]:
        """``(count(t) > m, count)``; without a pass when ``t`` is below the floor and the candidates
        alone exceed ``m`` (then the returned count is only the lower bound #candidates)."""
        if not self._covers(t) and self.n_candidates > m:
            return True, self.n_candidates
        c = self.count(t)
        return c > m, c

    def _global(self, positions: Tensor) -> Tensor:
        return positions if self.indices is None else self.indices.index_select(0, positions)

    def indices_ge(self, t: float) -> Tensor:
        """Increasing indices of ``a >= t``."""
        if self._covers(t):
            return self._global(torch.nonzero(self.values >= t).squeeze(1))
        return self.scratch.indices_ge(self.a, t)

    def indices_between(self, lo: float, hi: float) -> Tensor:
        """Increasing indices of ``lo <= a < hi``."""
        if self._covers(lo):
            v = self.values
            return self._global(torch.nonzero((v >= lo) & (v < hi)).squeeze(1))
        idx = self.scratch.indices_ge(self.a, lo)
        return idx[self.a.index_select(0, idx) < hi]

    def topk_at_or_above(self, t: float, k: int) -> Tensor:
        """Indices of the ``k`` largest elements among ``a >= t`` (needs ``count(t) >= k``).

        When ``t`` is at or below the floor and the candidates number at least ``k``, the candidates
        hold the ``k`` largest elements of all of ``a``, so they answer without a pass.
        """
        if self.floor is not None and t <= self.floor and self.n_candidates >= k:
            return self._global(torch.topk(self.values, k, sorted=False).indices)
        if self._covers(t):
            positions = torch.nonzero(self.values >= t).squeeze(1)
            best = torch.topk(self.values.index_select(0, positions), k, sorted=False).indices
            return self._global(positions.index_select(0, best))
        idx = self.scratch.indices_ge(self.a, t)
        return idx.index_select(0, torch.topk(self.a.index_select(0, idx), k, sorted=False).indices)
