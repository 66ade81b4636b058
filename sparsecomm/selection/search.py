"""Threshold-search selectors: RedSync's threshold binary search (and its sampled variant) and MSTopK.

All three search thresholds of the form ``mean + ratio * (max - mean)`` of ``|x|`` by bisection on
``ratio`` in [0, 1]. Counts at thresholds above a sampled floor run on gathered candidates only
(:mod:`sparsecomm.selection.scan`): the visited thresholds and decisions are those of the papers'
algorithms, with fewer passes over memory.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.validate import check_int
from . import triton_select
from .base import Selector
from .registry import register_selector
from .scan import MagnitudeView, Scratch, device_plan, sample_floor

__all__ = ["BinarySearch", "SampledBinarySearch", "MSTopK"]

log = logging.getLogger(__name__)


class _Lookahead:
    """The counts a ratio bisection asks for, taken ``depth`` steps at a time on a GPU.

    A bisection of ``ratio`` over ``[lo, hi]`` visits, in its next ``depth`` steps, only midpoints of
    the dyadic subintervals of ``[lo, hi]``: ``2**depth - 1`` thresholds ``mean + ratio * (top - mean)``
    in all. Where each count costs a device round trip (:attr:`MagnitudeView.batched`), all of them
    are counted in one pass over the candidates and the bisection then replays its decisions from
    that table; elsewhere (the CPU) each step counts on the candidates as before. The ratios are
    dyadic, so they and the thresholds are computed exactly as the step-by-step loop computes them:
    the visited thresholds, counts and results are the same either way.
    """

    DEPTH = 10

    def __init__(self, view: MagnitudeView, mean: float, top: float) -> None:
        self.view, self.mean, self.top = view, mean, top
        self.batched = view.batched
        self.lo = self.hi = 0.0
        self.table: np.ndarray | None = None

    def count_exceeds(self, lo: float, hi: float, threshold: float, m: int) -> tuple:
        """``view.count_exceeds(threshold, m)`` for the step at ``ratio = lo + (hi - lo) / 2``."""
        if not self.batched:
            return self.view.count_exceeds(threshold, m)
        count = self._lookup(lo, hi)
        if count is None:
            self._fill(lo, hi)
            count = self._lookup(lo, hi)
        if count is None or count < 0:  # below the floor: the view answers (no pass when it can)
            return self.view.count_exceeds(threshold, m)
        return count > m, count

    def _fill(self, lo: float, hi: float) -> None:
        ratios = lo + (hi - lo) * _MIDPOINTS
        self.lo, self.hi = lo, hi
        self.table = self.view.counts(self.mean + ratios * (self.top - self.mean))

    def _lookup(self, lo: float, hi: float) -> int | None:
        if self.table is None or not (self.lo <= lo < hi <= self.hi):
            return None
        depth = round(math.log2((self.hi - self.lo) / (hi - lo)))
        position = round((lo - self.lo) / (hi - lo))
        if depth >= self.DEPTH:
            return None
        return int(self.table[2 ** depth - 1 + position])


def _dyadic_midpoints(depth: int) -> np.ndarray:
    """The midpoints of the dyadic subintervals of [0, 1] down to ``depth`` levels, level by level:
    position ``2**d - 1 + j`` holds ``(2 j + 1) / 2**(d + 1)``. ``lo + (hi - lo) * m`` is then exactly
    the value the step-by-step bisection computes (every term is a dyadic fraction of under 53 bits)."""
    position = np.arange(1, 2 ** depth, dtype=np.int64)
    level = np.floor(np.log2(position)).astype(np.int64)
    return (2 * (position - (1 << level)) + 1) / np.exp2(level + 1)


_MIDPOINTS = _dyadic_midpoints(_Lookahead.DEPTH)


def _band_search(view: MagnitudeView, k: int, eps: float) -> float | None:
    """RedSync Algorithm 3's loop: a threshold whose count lies in [k, 2k], or None if none found.

    Deviation from the paper's text: its line 9 lowers the threshold only when the count is below
    k/2 (and raises it for counts in [k/2, k), moving away from the band); here any count below k
    lowers it. The band is closed, [k, 2k], where the paper's is open.
    """
    mean, top = view.mean, view.max()
    lookahead = _Lookahead(view, mean, top)
    lo, hi = 0.0, 1.0
    while hi - lo > eps:
        ratio = lo + (hi - lo) / 2
        threshold = mean + ratio * (top - mean)
        too_many, count = lookahead.count_exceeds(lo, hi, threshold, 2 * k)
        if too_many:
            lo = ratio
        elif count < k:
            hi = ratio
        else:
            return threshold
    return None


@register_selector("binary_search")
class BinarySearch(Selector):
    """Threshold binary search, RedSync (Fang et al.) section 2.1, Algorithm 3: count in [k, 2k].

    Bisects ``ratio`` until ``#{|x| >= mean + ratio (max - mean)}`` lies in [k, 2k] and returns
    those indices, at least the k largest. The search stops when the bracket is narrower than
    ``eps`` (the paper's termination parameter); if no threshold of that form lands in the band
    (many ties, or ``k`` above the count at the mean), the selection is completed to exactly the
    top-k instead, so the count is always in [k, 2k].

    Args:
        eps: termination width of the ratio bracket (the paper leaves its value open; default 1e-4).
    """

    def __init__(self, *, eps: float = 1e-4, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        if not 0.0 < eps < 1.0:
            raise ValueError(f"{self.name or 'binary_search'}: eps must lie in (0, 1), got {eps!r}")
        self.eps = float(eps)
        self._scratch = Scratch()

    def _search(self, x: Tensor, k: int, addend: Tensor | None = None, dest: Tensor | None = None) -> tuple:
        """(indices, threshold or None when completed to exact top-k); with ``addend`` the search is of
        ``x + addend``, written to ``dest`` (default ``x``) by its first scan. On a GPU the whole
        search runs on the device (:func:`.triton_select.band_search`), the same thresholds visited."""
        if self._scratch.searches_on_device(x, addend, dest):
            try:
                return triton_select.band_search(x, k, self.eps, self._scratch.device_buffers,
                                                 device_plan(x.numel(), 2 * k), addend=addend, dest=dest,
                                                 check_finite=self.check_finite, name=self.name)
            except triton_select.Fallback as fallback:
                log.debug("%s: %s; the host path", self.name, fallback.reason)
                x, addend, dest = fallback.summed, None, None
        view = MagnitudeView(x, self._scratch, sample_floor(x, 2 * k, addend=addend), name=self.name,
                             check_finite=self.check_finite, count=2 * k, addend=addend, dest=dest)
        return self._search_view(view, k)

    def _search_view(self, view: MagnitudeView, k: int) -> tuple:
        """:meth:`_search` on a view whose candidates number more than 2k (or whose floor is None)."""
        threshold = _band_search(view, k, self.eps)
        if threshold is None:
            log.debug("%s: no threshold in [k, 2k] for k=%d; exact top-k instead", self.name, k)
            return view.topk_at_or_above(0.0, k), None
        return view.indices_ge(threshold), threshold

    def select(self, x: Tensor, k: int) -> Tensor:
        return self._search(x, k)[0]

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        """The addition in the search's first scan (the one that gathers the candidates)."""
        return self._search(x, k, addend, dest)[0]


@register_selector("sampled_binary_search")
class SampledBinarySearch(BinarySearch):
    """Sampled threshold binary search, RedSync section 2.1: count in [k, 2k].

    Runs :class:`BinarySearch` and reuses its threshold for the next ``interval - 1`` calls (the
    paper's empirical interval is 5), each then one pass. A reused threshold whose count leaves
    [k, 2k] (or a change of ``k`` or ``n``) triggers a new search at once, so the band always holds.
    When it selected more than 2k, the search runs on what that pass gathered (its sum, max and the
    elements above the reused threshold), with no pass of its own; when fewer than k, it scans again.

    State (``state_dict``): the threshold, the ``k`` and ``n`` it was searched for, and the number of
    calls since the search.
    """

    def __init__(self, *, interval: int = 5, eps: float = 1e-4, check_finite: bool = True) -> None:
        super().__init__(eps=eps, check_finite=check_finite)
        check_int("sampled_binary_search: interval", interval, minimum=1)
        self.interval = interval
        self.threshold: float | None = None
        self.searched_for = (0, 0)  # (k, n)
        self.calls_since_search = 0

    def select(self, x: Tensor, k: int) -> Tensor:
        return self._select(x, k)

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        """The addition in the first scan: the reused threshold's, or the search's."""
        return self._select(x, k, addend, dest)

    def _select(self, x: Tensor, k: int, addend: Tensor | None = None, dest: Tensor | None = None) -> Tensor:
        """:meth:`select` of ``x``, or with ``addend`` of ``x + addend``, written to ``dest`` (default
        ``x``) by the first scan; a search after a reused threshold failed scans the sum."""
        threshold, n = self.threshold, x.numel()
        if threshold is not None and self.searched_for == (k, n) and self.calls_since_search < self.interval:
            view = MagnitudeView(x, self._scratch, threshold, name=self.name, check_finite=self.check_finite,
                                 count=2 * k, addend=addend, dest=dest)
            count = view.n_candidates
            if k <= count <= 2 * k:
                self.calls_since_search += 1
                assert view.indices is not None  # a view with a floor holds its candidates
                return view.indices
            log.debug("%s: reused threshold gave %d outside [%d, %d]; searching", self.name, count, k, 2 * k)
            if count > 2 * k:  # the search's counts below the reused threshold are "too many": no new scan
                indices, self.threshold = self._search_view(view, k)
            else:  # the sum is written: search it
                indices, self.threshold = self._search(view.x, k)
        else:
            indices, self.threshold = self._search(x, k, addend, dest)
        self.searched_for = (k, n)
        self.calls_since_search = 1
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "searched_for": list(self.searched_for),
                "calls_since_search": self.calls_since_search}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold = None if state["threshold"] is None else float(state["threshold"])
        k, n = (int(v) for v in state["searched_for"])
        self.searched_for = (k, n)
        self.calls_since_search = int(state["calls_since_search"])


@register_selector("mstopk")
class MSTopK(Selector):
    """MSTopK, Shi et al. section 3.1, Algorithm 1: exactly ``k`` indices, approximately the top-k.

    ``N`` bisection steps on ``ratio`` keep two thresholds: ``thres1``, the lowest visited one with at
    most ``k`` elements (``k1`` of them), and ``thres2``, the highest visited one with more than
    ``k``. The result is every element ``>= thres1`` plus ``k - k1`` elements from a random
    contiguous window of those in ``[thres2, thres1)`` (in index order), all in increasing index
    order. Where the paper initialises ``thres1 = 0`` (which would select everything if never
    updated) we start from "no element" (``thres1 = +inf``, ``k1 = 0``); ``thres2`` starts at 0 as in
    the paper.

    The window's start is ``u % (band - (k - k1) + 1)`` for one draw ``u`` of the generator per call,
    taken before the search (whether a window is needed or not), so that a GPU, which learns the
    band's size only on the device, places it where the CPU does (:func:`.triton_select.mstopk`: the
    whole selection in one device sequence).

    Args:
        samplings: N, the number of bisection steps (default 30, the paper's setting).
        seed: seed of the generator that places the random window (its state is in ``state_dict``).
    """

    exact_count = True

    def __init__(self, *, samplings: int = 30, seed: int = 0, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        check_int("mstopk: samplings", samplings, minimum=1)
        self.samplings = samplings
        self.generator = torch.Generator().manual_seed(int(seed))
        self._scratch = Scratch()

    def select(self, x: Tensor, k: int) -> Tensor:
        return self._select(x, k)

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        """The addition in the scan that gathers the candidates."""
        return self._select(x, k, addend, dest)

    def _select(self, x: Tensor, k: int, addend: Tensor | None = None, dest: Tensor | None = None) -> Tensor:
        """:meth:`select` of ``x``, or with ``addend`` of ``x + addend``, written to ``dest`` (default
        ``x``) by the scan."""
        draw = int(torch.randint(*triton_select.MSTOPK_DRAW, (1,), generator=self.generator))
        if self._scratch.searches_on_device(x, addend, dest):
            try:
                return triton_select.mstopk(x, k, self.samplings, draw, self._scratch.device_buffers,
                                            device_plan(x.numel(), k), addend=addend, dest=dest,
                                            check_finite=self.check_finite, name=self.name)
            except triton_select.Fallback as fallback:
                log.debug("mstopk: %s; the host path", fallback.reason)
                x, addend, dest = fallback.summed, None, None
        view = MagnitudeView(x, self._scratch, sample_floor(x, k, addend=addend), name=self.name,
                             check_finite=self.check_finite, count=k, addend=addend, dest=dest)
        x = view.x
        mean, top = view.mean, view.max()
        lookahead = _Lookahead(view, mean, top)
        lo, hi = 0.0, 1.0
        thres1, thres2 = float("inf"), 0.0
        for _ in range(self.samplings):
            ratio = lo + (hi - lo) / 2
            threshold = mean + ratio * (top - mean)
            too_many, _ = lookahead.count_exceeds(lo, hi, threshold, k)
            # The visited thresholds rise with lo and fall with hi, so the paper's "keep the count
            # closest to k from each side" is "keep the latest threshold on each side".
            if too_many:
                lo, thres2 = ratio, threshold
            else:
                hi, thres1 = ratio, threshold
        # |x| >= thres2 in index order, those >= thres1 marked (none while thres1 is +inf): the rest,
        # in [thres2, thres1), is where the window lies
        indices, upper = view.indices_ge_marking(thres2, thres1)
        if thres1 == float("inf"):
            upper.zero_()
        missing = k - int(upper.sum())
        if missing == 0:
            return indices[upper]
        between = torch.nonzero(~upper).squeeze(1)  # positions in ``indices``
        if between.numel() < missing:  # only NaN input (check_finite=False) breaks the bracket
            return torch.topk(x.abs(), k, sorted=False).indices
        start = draw % (between.numel() - missing + 1)
        # the window between[start:start + missing] spans a range of indices that holds no other
        # entry of the band, so "above thres1, or inside that range" selects the result already sorted
        first, last = indices[between[start]], indices[between[start + missing - 1]]
        return indices[upper | ((indices >= first) & (indices <= last))]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
