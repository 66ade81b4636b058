"""Method schedules: change the synchronization method at given epochs.

Shi et al. (section 5.6, the DAWNBench case study) train ResNet-50 with MSTopK-SGD over HiTopKComm for
the first 13 epochs, while the small input images make the computation short and a dense all-reduce
would not scale, and then switch to the dense 2D-torus all-reduce. A schedule says which method runs
from which epoch on::

    schedule = MethodSchedule.parse("hitopk", "13:torus2d")   # hitopk for epochs 0-12, then torus2d
    schedule = MethodSchedule(MethodSpec("hitopk", {"density": 0.01}), ((13, MethodSpec("torus2d")),))

At a switch nothing is lost: the residuals the old method kept (what it did not send) are *flushed*,
added to the next gradient that the new method synchronizes, so the error-feedback conservation law
holds across the switch (:class:`ResidualCarry`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..methods import MethodSpec, is_sparse

__all__ = ["MethodSchedule", "ResidualCarry"]


@dataclass(frozen=True)
class MethodSchedule:
    """The method of each epoch: ``initial`` from epoch 0, then each ``(epoch, method)`` switch in order.

    Each method is a :class:`~sparsecomm.methods.MethodSpec` (options included) or a name whose
    options the owner of the schedule supplies (:meth:`spec_at`).

    Raises:
        ValueError: a switch epoch that is not an integer >= 1 or not increasing, or an unknown method.
    """

    initial: MethodSpec | str
    switches: tuple[tuple[int, MethodSpec | str], ...] = ()

    def __post_init__(self) -> None:
        _check_method(self.initial)
        last = 0
        for epoch, method in self.switches:
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch <= last:
                raise ValueError(f"schedule switch epoch {epoch!r} must be an integer >= 1 and larger than "
                                 f"the previous switch's ({last})")
            _check_method(method)
            last = epoch

    @classmethod
    def parse(cls, initial: str, spec: str | None) -> MethodSchedule:
        """``spec`` is ``"EPOCH:METHOD[,EPOCH:METHOD...]"`` (e.g. ``"13:torus2d"``), or empty/None."""
        switches = []
        for item in (spec or "").split(","):
            if not item.strip():
                continue
            epoch, sep, name = item.partition(":")
            if not sep or not epoch.strip().isdigit() or not name.strip():
                raise ValueError(f"schedule entry {item.strip()!r} must read EPOCH:METHOD, e.g. '13:torus2d'")
            switches.append((int(epoch), name.strip()))
        return cls(initial, tuple(switches))

    def _entry_at(self, epoch: int) -> MethodSpec | str:
        current = self.initial
        for start, method in self.switches:
            if epoch >= start:
                current = method
        return current

    def method_at(self, epoch: int) -> str:
        """The name of the method that synchronizes epoch ``epoch`` (0-based)."""
        return _name(self._entry_at(epoch))

    def spec_at(self, epoch: int, density: float | None = None) -> MethodSpec:
        """The method of epoch ``epoch`` as a spec; a method given by name gets ``density`` when it is
        sparse."""
        entry = self._entry_at(epoch)
        if isinstance(entry, MethodSpec):
            return entry
        return MethodSpec(entry, {"density": density} if is_sparse(entry) else {})

    @property
    def methods(self) -> list[str]:
        """Every method the schedule uses, in order of first use."""
        return list(dict.fromkeys([_name(self.initial), *(_name(method) for _, method in self.switches)]))

    def __str__(self) -> str:
        return ",".join([f"0:{_name(self.initial)}", *(f"{epoch}:{_name(method)}" for epoch, method in self.switches)])


def _name(method: MethodSpec | str) -> str:
    return method.name if isinstance(method, MethodSpec) else method


def _check_method(method: MethodSpec | str) -> None:
    """A spec was checked when it was made; a name must be a known method (ValueError listing them)."""
    if not isinstance(method, MethodSpec):
        is_sparse(method)


class ResidualCarry:
    """Residuals left by a method that was switched off, waiting to be added to the next gradient.

    Keyed like the owner's method instances (a bucket number, a parameter name): :meth:`put` takes a
    residual (added to whatever is already waiting), :meth:`flush_into` adds the waiting tensor to a
    gradient and forgets it (:meth:`added_to` and :meth:`discard` do the two apart).
    """

    def __init__(self) -> None:
        self.waiting: dict[object, torch.Tensor] = {}

    def put(self, key: object, residual: torch.Tensor | None) -> None:
        if residual is None:
            return
        if key in self.waiting:
            self.waiting[key] += residual
        else:
            self.waiting[key] = residual.detach().clone()

    def flush_into(self, key: object, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the residual waiting under ``key`` (``grad`` itself when none waits); the
        residual is forgotten."""
        total = self.added_to(key, grad)
        self.discard(key)
        return total

    def added_to(self, key: object, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the residual waiting under ``key`` (``grad`` itself when none waits); the
        residual keeps waiting until :meth:`discard` (a step that is dropped leaves it for the next)."""
        residual = self.waiting.get(key)
        if residual is None:
            return grad
        if residual.shape != grad.shape:
            raise ValueError(f"carried residual of shape {tuple(residual.shape)} does not fit the gradient of "
                             f"shape {tuple(grad.shape)} (key {key!r}); the model or bucketing changed")
        return grad + residual.to(grad.dtype)

    def discard(self, key: object) -> None:
        """Forget the residual waiting under ``key`` (it has reached the method)."""
        self.waiting.pop(key, None)

    def __len__(self) -> int:
        return len(self.waiting)

    def state_dict(self) -> dict[object, torch.Tensor]:
        return {key: value.clone() for key, value in self.waiting.items()}

    def load_state_dict(self, state: dict[object, torch.Tensor]) -> None:
        self.waiting = {key: value.clone() for key, value in state.items()}
