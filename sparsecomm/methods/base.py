"""The method interface: a flat local gradient in, the averaged global gradient out.

A method (a *reducer*) is built inside a worker with :func:`sparsecomm.make_method`. Calling it on this
rank's flat gradient bucket returns the average over ranks of what the method communicates, identical
on every rank, and leaves in :attr:`Method.stats` what the call cost and selected. Methods with error
feedback keep what they did not send in :attr:`Method.residual`.

A subclass implements :meth:`Method.reduce` and, beside it, its cost formula. Everything else a call
needs (checks agreed with every rank, the non-finite policy, failures, timing, traffic, the output
buffer, the residual's buffers) is the runner's (:mod:`.runner`); a method with error feedback may hand
it the start of its call (:meth:`Method.accumulate`, :meth:`Method.first_message`) so that the runner
can overlap it with those checks. docs/adding-a-method.md walks through a new method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..core.registry import Registry
from ..core.validate import check_fraction
from ..transport.comm import Communicator
from .accumulation import FirstMessage
from .checks import NONFINITE_POLICIES, AgreementError, NonFiniteGradientError
from .output import Output
from .runner import CallRunner
from .stats import PhaseTimer, Stats

__all__ = ["Method", "Output", "Layout", "METHODS", "register_method", "selection_count", "check_density",
           "AgreementError", "NonFiniteGradientError", "NONFINITE_POLICIES"]

Layout = Sequence[tuple[int, int]] | None
"""Optional (offset, numel) of each layer packed in the flat gradient, in order."""


class Method:
    """Base class of every synchronization method.

    Args:
        comm: the communicator to use; ``None`` builds one over the default process group.
        density: for sparse methods, the fraction of elements each rank selects,
            ``k = ceil(density * n)``; must lie in (0, 1]. Dense methods take none.
    """

    name: str = "method"
    #: True when the method keeps an error-feedback residual of length n.
    has_residual: bool = False
    #: True when the method takes ``density``.
    sparse: bool = False
    #: True when every call sets :attr:`last_sent` (needed by DGC momentum masking).
    tracks_sent: bool = False
    #: For methods whose result is an estimate (a sketch): options under which it is exact, so that
    #: density 1 with them returns the dense average (DESIGN invariant 3). Empty for exact methods.
    exact_options: dict[str, Any] = {}

    def __init__(self, comm: Communicator | None = None, *, density: float | None = None) -> None:
        self.comm = comm if comm is not None else Communicator()
        self._density = check_density(self.name, self.sparse, density)
        #: local int64 indices whose accumulated value this rank sent in the last call (None when the
        #: method does not track them); DGC momentum masking uses it.
        self.last_sent: torch.Tensor | None = None
        self.step = 0
        self.stats = Stats()
        #: the options ``make_method`` built this method with (checked equal on every rank per call)
        self.options: dict[str, Any] = {}
        self._nonfinite = "error"
        self._runner = CallRunner(self, METHODS.names)

    # ------------------------------------------------------------------ to implement
    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        """The average over ranks of what this rank communicates of ``grad`` (1-D, floating), the same
        bits on every rank, written with ``out``'s writers (or returned as a tensor of its own).
        Subclasses implement it; it runs once every rank agreed on the call."""
        raise NotImplementedError

    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, layout: Layout) -> Any:
        """Optional, for error feedback: write ``acc = residual + grad``, best in one pass with the
        selection (a selector's ``accumulate(residual, grad, k, dest=acc)``), and return what ``reduce``
        needs of it (``out.accumulated.picked``). It may run before the ranks agreed on the call: it
        raises :class:`~sparsecomm.selection.NonFiniteInputError` on a NaN/Inf gradient (the fused scans
        do; :func:`.accumulation.add_checked` without a selection), sends nothing and changes no state
        but ``acc`` and what :meth:`moved_by_accumulate` lists. ``acc is residual`` when it runs in place,
        after the agreement (not on the CPU). The runner then makes ``acc`` the residual."""
        raise NotImplementedError

    @property
    def accumulates(self) -> bool:
        """Whether this call runs :meth:`accumulate` (default: when the class defines it)."""
        return type(self).accumulate is not Method.accumulate

    def first_message(self, acc: torch.Tensor, picked: Any) -> FirstMessage | None:
        """Optional, after :meth:`accumulate`: the message this call sends first, built from ``acc`` and
        changing no state but ``acc`` (:mod:`.accumulation`); the runner sends it, in the agreement's
        messages where it can, and ``reduce`` gets what it brought (``out.accumulated.replies``)."""
        return None

    def moved_by_accumulate(self) -> Iterable[Any]:
        """The objects (stateful selectors) whose state :meth:`accumulate` or :meth:`first_message`
        moves: the runner saves their ``state_dict()`` and loads it back when the call does not go on."""
        return ()

    def extra_state(self) -> dict[str, Any]:
        """Method-specific state to checkpoint besides residual and step."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"method {self.name!r} has no extra state, got keys {sorted(state)}")

    @classmethod
    def topk_blocks(cls, P: int, n: int, scan: bool = True, **options: Any) -> list[int]:
        """The sizes of the blocks one rank selects from by a top-k of its own, per call, besides the
        selection its accumulation's scan makes (``scan``: the compiled CPU kernel selects while it
        accumulates). The simulator costs how their number and sizes change with P
        (:func:`~sparsecomm.simulator.model.block_topk_seconds`). Empty for a method whose selection
        is one pass over the gradient at any P (the default)."""
        return []

    # ------------------------------------------------------------------ helpers for subclasses
    def k(self, n: int) -> int:
        """Number of elements to select out of n: ceil(density * n), at least 1 when n > 0."""
        assert self.density is not None
        return selection_count(self.density, n)

    def timer(self, phase: str) -> PhaseTimer:
        """Add the wall time of the ``with`` block to ``stats.time_<phase>``."""
        return self._runner.timer(phase)

    def residual_for(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's residual, created as zeros like ``grad`` on first use (or when n changes), for a
        ``reduce`` that updates it in place (a method without :meth:`accumulate`)."""
        return self._runner.residuals.for_update(grad)

    @property
    def residual(self) -> torch.Tensor | None:
        """What this rank did not send, kept for its next call (``None`` before the first)."""
        return self._runner.residuals.current

    @residual.setter
    def residual(self, residual: torch.Tensor | None) -> None:
        self._runner.residuals.current = residual

    @property
    def density(self) -> float | None:
        """The fraction of elements each rank selects (``None`` for a dense method)."""
        return self._density

    @density.setter
    def density(self, density: float) -> None:
        self.set_density(density)

    def set_density(self, density: float) -> None:
        """Select ``ceil(density * n)`` elements from the next call on (e.g. DGC's density warm-up,
        :func:`sparsecomm.integration.dgc.density_schedule`); same rule as at construction. Every
        rank must set the same density before the same call (the call's checks compare it)."""
        self._density = check_density(self.name, self.sparse, density)

    @property
    def nonfinite(self) -> str:
        """What a call does when a rank's gradient holds NaN/Inf: ``"error"`` (default) raises on
        every rank, ``"skip"`` skips the step on every rank (returns zeros, ``stats.skipped = 1``),
        ``"propagate"`` returns NaN everywhere on every rank without communicating
        (``stats.skipped = 1``), as plain DDP's all-reduce passes an overflow on, so that
        ``torch.amp.GradScaler`` skips the optimizer step and lowers its scale (the DDP hook's
        default). In every case residual, step and every other state stay unchanged."""
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: str) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={policy!r} must be one of {NONFINITE_POLICIES}")
        self._nonfinite = policy

    # ------------------------------------------------------------------ the call
    def __call__(self, grad: torch.Tensor, layout: Layout = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Average ``grad`` (this rank's 1-D float gradient) over all ranks with this method.

        Returns a new tensor the caller owns; with ``out=buf`` (torch's convention) the result is
        written into ``buf`` (same shape, dtype and device as ``grad``, not overlapping it) and ``buf``
        is returned, without allocating a length-n tensor.

        Every call first agrees with the other ranks on what they are about to do; on a disagreement
        or a non-finite input every rank raises the same error (or, with ``nonfinite="skip"``, skips
        the step) before anything is sent, with the residual, the step and every other state
        unchanged, so the call can be retried (:mod:`.runner`).
        """
        return self._runner(grad, layout, out)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Residual, step and method-specific state; enough to resume without losing a residual."""
        return {"name": self.name, "step": self.step,
                "residual": None if self.residual is None else self.residual.clone(),
                "extra": self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state_dict of method {state.get('name')!r} cannot load into {self.name!r}")
        self.step = int(state["step"])
        self.residual = None if state["residual"] is None else state["residual"].clone()
        self.load_extra_state(state.get("extra", {}))

    def __repr__(self) -> str:
        dens = "" if self.density is None else f", density={self.density:g}"
        return f"{type(self).__name__}(P={self.comm.size}{dens})"


def check_density(method: str, sparse: bool, density: Any) -> float | None:
    """The one rule for ``density``: a sparse method needs one in (0, 1], a dense method takes none.
    Returns it as a float (``None`` for a dense method)."""
    if not sparse:
        if density is not None:
            raise ValueError(f"method {method!r} is dense and takes no density (got {density!r})")
        return None
    if density is None:
        raise ValueError(f"method {method!r} needs density= (a fraction in (0, 1])")
    try:
        return check_fraction("density", density)
    except ValueError as exc:
        raise ValueError(f"method {method!r}: {exc}") from None


def selection_count(density: float, n: int) -> int:
    """k for ``density`` over n elements: ceil(density * n), at least 1 when n > 0, at most n."""
    return min(n, max(1 if n else 0, math.ceil(density * n)))


#: Every method class by name (``@register_method("name")`` adds one).
METHODS: Registry[type[Method]] = Registry("method")


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator registering a :class:`Method` subclass under ``name`` (sets ``cls.name``)."""
    return METHODS.register(name)
