"""Threshold selectors: a fixed hard threshold, and ExDyna's online threshold scaling; and the
pieces that make a threshold hold a density from any gradient scale.

Both selectors pick ``{i : |x_i| >= threshold}`` in one pass (ExDyna Algorithm 4, line 2, over the
whole vector); their count follows the data, with no band: ``k`` only steers ``scaled_threshold``'s
adaptation (and, as for every selector, ``k = 0`` gives nothing and ``k >= n`` everything).

Holding a density (used by the ``exdyna``, ``threshold`` and ``sidco`` methods):

* :func:`estimate_kth_magnitude`: the k-th largest ``|x_i|`` estimated from a sample of the data
  (about 1024 elements above it), a threshold taken from the gradient itself rather than ExDyna's
  scale-free ``1 / (2 sqrt(k))``; computed on every call, it follows the gradient's scale and the
  growth of the error-feedback residual at once;
* :class:`ThresholdController`: a correction of such an estimate (in rank space) or of a fitted
  threshold (in threshold space), moved by log-space feedback on the count selected, which removes a
  lasting bias. Algorithm 5's fixed 0.5% steps
  cannot follow the residual's growth in the first 1/density steps, nor a drifting scale;
* :func:`cap_selection`: the hard cap, the ``limit`` largest of a selection.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import Selector
from .registry import register_selector
from .scan import Scratch, kth_largest

__all__ = ["HardThreshold", "ScaledThreshold", "ThresholdController", "estimate_kth_magnitude", "cap_selection",
           "local_elasticity"]


class _ThresholdSelector(Selector):
    def __init__(self, *, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self._scratch = Scratch()

    def _pick(self, x: Tensor, threshold: float, k: int, addend: Tensor | None = None,
              dest: Tensor | None = None) -> Tensor:
        """Increasing indices of ``|x| >= threshold``; the scan's output is sized for ``2 k`` (more cost a
        second pass)."""
        return self._scratch.scan(x, threshold, name=self.name, check_finite=self.check_finite,
                                  need_total=False, expected=2 * k, addend=addend, dest=dest).indices


def _check_threshold(name: str, value: Any) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}: the threshold must be a finite number >= 0, got {value!r}")
    return value


@register_selector("fixed_threshold")
class HardThreshold(_ThresholdSelector):
    """A fixed hard threshold: every ``|x_i| >= threshold`` (ExDyna's "hard threshold" baseline).

    Args:
        threshold: the magnitude threshold, >= 0 (required).
    """

    def __init__(self, *, threshold: float, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self.threshold = _check_threshold("threshold", threshold)

    def select(self, x: Tensor, k: int) -> Tensor:
        return self._pick(x, self.threshold, k)

    def _fused_select(self, x: Tensor, addend: Tensor, k: int, dest: Tensor | None) -> Tensor | None:
        """The addition in the selection's one scan."""
        return self._pick(x, self.threshold, k, addend, dest)


@register_selector("scaled_threshold")
class ScaledThreshold(_ThresholdSelector):
    """Online threshold scaling, ExDyna (Yoon, Oh) section IV-D, Algorithm 5.

    Each call selects ``|x_i| >= delta_t`` and then scales the threshold for the next call from the
    ratio ``exam = count / k``: ``delta_{t+1} = delta_t * sf`` with ``sf = 1 + gamma`` when
    ``exam > beta``, ``1 + gamma / 4`` when ``1 / beta < exam <= beta``, and ``1 - gamma`` otherwise
    (Algorithm 5 as printed: inside the band the threshold still creeps up, by ``gamma / 4``).
    The count has no per-call band; over calls on stationary data it settles near ``k``.

    Defaults follow ExDyna's reference code (the paper prints Algorithm 5 without values):
    ``beta = 1.1``, ``gamma = 0.005`` (factors 1.005, 1.00125, 0.995) and a first threshold of
    ``1 / (2 sqrt(k))``, taken at the first call.

    Args:
        initial_threshold: first ``delta``; ``None`` (default) means ``1 / (2 sqrt(k))``.
        beta: the band factor, > 1.
        gamma: the scaling step, in (0, 1).

    State (``state_dict``): the current threshold (``None`` before the first call) and the number of
    calls.
    """

    def __init__(self, *, initial_threshold: float | None = None, beta: float = 1.1, gamma: float = 0.005,
                 check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        if not beta > 1.0:
            raise ValueError(f"scaled_threshold: beta must be > 1, got {beta!r}")
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"scaled_threshold: gamma must lie in (0, 1), got {gamma!r}")
        self.initial_threshold = (None if initial_threshold is None
                                  else _check_threshold("scaled_threshold", initial_threshold))
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.threshold: float | None = self.initial_threshold
        self.calls = 0

    def scale_factor(self, count: int, k: int) -> float:
        """Algorithm 5, lines 1-7."""
        exam = count / k
        if exam > self.beta:
            return 1.0 + self.gamma
        if exam > 1.0 / self.beta:
            return 1.0 + self.gamma / 4
        return 1.0 - self.gamma

    def select(self, x: Tensor, k: int) -> Tensor:
        if self.threshold is None:
            self.threshold = 1.0 / (2.0 * math.sqrt(k))
        indices = self._pick(x, self.threshold, k)
        self.threshold *= self.scale_factor(indices.numel(), k)
        self.calls += 1
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold = None if state["threshold"] is None else float(state["threshold"])
        self.calls = int(state["calls"])


# ---------------------------------------------------------------------- holding a density
#: the sample of :func:`estimate_kth_magnitude` aims at this many elements above the estimate
_ESTIMATE_HITS = 1024
#: seeds of the sample pieces: ``_SEED_STRIDE * shift + n``
_SEED_STRIDE = 1_000_003
#: contiguous elements per piece of that sample (whole cache lines, no strided reads)
_ESTIMATE_PIECE = 256


def estimate_kth_magnitude(x: Tensor, k: int, shift: int = 0, addend: Tensor | None = None) -> float:
    """An estimate of the ``k``-th largest ``|x_i|``, from a sample holding about 1024 elements above it
    (of ``|x_i + addend_i|`` with ``addend``, shaped like ``x``: the sampled elements are added, the
    same values ``x + addend`` holds once written, and nothing is written).

    The sample is ``x`` itself when that would take more than half of it (then the answer is exact),
    else aligned pieces of 256 contiguous elements at random places, about ``1024 n / k`` elements in all: the
    count at the estimate is then within a few percent of ``k`` (binomial, relative error about
    ``1 / sqrt(1024)``) at the cost of reading ``1024 / k`` of ``x``. Returns 0.0 for ``k >= n``
    (everything is selected). Non-finite elements are ignored (the caller checks finiteness where
    its policy asks for it).

    The pieces start at places drawn from a generator seeded with ``shift`` and ``n``, so every rank
    that passes the same ``shift`` (the call's number) samples the same places. A sample at fixed
    places would be selected
    exactly to its target every call while the rest of ``x`` is not, and the error-feedback residual
    of the rest then drifts from the sample's (counts alternating 20% above and below k were measured
    with a fixed sample, 0.1% at n = 4M, before the shift).
    """
    n = x.numel()
    if k >= n or n == 0:
        return 0.0
    size = _ESTIMATE_HITS * n // max(k, 1)
    if 2 * size >= n:
        sample = x.abs() if addend is None else torch.add(x, addend).abs_()
    else:
        gen = torch.Generator().manual_seed(_SEED_STRIDE * shift + n)
        picked = torch.randint(0, n // _ESTIMATE_PIECE, (max(1, size // _ESTIMATE_PIECE),), generator=gen)
        if x.is_cuda:  # through pinned memory: a copy from pageable memory would wait for the device
            picked = picked.pin_memory().to(x.device, non_blocking=True)

        def pieces(v: Tensor) -> Tensor:
            return v[: n // _ESTIMATE_PIECE * _ESTIMATE_PIECE].view(-1, _ESTIMATE_PIECE).index_select(0, picked)

        sample = pieces(x) if addend is None else pieces(x).add_(pieces(addend))
        sample = sample.reshape(-1).abs_()
    rank = min(sample.numel(), max(1, round(k * sample.numel() / n)))
    if sample.is_cuda:  # the sum and the k-th value in one copy to the host (one synchronization)
        total, kth = torch.stack([sample.sum(), torch.topk(sample, rank, sorted=False).values.min()]).tolist()
        if math.isfinite(total):
            return kth
    elif math.isfinite(float(sample.sum())):
        return kth_largest(sample, rank)
    sample = sample[torch.isfinite(sample)]  # NaN/Inf in the sample (a finite sum: none, no mask needed)
    if sample.numel() == 0:
        return 0.0
    return kth_largest(sample, min(sample.numel(), max(1, round(k * sample.numel() / n))))


def cap_selection(x: Tensor, indices: Tensor, limit: int) -> Tensor:
    """The (at most) ``limit`` entries of ``indices`` with the largest ``|x|``, in their given order."""
    if indices.numel() <= limit:
        return indices
    keep = torch.topk(x.index_select(0, indices).abs_(), limit, sorted=False).indices
    return indices.index_select(0, torch.sort(keep).values)


class ThresholdController:
    """A correction that holds a count target, moved by log-space feedback on the counts selected.

    ``log c -= gain * log(count / target) / e`` after each call, ``c`` kept in [1/16, 16]. It is
    applied in one of two spaces:

    * rank space, :meth:`target`: ask an estimator for the ``k c``-th largest instead of the k-th
      (``e = 1`` there: the count moves in proportion); used with :func:`estimate_kth_magnitude`;
    * threshold space, :meth:`correct`: ``threshold = raw / c``, for a threshold from a fitted
      distribution (SIDCo); ``e`` is then the elasticity of the count in the threshold, measured by
      the caller at each call (it can reach 100 just after a step, when the error-feedback residual
      piles elements up just under the previous threshold: a fixed ``e`` then oscillates).

    A pure function of its inputs and state: every rank that feeds it the same counts holds the same
    correction.

    Args:
        gain: the feedback gain in (0, 1] (0.5: half the measured bias removed per call).
    """

    def __init__(self, gain: float = 0.5) -> None:
        self.gain = float(gain)
        self.log_correction = 0.0

    @property
    def correction(self) -> float:
        return math.exp(self.log_correction)

    def target(self, k: int) -> int:
        """The count to ask an estimator for: ``k`` times the correction (at least 1)."""
        return max(1, round(k * self.correction))

    def correct(self, raw: float) -> float:
        """The threshold to use: ``raw`` over the correction."""
        return raw / self.correction

    def update(self, count: int, target: int, elasticity: float = 1.0) -> None:
        """Feed back the count selected (``target``: the count wanted; ``elasticity``: see above)."""
        if target <= 0:
            return
        step = self.gain * math.log(max(count, 0.5) / target) / max(1.0, elasticity)
        self.log_correction = min(math.log(16), max(-math.log(16), self.log_correction - step))

    def state_dict(self) -> dict[str, Any]:
        return {"log_correction": self.log_correction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log_correction = float(state["log_correction"])


def local_elasticity(magnitudes: Tensor, threshold: float, ratio: float = 1.05) -> float:
    """``-d log count / d log t`` at ``threshold``, from the selected ``magnitudes`` (all >= threshold):
    ``log(count(t) / count(ratio t)) / log(ratio)``, in [1, 100]."""
    count = magnitudes.numel()
    if count == 0 or threshold <= 0:
        return 1.0
    above = int(torch.count_nonzero(magnitudes >= threshold * ratio))
    return min(100.0, max(1.0, math.log(count / max(above, 1)) / math.log(ratio)))
