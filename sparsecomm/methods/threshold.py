"""ExDyna's hard-threshold comparator (Yoon and Oh, section V; Aji and Heafield's sparsifier):
every ``|acc| >= threshold`` is sent, all-gather, sum.

Like every select-then-all-gather scheme (:class:`~.select_allgather.SelectAllGather`), every rank
picks entries of its own ``acc = grad + residual`` over the WHOLE gradient, so the ranks' picks
overlap only by chance and the union grows with P (*gradient build-up*: up to P k non-zeros in the
result), and every rank's count differs (padding overhead f(t) > 1 in an all-gather padded to
the largest count; ours is sized per message, f(t) is reported as a metric).

The threshold. The paper tunes a fixed threshold before training. ``threshold=<value>`` is that
fixed threshold. By default (``controller="adaptive"``) the threshold holds the density instead:
every call estimates the k-th largest ``|acc|`` from a sample of ``acc``
(:func:`~sparsecomm.selection.threshold.estimate_kth_magnitude`, about 1024/k of the
gradient read), k corrected by log-space feedback on this rank's count
(:class:`~sparsecomm.selection.threshold.ThresholdController`), so any gradient scale gives
the density from the first call and a drifting one keeps it. ``controller="paper"`` is the previous
default, ExDyna's fixed initial threshold 1 / (2 sqrt(k)), which does not depend on the gradient's
scale. The hard cap
(``cap``, default 2: at most 2k entries per rank) bounds any single call.

Passes (:meth:`HardThresholdAllGather.accumulate`): the threshold comes from a sample of ``acc`` (the
sampled elements of ``residual + grad`` added on the fly), and then one scan writes ``acc = residual +
grad``, gathers ``|acc| >= threshold`` and checks the gradient's finiteness: one read of the gradient
and of the residual in all, before the decompression. The controller moves in ``reduce``, from what
:meth:`HardThresholdAllGather.controller_update` read of the selection.

Cost: TopkA's with the per-rank message sizes: ``cost("threshold", P, n, k, rank, counts=[k_0, ...,
k_(P-1)])`` is exact; without ``counts`` it is TopkA's figure for k per rank, marked inexact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from ..core.cost import register_cost
from ..selection.metrics import SparsificationMetrics
from ..selection.threshold import HardThreshold, ThresholdController, estimate_kth_magnitude
from .base import Layout, register_method
from .select_allgather import FeedbackStateMixin, SelectAllGather, data_dependent_cost

__all__ = ["HardThresholdAllGather"]

_CONTROLLERS = ("adaptive", "paper")


@register_method("threshold")
class HardThresholdAllGather(SparsificationMetrics, FeedbackStateMixin, SelectAllGather):
    """Hard-threshold sparsifier: every ``|acc| >= threshold``, all-gather, sum.

    Args:
        density: the user-set density d, k = ceil(d n) (density 1 sends all).
        threshold: a fixed threshold (the paper's tuned one); ``None`` (default): set by ``controller``.
        controller: ``"adaptive"`` (default): first threshold from the gradient, then feedback on the
            count to hold k per rank; ``"paper"``: the fixed threshold 1 / (2 sqrt(k)) (ExDyna's
            initial threshold; scale-free, so its density depends on the gradient's scale).
        cap: at most ``ceil(cap * k)`` entries per rank (default 2.0; ``None``: no cap).
        global_error: also report the error metrics, local and global error (a pass over the
            residual and one extra exchange after the metered call, per call).
    """

    def __init__(self, comm=None, *, density: float, threshold: float | None = None,
                 controller: str = "adaptive", cap: float | None = 2.0, global_error: bool = False) -> None:
        super().__init__(comm, density=density, selector="fixed_threshold", cap=cap,
                         threshold=0.0 if threshold is None else threshold)
        if controller not in _CONTROLLERS:
            raise ValueError(f"threshold: controller={controller!r} must be one of {_CONTROLLERS}")
        assert isinstance(self.selector, HardThreshold)
        self.hard: HardThreshold = self.selector
        self.fixed_threshold = threshold
        self.controller = controller
        self.track_global_error = bool(global_error)
        self._feedback = ThresholdController()

    @property
    def samples_threshold(self) -> bool:
        """Whether every call estimates its threshold from a sample (adaptive, no fixed threshold): a
        cost set by the density, not by n (the simulator's calibration times it apart)."""
        return self.fixed_threshold is None and self.controller == "adaptive"

    def _adaptive(self, n: int, k: int) -> bool:
        return self.samples_threshold and k < n

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad`` and ``|acc| >= threshold``, the threshold set for this call first."""
        n = grad.numel()
        k = self.k(n)
        if self._adaptive(n, k):  # from a sample of acc = residual + grad (nothing written yet)
            self.hard.threshold = estimate_kth_magnitude(residual, self._feedback.target(k), self.step, addend=grad)
        elif self.fixed_threshold is None:
            self.hard.threshold = 1 / (2 * math.sqrt(k))
        return self.hard.accumulate(residual, grad, k, dest=acc)

    def controller_update(self, acc: Tensor, indices: Tensor) -> Callable[[], None]:
        self.stats["threshold"] = self.hard.threshold
        n = acc.numel()
        k = self.k(n)
        if not self._adaptive(n, k):
            return lambda: None
        picked = indices.numel()
        return lambda: self._feedback.update(picked, k)


register_cost("threshold")(data_dependent_cost)
