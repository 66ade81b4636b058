"""Never slower than a dense all-reduce: measure both, keep the method only where it pays (``dense_fallback=True``).

Sparse synchronization pays when moving the gradient costs more than selecting and exchanging a few
of its elements: on a slow link and a large gradient. On a fast link, or on a model whose step is
mostly compute, the selection and the extra message rounds make a step slower than DDP's all-reduce,
and whether that is so depends on the model, the batch and the cluster at hand. The engine therefore
measures it on the run itself:

1. the first ``skip + probe`` steps are averaged densely (extending the dense warm-up if it is
   shorter), and the last ``probe`` of them are timed;
2. the next ``skip + probe`` steps use the method, and the last ``probe`` of them are timed;
3. every rank's two medians are reduced to the slowest rank's (the slowest sets the pace of a
   data-parallel step, and every rank then decides alike), and the method is kept only if its
   median step is at least ``margin`` shorter than the dense one; otherwise the engine switches to
   the dense all-reduce for the rest of training, carrying the method's residuals into the next
   gradient (:meth:`~.engine.GroupingEngine.switch_method`: nothing is lost).

The margin is there because a step is not the whole cost: a sparse method reaches a given quality
in more steps than the dense all-reduce (error feedback delays part of the gradient), so a method
whose step is only a little shorter reaches the quality later. The default (a fifth) covers the
extra steps the campaigns measured for the recommended sparse configurations (docs/campaign.md).

A measured decision depends on the machine's load at the time of the probe, so two runs of one
configuration may decide differently. ``pinned="method"`` or ``"dense"`` takes that decision after
the probe whatever it measured (the probe still runs and is logged): a rerun then follows the
trajectory of the run whose decision it pins, and a study can train each branch on purpose.

A step's time is the wall time between two consecutive ends of a step as the engine sees them (the
hook: DDP's last bucket; the synchronizer: the end of :meth:`synchronize`): forward, backward, the
synchronization and the optimizer, as the user's loop runs them. The decision is part of the
engine's state dict, so a resumed run does not measure again.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..transport.comm import Communicator
from ..transport.control import max_all_reduce

__all__ = ["DenseFallback", "as_dense_fallback", "DECISIONS"]

#: the decisions a fallback can be pinned to: keep the method, or average densely after the probe
DECISIONS = ("method", "dense")

log = logging.getLogger(__name__)


class DenseFallback:
    """The measurement and decision of ``dense_fallback`` (see the module docstring).

    Args:
        probe: steps timed in each phase (the median of them is the phase's step time).
        skip: steps left out at the start of each phase (first-touch allocations, the switch).
        margin: the fraction by which the method's step must be shorter than the dense one for the
            method to be kept.
        pinned: ``None`` (decide by the measurement), or the decision to take after the probe
            whatever it measured: ``"method"`` or ``"dense"`` (reproducible runs; see the module
            docstring).
    """

    def __init__(self, probe: int = 8, skip: int = 3, margin: float = 0.2, pinned: str | None = None) -> None:
        if not (isinstance(probe, int) and probe >= 1 and isinstance(skip, int) and skip >= 1):
            raise ValueError(f"dense_fallback: probe={probe!r} and skip={skip!r} must be integers >= 1")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"dense_fallback: margin={margin!r} must lie in [0, 1)")
        if pinned is not None and pinned not in DECISIONS:
            raise ValueError(f"dense_fallback: pinned={pinned!r} must be None, 'method' or 'dense'")
        self.probe, self.skip, self.margin, self.pinned = probe, skip, margin, pinned
        #: "measuring", then "method" (kept) or "dense" (fell back)
        self.decision = "measuring"
        self.dense_s: float | None = None
        self.method_s: float | None = None
        self._last_end: float | None = None
        self._dense: list[float] = []
        self._method: list[float] = []

    def dense_steps(self, warmup: int) -> int:
        """The dense steps the engine must make first: the warm-up, at least ``skip + probe``."""
        return max(warmup, self.skip + self.probe)

    def step_ended(self, step: int, dense_until: int, comm: Communicator,
                   switch_to_dense: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> None:
        """Called at the end of step ``step`` (0-based) by the engine, whose dense phase lasts until
        step ``dense_until``: records the step's time in its phase and, after the method's probe,
        decides (a small collective over ``comm`` on every rank at the same step)."""
        now = clock()
        last, self._last_end = self._last_end, now
        if self.decision != "measuring" or last is None:
            return
        elapsed = now - last
        if dense_until - self.probe <= step < dense_until:
            self._dense.append(elapsed)
        elif dense_until + self.skip <= step < dense_until + self.skip + self.probe:
            self._method.append(elapsed)
        if step != dense_until + self.skip + self.probe - 1:
            return
        if not self._dense or not self._method:  # resumed inside a probe: every rank alike, the method kept
            log.warning("dense_fallback: the run resumed during the measurement; keeping the method")
            self.decision = "method"
            return
        micros = [round(1e6 * statistics.median(self._dense)), round(1e6 * statistics.median(self._method))]
        dense_us, method_us = max_all_reduce(comm, micros)
        self.dense_s, self.method_s = 1e-6 * dense_us, 1e-6 * method_us
        measured_keep = self.method_s < (1.0 - self.margin) * self.dense_s
        keep = measured_keep if self.pinned is None else self.pinned == "method"
        self.decision = "method" if keep else "dense"
        log.info("dense_fallback: step %.1f ms with the method, %.1f ms dense%s: %s", 1e3 * self.method_s,
                 1e3 * self.dense_s, "" if self.pinned is None else f" (pinned to {self.pinned!r}, the "
                 f"measurement would {'keep the method' if measured_keep else 'fall back'})",
                 "keeping the method" if keep else "falling back to the dense all-reduce")
        if not keep:
            switch_to_dense()

    def state_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "dense_s": self.dense_s, "method_s": self.method_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        decision = state.get("decision", "measuring")
        if decision not in ("measuring", "method", "dense"):
            raise ValueError(f"dense_fallback: a saved decision {decision!r} is none of measuring, method, dense")
        self.decision, self.dense_s, self.method_s = decision, state.get("dense_s"), state.get("method_s")
        self._dense, self._method, self._last_end = [], [], None


def as_dense_fallback(value: bool | DenseFallback | None) -> DenseFallback | None:
    """The ``dense_fallback=`` argument of the hook and the synchronizer as a :class:`DenseFallback`:
    ``True`` the default measurement, ``False``/``None`` none, an instance as it is (its own probe,
    margin or pinned decision)."""
    if isinstance(value, DenseFallback):
        return value
    if value is None or value is False:
        return None
    if value is True:
        return DenseFallback()
    raise TypeError(f"dense_fallback={value!r} must be True, False or a sparsecomm.integration.auto.DenseFallback")
