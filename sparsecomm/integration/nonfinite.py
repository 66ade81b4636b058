"""The non-finite policy of the DDP hook and the synchronizer: a GradScaler-compatible overflow.

Plain DDP all-reduces an fp16 overflow (Inf) like any value: every rank gets a non-finite average,
``torch.amp.GradScaler`` finds it, skips the optimizer step and halves its scale. A sparse method
must not send the overflow (it would enter every rank's result and, through the residual, every later
step), so the policy ``"propagate"`` (the hook's default) has every method call whose agreement found
NaN/Inf on any rank return NaN on every rank without communicating, with residual, thresholds and
step counter untouched (:attr:`sparsecomm.methods.Method.nonfinite`). The hook applies it to every
group: sparse, dense (``dense_below``) and the dense warm-up. Within one iteration, once a group has
overflowed every later group of that iteration returns NaN too, without a call (the ranks know it
alike, from the agreement), so that no more state moves in a step GradScaler will skip.

``"skip"`` (zeros, for loops that skip the step themselves on ``stats.skipped``) and ``"error"``
(raise on every rank) stay available. A group that completed before the overflowing one in the
same iteration has communicated and updated its residual as in a normal step (its sent part is then
dropped with the skipped step, as plain DDP drops the whole gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from ..methods import Method, MethodSpec
from ..methods.base import NONFINITE_POLICIES

__all__ = ["HOOK_DEFAULT", "SYNCHRONIZER_DEFAULT", "check_policy", "split_policy", "Overflow"]

#: The hook's default policy: GradScaler sees the overflow, as under plain DDP.
HOOK_DEFAULT = "propagate"
#: The synchronizer's default policy: raise on every rank (no GradScaler sits between it and the step).
SYNCHRONIZER_DEFAULT = "error"


def check_policy(policy: Any) -> str:
    """``policy`` if it is one of :data:`~sparsecomm.methods.NONFINITE_POLICIES`, else ``ValueError``."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={policy!r} must be one of {NONFINITE_POLICIES}")
    return policy


def split_policy(spec: MethodSpec, default: str) -> tuple[MethodSpec, str]:
    """``spec`` without its ``nonfinite`` option, and the policy: that option, else ``default``.

    The hook and the synchronizer take ``nonfinite`` like any method option, but it is their policy for
    every method they build (the method's groups, the dense groups, the dense warm-up), so the grouping
    engine holds it apart from the method's spec."""
    policy = spec.options.get("nonfinite")
    if policy is None:
        return spec, check_policy(default)
    return spec.replace(nonfinite=None), check_policy(policy)


class Overflow:
    """Whether a method call of this iteration found NaN/Inf (the same on every rank)."""

    def __init__(self, policy: str) -> None:
        self.policy = check_policy(policy)
        self.seen = False

    def note(self, method: Method) -> None:
        """After a call: remember an overflow the call's agreement found."""
        if method.stats.skipped and method.stats.extra.get("skipped_reason") == "nonfinite":
            self.seen = True

    def short_circuit(self, grad: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The result for a later group of an overflowed iteration (no call; written into ``out``
        when given), or None to call: NaN (``"propagate"``) or zeros (``"skip"``), shaped like ``grad``."""
        if not self.seen or self.policy == "error":
            return None
        value = float("nan") if self.policy == "propagate" else 0.0
        return torch.full_like(grad, value) if out is None else out.fill_(value)

    def reset(self) -> None:
        self.seen = False
