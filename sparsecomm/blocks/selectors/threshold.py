"""Threshold selectors: a fixed hard threshold, and ExDyna's online threshold scaling; and the
pieces that make a threshold hold a density from any gradient scale.

Both selectors pick ``{i : |x_i| >= threshold}`` in one pass (ExDyna Algorithm 4, line 2, over the
whole vector); their count follows the data, with no band: ``k`` only steers ``scaled_threshold``'s
adaptation (and, as for every selector, ``k = 0`` gives nothing and ``k >= n`` everything).

Holding a density (used by the ``exdyna``, ``threshold`` and ``sidco`` methods):

* :func:`estimate_kth_magnitude`: the k-th largest ``|x_i|`` estimated from a strided sample (one
  ``torch.topk`` over at most 65536 elements), the first threshold taken from the gradient itself
  rather than ExDyna's scale-free ``1 / (2 sqrt(k))``;
* :class:`ThresholdController`: log-space feedback on a threshold from the count it selected:
  ``log t += clip(log(count / target) / e, -log 2, log 2)``, where ``e = -d log count / d log t`` is
  the tail's elasticity, started from the normal tail at the target density (``z^2 + 1``) and
  re-estimated from consecutive steps (secant). Unlike Algorithm 5's fixed 0.5% steps it corrects a
  factor-2 error in one step and follows a drifting scale;
* :func:`cap_selection`: the hard cap, the ``limit`` largest of a selection.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import torch
from torch import Tensor

from .base import Selector
from .registry import register_selector
from .scan import Scratch

__all__ = ["HardThreshold", "ScaledThreshold", "ThresholdController", "estimate_kth_magnitude", "cap_selection"]


class _ThresholdSelector(Selector):
    def __init__(self, *, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self._scratch = Scratch()

    def _pick(self, x: Tensor, threshold: float) -> Tensor:
        return self._scratch.scan(x, threshold, name=self.name, check_finite=self.check_finite,
                                  need_total=False).indices


def _check_threshold(name: str, value: Any) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}: the threshold must be a finite number >= 0, got {value!r}")
    return value


@register_selector("threshold")
class HardThreshold(_ThresholdSelector):
    """A fixed hard threshold: every ``|x_i| >= threshold`` (ExDyna's "hard threshold" baseline).

    Args:
        threshold: the magnitude threshold, >= 0 (required).
    """

    def __init__(self, *, threshold: float, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self.threshold = _check_threshold("threshold", threshold)

    def select(self, x: Tensor, k: int) -> Tensor:
        return self._pick(x, self.threshold)


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
        indices = self._pick(x, self.threshold)
        self.threshold *= self.scale_factor(indices.numel(), k)
        self.calls += 1
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold = None if state["threshold"] is None else float(state["threshold"])
        self.calls = int(state["calls"])


# ---------------------------------------------------------------------- holding a density
#: elements of the strided sample :func:`estimate_kth_magnitude` looks at (at most)
_ESTIMATE_SAMPLE = 1 << 16


def estimate_kth_magnitude(x: Tensor, k: int) -> float:
    """An estimate of the ``k``-th largest ``|x_i|`` from a strided sample of at most 65536 elements.

    Exact when ``x`` is no longer than the sample. Returns 0.0 for ``k >= n`` (everything is selected)
    and ``max |x|`` over the sample for tiny ``k``. Non-finite elements are ignored (the caller checks
    finiteness where its policy asks for it).
    """
    n = x.numel()
    if k >= n or n == 0:
        return 0.0
    stride = max(1, n // _ESTIMATE_SAMPLE)
    sample = x[::stride].abs()
    sample = sample[torch.isfinite(sample)]
    if sample.numel() == 0:
        return 0.0
    rank = min(sample.numel(), max(1, round(k * sample.numel() / n)))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def cap_selection(x: Tensor, indices: Tensor, limit: int) -> Tensor:
    """The (at most) ``limit`` entries of ``indices`` with the largest ``|x|``, in their given order."""
    if indices.numel() <= limit:
        return indices
    keep = torch.topk(x[indices].abs(), limit, sorted=False).indices
    return indices[torch.sort(keep).values]


class ThresholdController:
    """Log-space feedback that moves a threshold until it selects ``target`` elements per call.

    ``update(threshold, count, target)`` returns the next threshold: ``log t`` moves by
    ``log(count / target) / e`` (at most a factor 2 per call), ``e`` being the elasticity of the
    count in the threshold. ``e`` starts at ``z^2 + 1`` for the normal tail with ``P(|X| > z) =
    density`` (the slope of ``log P(|X| > t)`` in ``log t`` there) and is re-estimated as
    ``-(log c_t - log c_{t-1}) / (log t_t - log t_{t-1})`` when the threshold moved by more than 1%,
    averaged with the previous value and kept in [1, 50]. A pure function of its inputs and state:
    every rank that feeds it the same counts holds the same threshold.

    Args:
        density: the target density, for the starting elasticity.
    """

    def __init__(self, density: float) -> None:
        d = min(max(float(density), 1e-9), 0.999)
        z = NormalDist().inv_cdf(1 - d / 2)
        self.elasticity = max(1.0, z * z + 1)
        self._last: tuple[float, float] | None = None  # (log threshold, log count) of the last call

    def update(self, threshold: float, count: int, target: int) -> float:
        if threshold <= 0 or target <= 0:
            return threshold
        log_t, log_c = math.log(threshold), math.log(max(count, 0.5))
        if self._last is not None:
            moved, changed = log_t - self._last[0], log_c - self._last[1]
            if abs(moved) > 0.01 and changed * moved < 0:
                estimate = min(50.0, max(1.0, -changed / moved))
                self.elasticity = 0.5 * (self.elasticity + estimate)
        self._last = (log_t, log_c)
        step = (log_c - math.log(target)) / self.elasticity
        return threshold * math.exp(min(math.log(2), max(-math.log(2), step)))

    def state_dict(self) -> dict[str, Any]:
        return {"elasticity": self.elasticity, "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elasticity = float(state["elasticity"])
        self._last = None if state["last"] is None else (float(state["last"][0]), float(state["last"][1]))
