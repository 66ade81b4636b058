"""Exact-count selectors: ``exact_topk`` (exact top-k) and ``trimmed`` (RedSync trimmed top-k).

Both return exactly ``min(k, n)`` distinct indices.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from . import triton_select
from .base import Selector, assert_finite
from .registry import register_selector
from .scan import MagnitudeView, Scratch, device_plan, sample_floor

__all__ = ["TopK", "Trimmed"]

log = logging.getLogger(__name__)

#: ``algorithm="auto"`` uses the sampled path from this size on (below it torch.topk is as fast)
_SAMPLED_MIN_N = 1 << 16


@register_selector("exact_topk")
class TopK(Selector):
    """Exact top-k by magnitude: the ``k`` largest ``|x|`` (ties broken arbitrarily).

    Args:
        algorithm: ``"torch"``: ``torch.topk(|x|, k)``. ``"sampled"``: a floor threshold from a strided
            sample of ``|x|`` (see :func:`~sparsecomm.selection.scan.sample_floor`), one pass gathering
            the candidates above it, then the top-k among the candidates only
            (:func:`~sparsecomm.selection.scan.largest_in_order`: a radix select in C where the scan
            kernel is in use, else ``torch.topk``; ties with the k-th largest keep the lowest
            indices); if the sample misjudged and fewer than ``k`` candidates came out, it falls back
            to ``torch.topk``, so the result is exact either way. ``"auto"`` (default): ``"sampled"``
            for ``n >= 65536``, where it is faster (measured in docs/selectors.md), else ``"torch"``.
        check_finite: see :class:`~sparsecomm.selection.base.Selector`.
    """

    exact_count = True

    def __init__(self, *, algorithm: str = "auto", check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        if algorithm not in ("auto", "torch", "sampled"):
            raise ValueError(f"topk: algorithm must be 'auto', 'torch' or 'sampled', got {algorithm!r}")
        self.algorithm = algorithm
        self._scratch = Scratch()

    def _sampled(self, n: int) -> bool:
        return self.algorithm == "sampled" or (self.algorithm == "auto" and n >= _SAMPLED_MIN_N)

    def select(self, x: Tensor, k: int) -> Tensor:
        if self._sampled(x.numel()) and self._scratch.searches_on_device(x):
            plan = device_plan(x.numel(), k)
            if plan is not None:  # else torch.topk, as on the CPU
                try:
                    return triton_select.exact_topk(x, k, self._scratch.device_buffers, plan,
                                                    check_finite=self.check_finite, name=self.name)
                except triton_select.Fallback as fallback:
                    log.debug("topk: %s; the host path", fallback.reason)
        return self._select_host(x, k)

    def _select_host(self, x: Tensor, k: int) -> Tensor:
        """:meth:`select` with the candidates' top-k chosen by the host (the CPU; a GPU's fallback)."""
        floor = sample_floor(x, k) if self._sampled(x.numel()) else None
        if floor is not None:
            view = MagnitudeView(x, self._scratch, floor, name=self.name, check_finite=self.check_finite,
                                 count=k, need_mean=False)
            if view.n_candidates >= k:
                return view.topk_at_or_above(floor, k)
            log.debug("topk: sample floor left %d < k=%d candidates; full torch.topk", view.n_candidates, k)
            return torch.topk(x.abs(), k, sorted=False).indices  # the scan checked x
        top = torch.topk(x.abs(), k, sorted=False)
        # torch.topk ranks NaN above +inf above every finite value, so a NaN or Inf anywhere in x shows
        # among the k values it returns: checking them is the check of x, without a pass of its own
        if self.check_finite and not bool(torch.isfinite(top.values).all()):
            assert_finite(x, self.name)  # raises, counting the NaN/Inf elements of x
        return top.indices

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        """On the sampled path the addition happens inside the scan (one read of ``x`` and ``addend``,
        one write of the sum to ``dest`` or ``x``; the floor is sampled from the sums), with the same
        result as the addition followed by :meth:`select`."""
        if not self._sampled(x.numel()) or addend.dtype != x.dtype or addend.device != x.device:
            return None
        if self._scratch.searches_on_device(x, addend, dest):
            plan = device_plan(x.numel(), k)
            if plan is None:
                return None
            try:
                return triton_select.exact_topk(x, k, self._scratch.device_buffers, plan, addend=addend, dest=dest,
                                                check_finite=self.check_finite, name=self.name)
            except triton_select.Fallback as fallback:
                log.debug("topk: %s; the host path", fallback.reason)
                return self._select_host(fallback.summed, k)
        floor = sample_floor(x, k, addend=addend)
        if floor is None:
            return None
        view = MagnitudeView(x, self._scratch, floor, name=self.name, check_finite=self.check_finite,
                             count=k, need_mean=False, addend=addend, dest=dest)   # view.x holds the sum
        if view.n_candidates >= k:
            return view.topk_at_or_above(floor, k)
        log.debug("topk: sample floor left %d < k=%d candidates; full torch.topk", view.n_candidates, k)
        return torch.topk(view.x.abs(), k, sorted=False).indices


@register_selector("trimmed")
class Trimmed(Selector):
    """Trimmed top-k, RedSync (Fang et al.) section 2.1, Algorithm 2: exactly ``k`` indices.

    With ``mean`` and ``max`` of ``|x|``, try thresholds ``mean + ratio * (max - mean)`` for
    ``ratio = 1 - step, 1 - 2 step, ...`` until at least ``k`` elements reach the threshold, then take
    the top-k among those (the "trimmed" set). When ``ratio`` reaches 0 without enough elements the
    threshold drops to 0 (all elements); the paper's loop has no such stop. Counts use ``>=``.

    The result equals the exact top-k (up to ties); the threshold only bounds the work. Counts at
    thresholds above a sampled floor run on the gathered candidates (see
    :mod:`sparsecomm.selection.scan`), so the loop costs no extra full pass in the common case.

    Args:
        step: the ratio decrement, the paper's epsilon (default 0.2).
    """

    exact_count = True

    def __init__(self, *, step: float = 0.2, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        if not 0.0 < step <= 1.0:
            raise ValueError(f"trimmed: step must lie in (0, 1], got {step!r}")
        self.step = float(step)
        self._scratch = Scratch()

    def select(self, x: Tensor, k: int) -> Tensor:
        if self._scratch.searches_on_device(x):
            # the loop below ends at the first threshold with k elements above it and takes their top k:
            # the exact top-k (lowest indices first among ties) whatever the threshold, found on the device
            try:
                return triton_select.exact_topk(x, k, self._scratch.device_buffers, device_plan(x.numel(), k),
                                                check_finite=self.check_finite, name=self.name)
            except triton_select.Fallback as fallback:
                log.debug("trimmed: %s; the host path", fallback.reason)
        view = MagnitudeView(x, self._scratch, sample_floor(x, k), name=self.name,
                             check_finite=self.check_finite, count=k)
        mean, top = view.mean, view.max()
        thresholds = []  # the loop's thresholds, down to 0 (where every element counts)
        ratio = 1.0 - self.step
        while ratio >= 0.0:
            thresholds.append(mean + ratio * (top - mean))
            ratio -= self.step
        thresholds.append(0.0)
        # on a GPU every count is a round trip: count all of them in one pass over the candidates
        counts = view.counts(np.array(thresholds)).tolist() if view.batched else None
        for i, threshold in enumerate(thresholds):
            if counts is not None and counts[i] >= 0:
                enough = counts[i] > k - 1
            else:
                enough, _ = view.count_exceeds(threshold, k - 1)
            if enough:
                return view.topk_at_or_above(threshold, k)
        raise AssertionError("unreachable: every element is at or above the threshold 0")
