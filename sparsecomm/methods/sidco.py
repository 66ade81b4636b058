"""SIDCo (Abdelmoniem et al., "An Efficient Statistical-based Gradient Compression Technique for
Distributed Training Systems", MLSys 2021), one of ExDyna's comparators (Yoon and Oh, section V).

Fit a sparsity-inducing distribution to the magnitudes |acc| and take the threshold whose tail
probability is the density: ``distribution="exponential"`` (maximum likelihood: scale = mean),
``"gamma"`` (Minka's closed-form approximation of the shape MLE, quantile by bisection on the
regularized incomplete gamma) or ``"gpd"`` (generalized Pareto, method of moments). With ``stages``
> 1 the fit is repeated on the exceedances over the previous stage's threshold (peaks over
threshold), each stage keeping a fraction d^(1/stages): the tail is fitted where it matters. Our
reading of SIDCo's multi-stage scheme: later stages use the exponential for ``"exponential"`` and
``"gamma"`` (a gamma tail is exponential), the GPD for ``"gpd"``; SIDCo's adaptive choice of the
number of stages is not reproduced (``stages`` is fixed).

Holding the density. A fitted distribution that is not the data's (an exponential fitted to normal
magnitudes, say) misses the density by a factor that persists. By default (``controller="adaptive"``)
the fitted threshold is divided by a correction that log-space feedback on this rank's count
moves (:class:`~sparsecomm.selection.threshold.ThresholdController`, steps scaled by the
count's elasticity measured on the selected magnitudes), so the count settles on k within a few
calls; ``controller="paper"`` uses the fit alone. The fit scales with the gradient, so
SIDCo starts right at any scale. The hard cap (``cap``, default 2: at most 2k entries per rank)
bounds any single call.

Like every select-then-all-gather scheme (:class:`~.select_allgather.SelectAllGather`), every rank
picks entries of its own ``acc = grad + residual`` over the WHOLE gradient, so the ranks' picks
overlap only by chance and the union grows with P (*gradient build-up*: up to P k non-zeros in the
result).

Passes. With the exponential (the default) every stage runs on the magnitudes gathered by ONE scan
(:func:`sidco_view`, in :meth:`SIDCo.accumulate`): it writes ``acc = residual + grad``, sums ``|acc|``
for the first stage's mean, checks the gradient's finiteness and gathers the
candidates ``|acc| >= floor``, the floor placed from a strided sample just under the first stage's
threshold; the later stages' exceedances and the final selection are then read from the candidates
(a threshold found below the floor, which the sample makes rare, costs a scan of ``acc``). An
exponential stage needs only the count and the sum of its exceedances
(:meth:`~sparsecomm.selection.scan.MagnitudeView.count_and_sum_ge`: one read of the candidates, no
copy; its mean excess can differ from a mean of the copied excesses in the last bits). The
gamma and GPD first stages fit all of ``|acc|`` (a copy, in float64).

Cost: TopkA's with the per-rank message sizes: ``cost("sidco", P, n, k, rank, counts=[k_0, ...,
k_(P-1)])`` is exact; without ``counts`` it is TopkA's figure for k per rank, marked inexact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..core.cost import register_cost
from ..core.validate import check_int
from ..selection.metrics import SparsificationMetrics
from ..selection.scan import MagnitudeView, Scratch, above_float32, sampled_magnitudes
from ..selection.threshold import HardThreshold, ThresholdController, local_elasticity
from .base import Layout, register_method
from .select_allgather import FeedbackStateMixin, SelectAllGather, data_dependent_cost

__all__ = ["SIDCo", "sidco_threshold", "sidco_view"]

_DISTRIBUTIONS = ("exponential", "gamma", "gpd")
_CONTROLLERS = ("adaptive", "paper")


def _gamma_fit(a: Tensor) -> tuple:
    """(shape, scale) of a gamma fitted to positive samples ``a`` (Minka's approximation of the MLE)."""
    mean = float(a.mean())
    s = math.log(mean) - float(a.log().mean())
    if s <= 0:  # all samples equal: a degenerate (very peaked) gamma
        s = 1e-12
    shape = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    return shape, mean / shape


def _gamma_tail_quantile(shape: float, scale: float, p: float) -> float:
    """x with P(X > x) = p for X ~ gamma(shape, scale), by bisection on the regularized upper
    incomplete gamma function (monotone in x)."""
    alpha = torch.tensor(shape, dtype=torch.float64)

    def tail(x: float) -> float:
        return float(torch.special.gammaincc(alpha, torch.tensor(x / scale, dtype=torch.float64)))

    lo, hi = 0.0, scale * max(1.0, shape)
    while tail(hi) > p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if tail(mid) > p:
            lo = mid
        else:
            hi = mid
    return hi


def _stage_threshold(a: Tensor, p: float, distribution: str) -> float:
    """Threshold on samples ``a`` >= 0 whose fitted tail probability is p."""
    if distribution == "exponential":
        return float(a.mean()) * math.log(1 / p)
    if distribution == "gamma":
        positive = a[a > 0]
        if positive.numel() < 2:
            return float(a.max())
        shape, scale = _gamma_fit(positive.double())
        return _gamma_tail_quantile(shape, scale, p)
    mean = float(a.mean())
    var = float(a.var()) if a.numel() > 1 else 0.0
    if var <= 0:
        return mean
    ratio = mean * mean / var
    xi = (ratio - 1) / 2
    sigma = mean * (ratio + 1) / 2
    if abs(xi) < 1e-9:
        return sigma * math.log(1 / p)
    return sigma / xi * (p ** (-xi) - 1)


#: the floor of :func:`sidco_view` lies this far under the first stage's threshold estimated from its
#: sample (the sample's mean misses the mean of |x| by about its coefficient of variation over 128: the
#: sample's runs of adjacent elements counted as one draw each)
_FLOOR_MARGIN = 0.95
#: the sample of :func:`sidco_view` (:func:`~sparsecomm.selection.scan.sampled_magnitudes`) holds about
#: this many elements
_FLOOR_SAMPLE = 1 << 16


def sidco_threshold(x: Tensor, density: float, distribution: str = "exponential", stages: int = 2,
                    scratch: Scratch | None = None) -> float:
    """SIDCo's threshold for the magnitudes ``|x|``: ``stages`` fits, each keeping density^(1/stages)
    of the previous stage's exceedances (see the module docstring); :func:`sidco_view`'s threshold."""
    return sidco_view(x, density, distribution, stages, scratch, check_finite=False)[0]


def sidco_view(x: Tensor, density: float, distribution: str = "exponential", stages: int = 2,
               scratch: Scratch | None = None, *, check_finite: bool, lowest: float = 1.0,
               addend: Tensor | None = None, dest: Tensor | None = None) -> tuple[float, MagnitudeView]:
    """SIDCo's threshold for ``|x|`` and the :class:`~sparsecomm.selection.scan.MagnitudeView` it was
    fitted on, from one scan of ``x`` (pass a ``scratch`` to reuse its buffers).

    With ``addend``, of ``x + addend``, which the scan writes to ``dest`` (default ``x``). The
    exponential first stage needs only the mean of ``|x|`` (the scan's sum) and each later stage the
    exceedances over the previous threshold, which the view reads from its candidates: the scan
    gathers ``|x| >= floor`` with the floor placed, from a strided sample, under ``lowest`` times the
    first stage's threshold (``lowest`` < 1 when the caller selects below the fit, e.g. a corrected
    threshold), so the fit costs one pass. The gamma and GPD first stages fit all of ``|x|`` (in
    float64). ``check_finite``: raise :class:`~sparsecomm.selection.NonFiniteInputError` on NaN/Inf.
    """
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(f"sidco: distribution={distribution!r} must be one of {_DISTRIBUTIONS}")
    scratch = Scratch() if scratch is None else scratch
    n = x.numel()
    p = density ** (1 / stages)
    floor = None
    if distribution == "exponential" and n >= 2 * _FLOOR_SAMPLE:
        sample = sampled_magnitudes(x.reshape(-1), _FLOOR_SAMPLE, None if addend is None else addend.reshape(-1))
        floor = _FLOOR_MARGIN * min(1.0, lowest) * float(sample.mean()) * math.log(1 / p)
        if not math.isfinite(floor):  # NaN/Inf in the sample: the scan's check tells
            floor = None
    view = MagnitudeView(x, scratch, floor, name="sidco", check_finite=check_finite,
                         count=math.ceil(p * n) if floor is not None else 0, addend=addend, dest=dest)
    if distribution == "exponential":
        threshold = view.mean * math.log(1 / p)
    else:
        threshold = _stage_threshold(view.values.double(), p, distribution)  # no floor: values are all of |x|
    for _ in range(1, stages):
        above = above_float32(threshold)  # |x| >= above: |x| > threshold
        if distribution == "gpd":
            samples = view.values_ge(above, view.n_candidates).double() - threshold
            if samples.numel() < 2:
                break
            threshold += _stage_threshold(samples, p, "gpd")
        else:  # the exponential's maximum likelihood: the mean excess, from a count and a sum (no copy)
            number, total = view.count_and_sum_ge(above)
            if number < 2:
                break
            threshold += (total / number - threshold) * math.log(1 / p)
    return threshold, view


@register_method("sidco")
class SIDCo(SparsificationMetrics, FeedbackStateMixin, SelectAllGather):
    """SIDCo statistical threshold estimation, all-gather, sum (see the module docstring).

    Args:
        density: target fraction per rank.
        distribution: ``"exponential"`` (default), ``"gamma"`` or ``"gpd"``.
        stages: number of fitting stages (>= 1, default 2).
        controller: ``"adaptive"`` (default): the fit times a correction held by feedback on the count;
            ``"paper"``: the fit alone.
        cap: at most ``ceil(cap * k)`` entries per rank (default 2.0; ``None``: no cap).
        global_error: also report the error metrics, local and global error (a pass over the
            residual and one extra exchange after the metered call, per call).
    """

    def __init__(self, comm=None, *, density: float, distribution: str = "exponential", stages: int = 2,
                 controller: str = "adaptive", cap: float | None = 2.0, global_error: bool = False) -> None:
        super().__init__(comm, density=density, selector="fixed_threshold", cap=cap, threshold=0.0)
        if distribution not in _DISTRIBUTIONS:
            raise ValueError(f"sidco: distribution={distribution!r} must be one of {_DISTRIBUTIONS}")
        if controller not in _CONTROLLERS:
            raise ValueError(f"sidco: controller={controller!r} must be one of {_CONTROLLERS}")
        check_int("sidco: stages", stages, minimum=1)
        self.distribution = distribution
        self.stages = stages
        self.controller = controller
        self.track_global_error = bool(global_error)
        self._scratch = Scratch()
        assert isinstance(self.selector, HardThreshold)
        self.hard: HardThreshold = self.selector
        self._feedback = ThresholdController()
        self._selected_magnitudes: Tensor | None = None  # |acc| at accumulate's indices, for controller_update

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad`` and the entries above the fitted threshold, from one scan."""
        n = grad.numel()
        k = self.k(n)
        self._selected_magnitudes = None
        if k >= n:
            return self.selector.accumulate(residual, grad, k, dest=acc)
        adaptive = self.controller == "adaptive"
        correction = self._feedback.correction if adaptive else 1.0
        fitted, view = sidco_view(residual, k / n, self.distribution, self.stages, self._scratch,
                                  check_finite=True, lowest=1 / correction, addend=grad, dest=acc)
        self.hard.threshold = self._feedback.correct(fitted) if adaptive else fitted
        self.stats.update(threshold=self.hard.threshold, fitted_threshold=fitted)
        # the stages' buffer size: kept; the magnitudes are what the controller reads (controller_update)
        indices, self._selected_magnitudes = view.indices_and_values_ge(self.hard.threshold, view.n_candidates)
        return indices

    def controller_update(self, acc: Tensor, indices: Tensor) -> Callable[[], None]:
        n = acc.numel()
        k = self.k(n)
        magnitudes, self._selected_magnitudes = self._selected_magnitudes, None
        if self.controller != "adaptive" or k >= n:
            return lambda: None
        if magnitudes is None or magnitudes.numel() != indices.numel():  # not accumulate's: read acc
            magnitudes = acc.index_select(0, indices).abs_()
        elasticity = local_elasticity(magnitudes, self.hard.threshold)
        picked = indices.numel()
        return lambda: self._feedback.update(picked, k, elasticity)


register_cost("sidco")(data_dependent_cost)
