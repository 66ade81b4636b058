"""Gradient synchronization after ``backward()`` without DDP, for features that need the optimizer.

::

    sync = sparsecomm.SparseSynchronizer(model, optimizer, method="spardl", density=0.01)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        sync.step()             # synchronize the gradients, then optimizer.step()

The model's gradients are flattened into buckets (one by default, or buckets of at most
``bucket_elements`` elements), each with its layer layout; each bucket has its own method instance
(and residual); the averaged result is written back into ``param.grad``. Parameters are broadcast
from rank 0 at construction, as DDP does.

Options that need the optimizer or the local gradient before compression (DGC, Lin et al. 2018;
RedSync, Fang et al., section 4):

* ``clip_norm``: local gradient clipping: each rank clips its own gradient to norm
  ``clip_norm * P**-0.5`` before synchronization (:func:`sparsecomm.integration.dgc.clip_local_gradients`).
* ``dense_warmup_steps``: the first steps are averaged densely (all-reduce).
* ``momentum_correction=m``: DGC momentum correction with momentum factor masking
  (:class:`sparsecomm.integration.dgc.MomentumCorrection`): each rank keeps ``u = m u + g`` and hands
  ``u`` to the method, whose residual accumulates the velocity; ``u`` is zeroed where the method
  sent. The optimizer must then be momentum-free (the momentum lives in ``u``).
* ``density_warmup=E``: DGC's exponential density warm-up over the first E epochs
  (:func:`sparsecomm.integration.dgc.density_schedule`); call :meth:`SparseSynchronizer.set_epoch`.

:meth:`SparseSynchronizer.switch_method` changes the method between steps (the sparse-then-dense schedule
of Shi et al., section 5.6; :mod:`sparsecomm.integration.schedule`): the old method's residuals are added
to the next gradient, so nothing is lost across the switch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.validate import check_int, is_int
from ..methods import Method, Stats, make_method, method_class
from ..transport.comm import Communicator
from . import dgc
from .nonfinite import Overflow
from .schedule import ResidualCarry

__all__ = ["SparseSynchronizer"]

log = logging.getLogger(__name__)


class SparseSynchronizer:
    """Average the gradients of ``model`` over the ranks with a sparsecomm method.

    Args:
        model: the local replica (parameters are broadcast from rank 0 at construction).
        optimizer: stepped by :meth:`step` after synchronization (may be ``None`` when only
            :meth:`synchronize` is used).
        method: a name from :func:`sparsecomm.available_methods`.
        process_group: ``None`` for the default group.
        bucket_elements: split the flat gradient into buckets of at most this many elements
            (parameter boundaries kept); ``None``: one bucket.
        dense_warmup_steps: steps averaged densely before the method takes over.
        clip_norm: local gradient clipping threshold (scaled by P**-0.5 on each rank), or ``None``.
        momentum_correction: the momentum m of DGC momentum correction and factor masking, or
            ``None``; the optimizer must then have no momentum of its own.
        density_warmup: number of epochs of DGC's density warm-up, or ``None``.
        nonfinite (a method option): ``"error"`` (default), ``"skip"`` or ``"propagate"`` (NaN on every
            rank, nothing sent, for ``GradScaler``; :mod:`.nonfinite`); applies to the dense warm-up
            too, and a skipped step leaves the momentum-correction buffer as it was.
        **method_options: for :func:`sparsecomm.make_method` (e.g. ``density=0.01``).

    Raises:
        ValueError / TypeError at construction for a bad option (before any backward).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 method: str = "spardl", *, process_group=None, bucket_elements: int | None = None,
                 dense_warmup_steps: int = 0, clip_norm: float | None = None,
                 momentum_correction: float | None = None, density_warmup: int | None = None,
                 broadcast_parameters: bool = True, **method_options: Any) -> None:
        method_class(method)
        check_int("dense_warmup_steps", dense_warmup_steps, minimum=0)
        if clip_norm is not None and (not isinstance(clip_norm, (int, float)) or not math.isfinite(clip_norm)
                                      or clip_norm <= 0):
            raise ValueError(f"clip_norm={clip_norm!r} must be a positive number or None")
        if bucket_elements is not None and (not isinstance(bucket_elements, int) or bucket_elements < 1):
            raise ValueError(f"bucket_elements={bucket_elements!r} must be a positive integer or None")
        self.model = model
        self.optimizer = optimizer
        self.method_name = method
        self.method_options = dict(method_options)
        self.process_group = process_group
        self.dense_warmup_steps = dense_warmup_steps
        self.clip_norm = clip_norm
        self.iter = 0
        self.comm = Communicator(process_group)
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = self._make_buckets(bucket_elements)
        self.methods: list[Method] = [make_method(method, self.comm, **self.method_options)
                                      for _ in self.buckets]
        self.corrections: list[dgc.MomentumCorrection] | None = None
        if momentum_correction is not None:
            self._check_momentum_correction(momentum_correction)
            self.corrections = [dgc.MomentumCorrection(momentum_correction) for _ in self.buckets]
        if density_warmup is not None and (not is_int(density_warmup)
                                           or density_warmup < 0 or "density" not in self.method_options):
            raise ValueError(f"density_warmup={density_warmup!r} must be a number of epochs (int >= 0) "
                             f"and needs a sparse method with density=")
        self.density_warmup = density_warmup
        self.target_density = self.method_options.get("density")
        self.epoch = 0.0
        self.last_stats = Stats(calls=0)
        self._dense: Method | None = None
        #: residuals of a method switched off, added to the next gradient of their bucket
        self.carry = ResidualCarry()
        self._overflow = Overflow(self.method_options.get("nonfinite", "error"))
        if broadcast_parameters:
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(tensor, src=dist.get_global_rank(process_group, 0)
                                   if process_group is not None else 0, group=process_group)

    def _check_momentum_correction(self, momentum: float) -> None:
        if not self.methods or not self.methods[0].tracks_sent:
            raise ValueError(f"momentum_correction needs a method that reports the indices it sent "
                             f"(last_sent); {self.method_name!r} does not")
        if self.optimizer is not None and any(group.get("momentum", 0) for group in self.optimizer.param_groups):
            raise ValueError("momentum_correction applies the momentum locally before compression: build "
                             "the optimizer with momentum=0 (got momentum "
                             f"{[g.get('momentum') for g in self.optimizer.param_groups]})")
        dgc.MomentumCorrection(momentum)  # validates m

    def switch_method(self, method: str, **method_options: Any) -> None:
        """Synchronize with ``method`` (built with ``method_options``) from the next step on.

        Each bucket's residual under the old method is flushed: added to that bucket's next gradient
        before the new method (or the dense warm-up) averages it, so the sum of what every rank
        contributes is conserved across the switch (Shi et al., section 5.6: MSTopK-SGD first, then
        dense all-reduce).

        Raises:
            ValueError / TypeError: unknown method or option, or a method that momentum correction
                cannot use; the synchronizer is then unchanged.
        """
        methods = [make_method(method, self.comm, **method_options) for _ in self.buckets]
        if self.corrections is not None and methods and not methods[0].tracks_sent:
            raise ValueError(f"momentum_correction needs a method that reports the indices it sent "
                             f"(last_sent); cannot switch to {method!r}")
        for number, old in enumerate(self.methods):
            self.carry.put(number, old.residual)
        log.info("switching from %s to %s at step %d (%d residuals carried)", self.method_name, method,
                 self.iter, len(self.carry))
        self.methods = methods
        self.method_name = method
        self.method_options = dict(method_options)
        self._overflow = Overflow(self.method_options.get("nonfinite", "error"))
        self.target_density = self.method_options.get("density")

    def set_epoch(self, epoch: float) -> None:
        """The current (fractional) epoch, for the density warm-up."""
        self.epoch = float(epoch)

    def _make_buckets(self, limit: int | None) -> list[list[nn.Parameter]]:
        if limit is None:
            return [list(self.params)] if self.params else []
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for param in self.params:
            if buckets[-1] and size + param.numel() > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(param)
            size += param.numel()
        return buckets

    @property
    def in_warmup(self) -> bool:
        return self.iter < self.dense_warmup_steps

    def synchronize(self) -> Stats:
        """Replace every ``param.grad`` by the average over ranks; returns the step's stats
        (elements, output non-zeros, density, bytes, rounds, seconds per phase)."""
        if self.clip_norm is not None:
            dgc.clip_local_gradients(self.params, self.clip_norm, self.comm.size)
        records: list[Stats] = []
        for number, (params, method) in enumerate(zip(self.buckets, self.methods, strict=False)):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            layout, offset = [], 0
            for g in grads:
                layout.append((offset, g.numel()))
                offset += g.numel()
            skipped = self._overflow.short_circuit(flat)
            if skipped is not None:  # an earlier bucket of this step overflowed: no call
                averaged = skipped
            elif self.in_warmup:
                averaged = self._dense_average(self.carry.flush_into(number, flat), records)
            else:
                if self.density_warmup is not None and self.target_density is not None:
                    method.density = dgc.density_schedule(self.epoch, self.target_density, self.density_warmup)
                before = None
                if self.corrections is not None:
                    before = self.corrections[number].state_dict()  # restored if the step is skipped
                    flat = self.corrections[number].update(flat)
                flat = self.carry.flush_into(number, flat)
                averaged = method(flat, layout)
                records.append(method.stats)
                self._overflow.note(method)
                if self.corrections is not None and before is not None and self._overflow.seen:
                    self.corrections[number].load_state_dict(before)  # never poisoned by NaN/Inf
                elif self.corrections is not None and method.last_sent is not None:
                    self.corrections[number].mask_(method.last_sent)
            for param, (start, numel) in zip(params, layout, strict=False):
                piece = averaged[start:start + numel].view_as(param)
                if param.grad is None:
                    param.grad = piece.clone()
                else:
                    param.grad.copy_(piece)
        self.iter += 1
        self._overflow.reset()
        self.last_stats = Stats.total(records)
        return self.last_stats

    def _dense_average(self, flat: torch.Tensor, records: list[Stats]) -> torch.Tensor:
        if self._dense is None:
            self._dense = make_method("dense", self.comm, nonfinite=self._overflow.policy)
        averaged = self._dense(flat)
        self._dense.stats.update(warmup=True, dense_calls=1)
        records.append(self._dense.stats)
        self._overflow.note(self._dense)
        return averaged

    def step(self, closure=None):
        """:meth:`synchronize`, then ``optimizer.step(closure)``."""
        if self.optimizer is None:
            raise RuntimeError("SparseSynchronizer.step needs the optimizer; pass it at construction "
                               "or call synchronize()")
        self.synchronize()
        return self.optimizer.step(closure)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Step counter and each bucket's method state (residual, step, extra); the optimizer's state
        is saved by the optimizer."""
        state = {"method": self.method_name, "iter": self.iter,
                 "buckets": [m.state_dict() for m in self.methods], "carry": self.carry.state_dict()}
        if self.corrections is not None:
            state["momentum_correction"] = [c.state_dict() for c in self.corrections]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method_name:
            raise ValueError(f"state_dict of method {state.get('method')!r} cannot load into a "
                             f"synchronizer of method {self.method_name!r}")
        if len(state["buckets"]) != len(self.methods):
            raise ValueError(f"state_dict holds {len(state['buckets'])} buckets, this synchronizer "
                             f"{len(self.methods)}; use the same model and bucket_elements")
        self.iter = int(state["iter"])
        for method, saved in zip(self.methods, state["buckets"], strict=False):
            method.load_state_dict(saved)
        self.carry.load_state_dict(state.get("carry", {}))
        if self.corrections is not None:
            for correction, saved in zip(self.corrections, state["momentum_correction"], strict=False):
                correction.load_state_dict(saved)

    def __repr__(self) -> str:
        return (f"SparseSynchronizer(method={self.method_name!r}, options={self.method_options}, "
                f"buckets={len(self.buckets)}, iter={self.iter})")
