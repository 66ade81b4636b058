"""Gradient synchronization after ``backward()`` without DDP, for features that need the optimizer.

::

    sync = sparsecomm.SparseSynchronizer(model, optimizer, method="spardl", density=0.01)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        sync.step()             # synchronize the gradients, then optimizer.step()

The model's gradients are gathered into buckets (one by default, or buckets of at most
``bucket_elements`` elements), each with its layer layout; each bucket has its own method instance
(and residual); the averaged result is written into the bucket's output tensor and ``param.grad``
becomes a view of it (as with DDP's ``gradient_as_bucket_view=True``: no copy per step; a reference to
``param.grad`` kept across steps sees the next step's values). The buckets are the groups
of the grouping engine the DDP hook shares (:class:`~.engine.GroupingEngine`: flat buffers, the
small-tensor rule ``dense_below``, warm-up, switches, residual carry, stats, checkpoint); this class
keeps ``param.grad`` and the optimizer-side techniques. Parameters are broadcast from rank 0 at
construction, as DDP does, once every rank has been found to hold the same parameters and buffers
(count, shapes, dtypes: one small collective, :func:`~.consistency.check_same_tensors`), so that a
model that differs across ranks is one error on every rank instead of a hang.

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
* ``freeze_adam_variance=True`` (Adam and AdamW): after the dense warm-up, Adam's second moment is
  frozen, each rank's gradient is preconditioned by it before the method selects, and :meth:`step`
  applies AdamW's step with the frozen moment (:mod:`sparsecomm.integration.adam`: error feedback
  then conserves every element's step, which Adam's live normalization would undo).

Non-finite gradients follow the ``nonfinite`` option (:mod:`.nonfinite`; default ``"error"``) in
every bucket, dense ones and the warm-up included; once a bucket of a step found NaN/Inf on some
rank, the later buckets of that step make no call, and the momentum correction of a dropped step is
taken back, so NaN/Inf never enters it.

:meth:`SparseSynchronizer.switch_method` changes the method between steps (the sparse-then-dense schedule
of Shi et al., section 5.6; :mod:`sparsecomm.integration.schedule`): the old method's residuals are added
to the next gradient, so nothing is lost across the switch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.validate import check_int, is_int
from ..methods import Method, MethodSpec, Stats
from ..transport.comm import Communicator
from . import dgc
from .adam import FrozenVarianceAdam
from .auto import DenseFallback, as_dense_fallback
from .consistency import check_same_tensors
from .engine import EngineView, GroupingEngine
from .nonfinite import SYNCHRONIZER_DEFAULT
from .residuals import Group
from .world import agree_on_load, fold, live_world, tensor_problem

__all__ = ["SparseSynchronizer"]

log = logging.getLogger(__name__)


class SparseSynchronizer(EngineView):
    """Average the gradients of ``model`` over the ranks with a sparsecomm method.

    Args:
        model: the local replica (parameters are broadcast from rank 0 at construction).
        optimizer: stepped by :meth:`step` after synchronization (may be ``None`` when only
            :meth:`synchronize` is used).
        method: a :class:`~sparsecomm.methods.MethodSpec`, or a name from
            :func:`sparsecomm.available_methods` with ``method_options``.
        process_group: ``None`` for the default group.
        bucket_elements: split the flat gradient into buckets of at most this many elements
            (parameter boundaries kept); ``None``: one bucket.
        dense_warmup_steps: steps averaged densely before the method takes over.
        dense_below: parameters with fewer elements, or whose sparse message would not be smaller
            than the dense one, are averaged densely in one fused call; 0 (default): none.
        clip_norm: local gradient clipping threshold (scaled by P**-0.5 on each rank), or ``None``.
        momentum_correction: the momentum m of DGC momentum correction and factor masking, or
            ``None``; the optimizer must then have no momentum of its own.
        density_warmup: number of epochs of DGC's density warm-up, or ``None``.
        freeze_adam_variance: with a ``torch.optim.Adam``/``AdamW`` optimizer and
            ``dense_warmup_steps >= 1``: freeze Adam's second moment at the end of the warm-up and
            synchronize the preconditioned gradient (:mod:`sparsecomm.integration.adam`); :meth:`step`
            then makes the optimizer's step itself.
        dense_warmup_dtype: the floating dtype the dense warm-up's all-reduce travels in, the average
            cast back (``torch.bfloat16`` halves the warm-up's bytes, as torch's ``bf16_compress_hook``);
            ``None`` (default): the gradient's own.
        dense_fallback: time the first dense and sparse steps and keep the method only if its steps are
            enough shorter (``True``); otherwise average densely from then on (:mod:`.auto`). A
            :class:`~.auto.DenseFallback` sets the probe, the margin or a pinned decision.
        **method_options: for :func:`sparsecomm.make_method` (e.g. ``density=0.01``), and
            ``nonfinite``: when any rank's gradient holds NaN/Inf, ``"error"`` (default: raise on every
            rank), ``"skip"`` (zeros) or ``"propagate"`` (NaN on every rank, for ``GradScaler``); for
            every bucket, dense ones and the warm-up included, nothing sent and no state moved.

    Raises:
        ValueError / TypeError at construction for a bad option (before any backward).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 method: MethodSpec | str = "spardl", *, process_group=None, bucket_elements: int | None = None,
                 dense_warmup_steps: int = 0, dense_warmup_dtype: torch.dtype | None = None,
                 dense_below: int = 0, clip_norm: float | None = None,
                 momentum_correction: float | None = None, density_warmup: int | None = None,
                 freeze_adam_variance: bool = False, dense_fallback: bool | DenseFallback | None = False,
                 broadcast_parameters: bool = True,
                 **method_options: Any) -> None:
        spec = MethodSpec.of(method, method_options)
        check_int("dense_warmup_steps", dense_warmup_steps, minimum=0)
        check_int("dense_below", dense_below, minimum=0)
        if clip_norm is not None and (not isinstance(clip_norm, (int, float)) or not math.isfinite(clip_norm)
                                      or clip_norm <= 0):
            raise ValueError(f"clip_norm={clip_norm!r} must be a positive number or None")
        if bucket_elements is not None and (not isinstance(bucket_elements, int) or bucket_elements < 1):
            raise ValueError(f"bucket_elements={bucket_elements!r} must be a positive integer or None")
        if density_warmup is not None and (not is_int(density_warmup) or density_warmup < 0 or not spec.sparse):
            raise ValueError(f"density_warmup={density_warmup!r} must be a number of epochs (int >= 0) "
                             f"and needs a sparse method with density=")
        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self.clip_norm = clip_norm
        self.comm = Communicator(process_group)
        # before any per-tensor collective: a model that differs across ranks is one error on every rank
        # (the broadcast below would hang, or abort in gloo, on tensors that do not pair up)
        check_same_tensors([*model.named_parameters(), *model.named_buffers()], process_group)
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        self.adam: FrozenVarianceAdam | None = None
        if freeze_adam_variance:
            if optimizer is None or dense_warmup_steps < 1:
                raise ValueError("freeze_adam_variance needs the Adam/AdamW optimizer and dense_warmup_steps >= 1 "
                                 "(the warm-up estimates the second moment)")
            self.adam = FrozenVarianceAdam(optimizer, self.params, momentum_correction=momentum_correction is not None)
            if momentum_correction is not None and dense_below:
                raise ValueError("freeze_adam_variance with momentum_correction keeps the momentum in the method's "
                                 "velocity, which dense_below's dense groups do not have: use dense_below=0")
            if momentum_correction is not None and momentum_correction != self.adam.beta1():
                raise ValueError(f"momentum_correction={momentum_correction!r} with freeze_adam_variance is Adam's "
                                 f"first moment: give its beta1, {self.adam.beta1()!r}")
        if momentum_correction is not None:
            self._check_momentum_correction(momentum_correction, spec)
        self._preconditioned = False  # whether the last synchronize() left preconditioned averages
        self.engine = GroupingEngine(spec, lambda: self.comm, dense_warmup_steps=dense_warmup_steps,
                                     dense_below=dense_below, nonfinite_default=SYNCHRONIZER_DEFAULT,
                                     dense_fallback=as_dense_fallback(dense_fallback),
                                     warmup_dtype=dense_warmup_dtype)
        self.engine.build(self._make_buckets(bucket_elements))
        self.corrections: list[dgc.MomentumCorrection] | None = None
        if momentum_correction is not None:
            self.corrections = [dgc.MomentumCorrection(momentum_correction) for _ in self.engine.groups]
        self.density_warmup = density_warmup
        self.target_density = spec.density
        self.epoch = 0.0
        self.last_stats = Stats(calls=0)
        if broadcast_parameters:
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(tensor, src=dist.get_global_rank(process_group, 0)
                                   if process_group is not None else 0, group=process_group)

    def _check_momentum_correction(self, momentum: float, spec: MethodSpec) -> None:
        if not spec.cls.tracks_sent:
            raise ValueError(f"momentum_correction needs a method that reports the indices it sent "
                             f"(last_sent); {spec.name!r} does not")
        if self.adam is None and self.optimizer is not None \
                and any(group.get("momentum", 0) for group in self.optimizer.param_groups):
            raise ValueError("momentum_correction applies the momentum locally before compression: build "
                             "the optimizer with momentum=0 (got momentum "
                             f"{[g.get('momentum') for g in self.optimizer.param_groups]})")
        dgc.MomentumCorrection(momentum)  # validates m

    # ------------------------------------------------------------------ what the engine holds
    @property
    def methods(self) -> list[Method]:
        """Each bucket's method instance."""
        return [group.method for group in self.engine.groups]

    @property
    def buckets(self) -> list[list[nn.Parameter]]:
        """Each bucket's parameters, in bucket order."""
        return [[self.params[pid] for pid in group.ids] for group in self.engine.groups]

    @property
    def iter(self) -> int:
        return self.engine.iter

    @property
    def preconditioned(self) -> bool:
        """Whether the last :meth:`synchronize` left preconditioned averages in ``param.grad``
        (``freeze_adam_variance`` after the warm-up)."""
        return self._preconditioned

    # ------------------------------------------------------------------ changes between steps
    def switch_method(self, method: MethodSpec | str, **method_options: Any) -> None:
        """Synchronize with ``method`` (a spec, or a name built with ``method_options``) from the next
        step on.

        Each bucket's residual under the old method is flushed: added to that bucket's next gradient
        before the new method (or the dense warm-up) averages it, so the sum of what every rank
        contributes is conserved across the switch (Shi et al., section 5.6: MSTopK-SGD first, then
        dense all-reduce).

        Raises:
            ValueError / TypeError: unknown method or option, or a method that momentum correction
                cannot use; the synchronizer is then unchanged.
        """
        spec = MethodSpec.of(method, method_options)
        if self.corrections is not None and not spec.cls.tracks_sent:
            raise ValueError(f"momentum_correction needs a method that reports the indices it sent "
                             f"(last_sent); cannot switch to {spec.name!r}")
        spec.build(self.comm)  # probe: checks the values of the options
        self.engine.switch_method(spec)
        self.target_density = spec.density

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

    # ------------------------------------------------------------------ one step
    def synchronize(self) -> Stats:
        """Replace every ``param.grad`` by the average over ranks; returns the step's stats
        (elements, output non-zeros, density, bytes, rounds, seconds per phase)."""
        if self.clip_norm is not None:
            dgc.clip_local_gradients(self.params, self.clip_norm, self.comm.size)
        engine = self.engine
        warmup = engine.in_warmup
        if not warmup and self.density_warmup is not None and self.target_density is not None:
            density = dgc.density_schedule(self.epoch, self.target_density, self.density_warmup)
            if density != engine.spec.density:
                engine.set_density(density)
        adam = None if warmup else self.adam
        self._preconditioned = adam is not None
        if adam is not None and not adam.frozen:
            adam.freeze()
        for group in engine.groups:
            params = [self.params[pid] for pid in group.ids]
            correction = None if warmup or group.dense or self.corrections is None or engine.overflowed \
                else self.corrections[group.index]  # (after an overflow the bucket makes no call)
            if correction is not None:
                if adam is not None:  # the velocity of the preconditioned gradient (Adam's first moment)
                    adam.precondition_((pid, param.grad) for pid, param in zip(group.ids, params, strict=True)
                                       if param.grad is not None)
                # u = m u + g straight from the .grad tensors (the output tensor only gives the size, so
                # no input buffer is made); u itself goes to the method, which only reads it
                pieces = [(start, numel, param.grad)
                          for param, start, numel in zip(params, group.offsets, group.numels, strict=True)]
                flat = correction.velocity_of_pieces(group.outbuf(), pieces)
            else:
                flat = self._gather(group, params)
                if adam is not None:
                    spans = zip(group.ids, group.offsets, group.numels, strict=True)
                    adam.precondition_((pid, flat[start:start + numel]) for pid, start, numel in spans)
            averaged = engine.reduce(group, flat, warmup=warmup, **({"dense_calls": 1} if warmup else {}))
            if correction is not None:
                if engine.overflowed:  # the step is dropped: the velocity as before it, never NaN/Inf
                    correction.undo_()
                elif group.method.last_sent is not None:
                    correction.mask_(group.method.last_sent)
            # param.grad becomes a view of the group's output tensor (as DDP's gradient_as_bucket_view):
            # no copy of the result; the next backward writes new gradients there or, after
            # zero_grad(set_to_none=True), into new tensors, which the next step gathers alike
            shared = averaged is group.outbuf()
            for param, start, numel in zip(params, group.offsets, group.numels, strict=True):
                piece = averaged[start:start + numel].view_as(param)
                if shared:
                    if param.grad is None or param.grad.data_ptr() != piece.data_ptr() \
                            or param.grad.shape != piece.shape:
                        param.grad = piece
                elif param.grad is None:
                    param.grad = piece.clone()
                else:
                    param.grad.copy_(piece)
        engine.iter += 1
        self.last_stats = engine.end_step(keep=False)  # each step's totals are reported in last_stats
        return self.last_stats

    @staticmethod
    def _gather(group: Group, params: list[nn.Parameter]) -> torch.Tensor:
        """The group's gradient, gathered into its reused input tensor (zeros for a missing grad)."""
        flat = group.inbuf()
        for param, start, numel in zip(params, group.offsets, group.numels, strict=True):
            if param.grad is None:
                flat[start:start + numel].zero_()
            else:
                flat[start:start + numel].copy_(param.grad.reshape(-1))
        return flat

    def step(self, closure=None):
        """:meth:`synchronize`, then ``optimizer.step(closure)`` (with ``freeze_adam_variance``, after the
        warm-up: AdamW's step with the frozen second moment, :meth:`optimizer_step`)."""
        if self.optimizer is None:
            raise RuntimeError("SparseSynchronizer.step needs the optimizer; pass it at construction "
                               "or call synchronize()")
        self.synchronize()
        return self.optimizer_step(closure)

    def optimizer_step(self, closure=None):
        """The optimizer's step on the synchronized gradients: ``optimizer.step(closure)``, or, after the
        warm-up with ``freeze_adam_variance``, AdamW's step with the frozen second moment (the
        gradients then hold preconditioned averages; a closure is not supported there)."""
        if self._preconditioned:
            if closure is not None:
                raise ValueError("freeze_adam_variance makes the optimizer's step itself: it takes no closure")
            self.adam.step()
            return None
        return self.optimizer.step(closure)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The state of this rank, recording its world: step counter, method and options, the world it
        was saved in (world size and this rank), the buckets (parameter layout, method states,
        per-parameter residuals: the engine's) and the momentum corrections; the optimizer's state is
        saved by the optimizer. Save one per rank (each rank's residuals are its own)."""
        state = self.engine.state_dict(live_world(self.process_group))
        state["momentum_correction"] = None if self.corrections is None else \
            [c.state_dict() for c in self.corrections]
        if self.adam is not None:
            state["adam"] = self.adam.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`: this rank's own state, or every rank's of the job that saved them
        (a list, in any order), which a job of another size needs.

        Collective (call it on every rank): each rank checks method and options, the world (its own
        rank's state; another rank's is an error naming both), the parameter layout and bucketing,
        and every residual's and momentum buffer's shape, dtype and finiteness; then every rank
        raises the same :class:`~sparsecomm.integration.world.StateLoadError` if any rank found a
        problem. From a job of another size this rank takes the residuals and momentum buffers of the
        old ranks ``q`` with ``q % P == rank`` (their sums over ranks are conserved); the methods'
        adaptive state starts afresh (a warning says so)."""
        world = live_world(self.process_group)
        ignore = ("density",) if self.density_warmup is not None else ()  # the warm-up sets it every step
        loaded, problem = self.engine.prepare_load(state, "synchronizer", world, ignore_options=ignore)
        corrections: list[dict[str, Any]] | None = None
        if loaded is not None:
            corrections, problem = self._corrections_of(loaded.sources, world, loaded.resized)
        agree_on_load(problem, self.process_group, "synchronizer")
        assert loaded is not None
        self.engine.load(loaded, "synchronizer", world)
        if self.corrections is not None and corrections is not None:
            for correction, saved in zip(self.corrections, corrections, strict=True):
                correction.load_state_dict(saved)
        if self.adam is not None:  # after the optimizer's own state: the frozen moment is read from it
            self.adam.load_state_dict(loaded.state.get("adam") or {})

    def _corrections_of(self, sources: list[Mapping[str, Any]], world: Any,
                        resized: bool) -> tuple[list[dict[str, Any]] | None, str | None]:
        """This rank's momentum corrections from the saved states (its own, or its share of every old
        rank's), or the problem."""
        if "momentum_correction" not in sources[0]:
            return None, "not a synchronizer state_dict of this sparsecomm (missing 'momentum_correction')"
        saved = [s["momentum_correction"] for s in sources]
        if (saved[0] is None) != (self.corrections is None):
            return None, (f"it was saved {'without' if saved[0] is None else 'with'} momentum_correction, this "
                          f"synchronizer runs {'without' if self.corrections is None else 'with'} it")
        if self.corrections is None:
            return None, None
        for rank, buckets in enumerate(saved):
            if len(buckets) != len(self.corrections):
                return None, (f"the state holds {len(buckets)} momentum corrections, this synchronizer "
                              f"{len(self.corrections)} buckets; use the same bucket_elements")
            for bucket, correction in enumerate(buckets):
                for key in ("velocity", "accumulation"):
                    if correction[key] is not None:
                        whose = f"rank {rank}'s saved " if len(saved) > 1 else "the saved "
                        problem = tensor_problem(correction[key], None, None,
                                                 f"{whose}momentum {key} of bucket {bucket}")
                        if problem is not None:
                            return None, problem
        if len(saved) == 1:
            return saved[0], None
        if not resized:
            return saved[world.rank], None
        folded = []
        for bucket in range(len(self.corrections)):
            mine = dict(saved[0][bucket])
            for key in ("velocity", "accumulation"):
                mine[key] = fold([s[bucket][key] for s in saved], world.rank, world.size)
            folded.append(mine)
        return folded, None

    def __repr__(self) -> str:
        return (f"SparseSynchronizer(method={self.method_name!r}, options={self.method_options}, "
                f"buckets={len(self.engine.groups)}, iter={self.iter})")
