"""Training techniques that keep sparse synchronization accurate at 0.1% density (DGC, Lin et al.
2017, as adopted by RedSync, Fang et al. section 2.5), as small pure pieces usable with every method.

* :class:`MomentumCorrection`: DGC momentum correction and momentum factor masking.
* :func:`clip_local_gradients`: DGC local gradient clipping, threshold scaled by N^-1/2 (RedSync 2.4).
* :func:`density_schedule`: the exponential density warm-up 25%, 6.25%, 1.5625%, 0.4%, then target.

Dense warm-up (RedSync section 2.5) is the ``dense`` method for the first steps: the hook's and the
synchronizer's ``dense_warmup_steps``.

One training step of a worker with all of them (what ``SparseSynchronizer`` does; ``method`` any
sparse method of :mod:`sparsecomm.methods`, ``flat_grad`` this rank's gradient bucket)::

    clip_local_gradients(model.parameters(), max_norm, world_size)      # before accumulation
    if step < dense_warmup_steps:
        update = dense(flat_grad)                                        # plain average
    else:
        method.set_density(density_schedule(epoch, target, warmup_epochs))  # optional
        u = correction.update(flat_grad)          # u = m u + g; the method's residual is v
        update = method(u, layout)                # v += u; send top of v; v[sent] = 0
        correction.mask_(method.last_sent)        # momentum factor masking: u[sent] = 0
    # apply ``update`` with plain SGD (momentum=0): the momentum already lives in u
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..core.buffers import long_lived_empty, long_lived_zeros
from ..core.validate import check_fraction

__all__ = ["MomentumCorrection", "clip_local_gradients", "density_schedule"]


class MomentumCorrection:
    """DGC momentum correction (Lin et al. 2017, section 3.2) with momentum factor masking.

    Dense momentum SGD keeps ``u_t = m u_{t-1} + g_t`` and steps by ``u_t``; sparse training must
    accumulate the *velocity* (not the gradient) locally, ``v_t = v_{t-1} + u_t``, send the large
    entries of ``v``, and zero both ``u`` and ``v`` where it sent (masking stops stale momentum from
    pushing an entry that was already applied).

    Two ways to use it:

    * with a method that keeps its own residual (every sparse method here): ``u = mc.update(g)``,
      pass ``u`` to the method (its residual is ``v``), then ``mc.mask_(method.last_sent)``.
    * standalone (``hold_accumulation=True``): ``v = mc.update(g)`` returns ``v``; after selecting
      and sending ``v[sent]`` call ``mc.mask_(sent)``, which zeroes ``u`` and ``v`` there.

    Apply the synchronized result with momentum-free SGD: the momentum is already in ``u``.

    A step that is dropped after :meth:`update` (the synchronization found NaN/Inf on some rank) is
    taken back with :meth:`undo_`: ``u`` and ``v`` are again those before the step. The previous ones
    are kept in a second buffer that the next update reuses (no copy, no allocation per step).

    Args:
        momentum: m in [0, 1).
        nesterov: Nesterov variant of DGC: accumulate ``u_t + g_t`` (after ``u_t = m u + g``)
            instead of ``u_t``, i.e. ``g + m u_t``.
        hold_accumulation: keep ``v`` here (standalone use) instead of in a method's residual.
    """

    def __init__(self, momentum: float, *, nesterov: bool = False, hold_accumulation: bool = False) -> None:
        check_fraction("momentum", momentum, allow_zero=True, allow_one=False)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.hold_accumulation = bool(hold_accumulation)
        self.velocity: Tensor | None = None       # u
        self.accumulation: Tensor | None = None   # v (only when hold_accumulation)
        self._previous: tuple[Tensor, Tensor | None] | None = None  # u, v before the last update
        self._undoable = False

    def update(self, grad: Tensor) -> Tensor:
        """``u = m u + g``; returns what to sparsify next: ``v += u`` (held) or ``u`` (residual-keeping
        method). With ``nesterov``, ``g + m u`` takes the place of ``u`` in the accumulation.

        The result is a new tensor the caller owns (``v`` itself when held, which :meth:`mask_` then
        zeroes where sent). The velocity update is one pass over ``u`` and ``g``; :meth:`velocity_of`
        and :meth:`velocity_of_pieces` skip the copy of ``u``."""
        new_velocity, new_accumulation, old = self._next_buffers(grad)
        self.velocity = torch.add(grad, old, alpha=self.momentum, out=new_velocity)
        step = torch.add(grad, self.velocity, alpha=self.momentum) if self.nesterov else self.velocity
        if not self.hold_accumulation:
            return step if self.nesterov else step.clone()
        assert self.accumulation is not None and new_accumulation is not None
        self.accumulation = torch.add(self.accumulation, step, out=new_accumulation)
        return self.accumulation

    def _next_buffers(self, like: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """The buffers the next ``u`` (and ``v``) are written into, and the current ``u``; the current
        ones become the previous, which :meth:`undo_` restores (made on first use, or for a new size)."""
        if self.velocity is None or self.velocity.shape != like.shape:
            self.velocity = long_lived_zeros(like.shape, dtype=like.dtype, device=like.device)
            self.accumulation = long_lived_zeros(like.shape, dtype=like.dtype, device=like.device) \
                if self.hold_accumulation else None
            self._previous = None
        if self._previous is None:
            self._previous = (long_lived_empty(like.shape, dtype=like.dtype, device=like.device),
                              None if self.accumulation is None
                              else long_lived_empty(like.shape, dtype=like.dtype, device=like.device))
        new_velocity, new_accumulation = self._previous
        self._previous = (self.velocity, self.accumulation)
        self._undoable = True
        return new_velocity, new_accumulation, self.velocity

    def velocity_of_pieces(self, like: Tensor, pieces: Sequence[tuple[int, int, Tensor | None]]) -> Tensor:
        """:meth:`velocity_of` for a 1-D gradient given in pieces ``(offset, numel, tensor or None)``
        that together cover every element of ``like`` (a tensor of the gradient's length, dtype and
        device; ``None``: a zero piece), such as the parameters' ``.grad``: ``u = m u + g`` is written
        piece by piece, without first gathering ``g`` into one tensor (one pass less)
        (:class:`~sparsecomm.integration.synchronizer.SparseSynchronizer` passes ``u`` to the method)."""
        if self.nesterov or self.hold_accumulation:
            raise ValueError("velocity_of: only without nesterov and hold_accumulation (the step is then u itself)")
        if sum(numel for _, numel, _ in pieces) != like.numel():
            raise ValueError(f"velocity_of_pieces: the pieces must cover the {like.numel()} elements of the gradient")
        new_velocity, _, old = self._next_buffers(like)
        for offset, numel, piece in pieces:
            end = offset + numel
            if piece is None:
                torch.mul(old[offset:end], self.momentum, out=new_velocity[offset:end])
            else:
                torch.add(piece.reshape(-1), old[offset:end], alpha=self.momentum, out=new_velocity[offset:end])
        self.velocity = new_velocity
        return self.velocity

    def velocity_of(self, grad: Tensor) -> Tensor:
        """:meth:`update` for a residual-keeping method and a 1-D ``grad``, returning ``u`` itself instead
        of a copy: one pass, nothing allocated. ``u`` is this object's state: only read it (a method's
        input is read only), and only until the next :meth:`update`, :meth:`velocity_of` or
        :meth:`mask_`."""
        return self.velocity_of_pieces(grad, [(0, grad.numel(), grad)])

    def undo_(self) -> None:
        """Take back the last :meth:`update` (its step was dropped): ``u`` and ``v`` as before it."""
        if not self._undoable or self._previous is None:
            raise RuntimeError("MomentumCorrection.undo_ needs an update() to take back")
        assert self.velocity is not None
        current = (self.velocity, self.accumulation)
        self.velocity, self.accumulation = self._previous
        self._previous = current  # reused by the next update
        self._undoable = False

    def mask_(self, sent: Tensor) -> None:
        """Momentum factor masking: zero ``u`` (and ``v`` when held) at ``sent`` (int64 indices or a
        boolean mask of the same length)."""
        if self.velocity is None:
            raise RuntimeError("MomentumCorrection.mask_ called before update()")
        if sent.dtype == torch.bool and sent.shape != self.velocity.shape:
            raise ValueError(f"boolean mask of shape {tuple(sent.shape)} must match the velocity's "
                             f"{tuple(self.velocity.shape)}")
        self.velocity[sent] = 0
        if self.accumulation is not None:
            self.accumulation[sent] = 0

    def state_dict(self) -> dict:
        return {"momentum": self.momentum, "nesterov": self.nesterov, "hold_accumulation": self.hold_accumulation,
                "velocity": None if self.velocity is None else self.velocity.clone(),
                "accumulation": None if self.accumulation is None else self.accumulation.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.momentum = float(state["momentum"])
        self.nesterov = bool(state["nesterov"])
        self.hold_accumulation = bool(state["hold_accumulation"])
        self.velocity = None if state["velocity"] is None else state["velocity"].clone()
        self.accumulation = None if state["accumulation"] is None else state["accumulation"].clone()
        self._previous = None
        self._undoable = False


def clip_local_gradients(params: Tensor | Iterable[Tensor], max_norm: float, world_size: int) -> Tensor:
    """DGC local gradient clipping: clip this worker's gradients to ``max_norm * world_size**-0.5``
    (RedSync section 2.4) *before* they are added to the residual; returns the total norm before
    clipping. ``params``: tensors with ``.grad``, as for :func:`torch.nn.utils.clip_grad_norm_`."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be positive")
    return torch.nn.utils.clip_grad_norm_(params, max_norm / math.sqrt(world_size))


def density_schedule(epoch: float, target: float, warmup_epochs: int = 4, initial: float = 0.25,
                     decay: float = 0.25) -> float:
    """DGC's exponential density warm-up: ``initial * decay**floor(epoch)`` during the first
    ``warmup_epochs`` epochs (25%, 6.25%, 1.5625%, 0.39% by default), never below ``target``, then
    ``target``."""
    if not 0 < target <= 1:
        raise ValueError(f"target={target!r} must be a density in (0, 1]")
    if epoch < 0:
        raise ValueError(f"epoch={epoch!r} must be >= 0")
    if not 0 < initial <= 1 or not 0 < decay <= 1:
        raise ValueError(f"initial={initial!r} and decay={decay!r} must lie in (0, 1]")
    e = int(math.floor(epoch))
    if e >= warmup_epochs:
        return target
    return max(target, initial * decay ** e)
