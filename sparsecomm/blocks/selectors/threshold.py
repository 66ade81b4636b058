"""Threshold selectors: a fixed hard threshold, and ExDyna's online threshold scaling.

Both pick ``{i : |x_i| >= threshold}`` in one pass (ExDyna Algorithm 4, line 2, over the whole
vector); their count follows the data, with no band: ``k`` only steers ``scaled_threshold``'s
adaptation (and, as for every selector, ``k = 0`` gives nothing and ``k >= n`` everything).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from .base import Selector
from .registry import register_selector
from .scan import Scratch

__all__ = ["HardThreshold", "ScaledThreshold"]


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
