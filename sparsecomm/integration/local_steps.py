"""Local steps: H inner optimizer steps per synchronization, the pseudo-gradient averaged by any
sparsecomm method with error feedback, then an outer optimizer step (DiLoCo, SparseLoCo, local SGD).

::

    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    local = sparsecomm.LocalSteps(model, inner, method="topka", density=0.01, local_steps=16)
    for x, y in loader:
        inner.zero_grad()
        loss_fn(model(x), y).backward()
        local.step()            # inner.step(); every 16th call also synchronizes

Each rank trains its own replica for ``local_steps`` = H inner steps without communicating, then
every rank synchronizes once (:meth:`LocalSteps.synchronize`): DiLoCo's Algorithm 1 ([DiLoCo],
Douillard et al. 2023) with the pseudo-gradient compressed and error-fed as in SparseLoCo ([SparseLoCo],
Sarfi et al. 2025)::

    delta_r  = theta_global - theta_r                  pseudo-gradient of rank r (H inner steps)
    acc_r    = error_decay * e_r + delta_r             error feedback (the method's residual e_r)
    avg      = method(acc_r)                           the average over ranks of what the method sends;
    e_r      = acc_r - (what rank r sent)              the rest stays in rank r's residual
    theta_global = OuterSGD(theta_global, avg)         outer step (lr, momentum, Nesterov)
    theta_r  = theta_global                            every replica restarts from the global parameters

``theta_global`` is kept on every rank (identical bit for bit: the same average and the same outer
step everywhere), so no rank is a server. The outer optimizer is torch's SGD update on the
pseudo-gradient (``torch.optim.SGD`` with dampening 0: ``b = mu b + avg``, Nesterov ``d = avg +
mu b``, ``theta -= lr d``), with three named settings (``outer=``):

* ``"nesterov"`` (default): SGD with Nesterov momentum, ``outer_lr=0.7``, ``outer_momentum=0.9``:
  DiLoCo's outer optimizer. With ``method="dense"`` this is DiLoCo.
* ``"sparseloco"``: no outer momentum, ``outer_lr=1``, ``error_decay=0.95``: the decayed error-feedback
  accumulator replaces the outer momentum (SparseLoCo). SparseLoCo's top-k within fixed-size chunks
  of each tensor and its 2-bit quantization of the values are not methods of this library: here the
  method selects over each group (e.g. ``topka``'s top-k over the whole group) and sends
  full-precision values.
* ``"sgd"``: plain SGD (heavy-ball ``outer_momentum``, default 0), ``outer_lr=1``: with ``method="dense"``
  the replicas are averaged every H steps, local SGD ([LocalSGD], Lin et al. 2020; torch's
  ``PostLocalSGDOptimizer`` after its warm-up).

With plain SGD inside (constant lr, no momentum), ``local_steps=1``, ``outer="sgd"`` and ``outer_lr=1``
the pseudo-gradient is ``lr * g`` and the trajectory is that of :class:`~.synchronizer.SparseSynchronizer`
with the same method averaging ``g`` (error feedback is linear in its input and a top-k selection
does not change under scaling), to float rounding.

The inner optimizer's state (AdamW's moments) stays local, as in DiLoCo. The model is not wrapped in
``DistributedDataParallel`` (its gradients stay local). Its buffers (e.g. BatchNorm statistics) are
broadcast from rank 0 at construction and then stay local, as under torch's ``PostLocalSGDOptimizer``.
docs/local-steps.md says when to use local steps rather than per-step synchronization.

Communication per synchronization: the method's own cost on n elements (``sparsecomm.cost(method,
P, n, k)``) once per H inner steps, plus one agreement header exchange (ceil(log2 P) messages of a
few int64, booked as header bytes) that makes every rank raise the same error before anything is
sent when a rank's pseudo-gradient holds NaN/Inf or the ranks are at different points of training.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.buffers import long_lived_empty
from ..core.validate import check_choice, check_int, check_number, is_number
from ..methods import Method, MethodSpec, Stats
from ..methods.checks import NonFiniteGradientError, count_nonfinite
from ..transport.agreement import AgreementError, agree
from ..transport.comm import Communicator
from ..transport.deadline import explain_timeout, is_peer_failure
from .residuals import Group, goes_dense

__all__ = ["LocalSteps", "OUTER_SETTINGS"]

log = logging.getLogger(__name__)

#: Each named outer optimizer's defaults: (outer_lr, outer_momentum, error_decay).
OUTER_SETTINGS: dict[str, tuple[float, float, float]] = {
    "nesterov": (0.7, 0.9, 1.0),
    "sgd": (1.0, 0.0, 1.0),
    "sparseloco": (1.0, 0.0, 0.95),
}

_DENSE = MethodSpec("dense")


class LocalSteps:
    """Train with ``local_steps`` inner optimizer steps per synchronization of the pseudo-gradient.

    Args:
        model: the local replica (parameters and buffers are broadcast from rank 0 at construction).
        optimizer: the inner optimizer (e.g. AdamW over ``model.parameters()``), stepped by :meth:`step`.
        method: a :class:`~sparsecomm.methods.MethodSpec`, or a name from
            :func:`sparsecomm.available_methods` with ``method_options`` (e.g. ``density=0.01``);
            ``"dense"`` sends the whole pseudo-gradient.
        local_steps: H, the inner steps between two synchronizations (1: every step).
        outer: ``"nesterov"`` (DiLoCo), ``"sparseloco"`` or ``"sgd"``: the outer optimizer and its
            defaults (see the module docstring).
        outer_lr: the outer learning rate (default: the setting's, 0.7 for ``"nesterov"``, else 1).
        outer_momentum: the outer momentum (default: the setting's; ``"nesterov"`` needs one in (0, 1),
            ``"sparseloco"`` takes none: its error feedback replaces it).
        error_decay: beta in ``acc = beta * residual + delta``, in (0, 1] (default: 0.95 for
            ``"sparseloco"``, else 1, plain error feedback). Needs a method that keeps a residual when
            below 1.
        process_group: ``None`` for the default group.
        bucket_elements: split the parameters into groups of at most this many elements (parameter
            boundaries kept), one method call each; ``None``: one group (per dtype and device).
        dense_below: parameters with fewer elements, or whose sparse message would not be smaller than
            the dense one, are averaged densely in one more group; 0 (default): none.
        broadcast_parameters: broadcast the parameters and buffers from rank 0 at construction (the
            replicas must start identical).
        **method_options: for :func:`sparsecomm.make_method`; ``nonfinite`` may only be ``"error"``.

    Raises:
        ValueError / TypeError at construction for a bad option, before anything is communicated.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, method: MethodSpec | str = "topka", *,
                 local_steps: int, outer: str = "nesterov", outer_lr: float | None = None,
                 outer_momentum: float | None = None, error_decay: float | None = None, process_group=None,
                 bucket_elements: int | None = None, dense_below: int = 0, broadcast_parameters: bool = True,
                 **method_options: Any) -> None:
        spec = MethodSpec.of(method, method_options)
        if spec.options.get("nonfinite", "error") != "error":
            raise ValueError(f"nonfinite={spec.options['nonfinite']!r}: LocalSteps raises on every rank when a "
                             "pseudo-gradient holds NaN/Inf (nonfinite='error'); a skipped synchronization "
                             "would leave the replicas apart")
        check_int("local_steps", local_steps, minimum=1)
        check_choice("outer", outer, OUTER_SETTINGS)
        default_lr, default_momentum, default_decay = OUTER_SETTINGS[outer]
        if outer == "sparseloco" and outer_momentum:
            raise ValueError(f"outer_momentum={outer_momentum!r}: outer='sparseloco' has no outer momentum (its "
                             "error-feedback accumulator replaces it); use outer='sgd' with outer_momentum and "
                             "error_decay for a mix of the two")
        self.outer = outer
        self.outer_lr = float(check_number("outer_lr", default_lr if outer_lr is None else outer_lr, 0.0,
                                           strict=True))
        momentum = default_momentum if outer_momentum is None else outer_momentum
        if not is_number(momentum) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer_momentum={momentum!r} must be a number in [0, 1)")
        if outer == "nesterov" and momentum == 0.0:
            raise ValueError("outer='nesterov' needs outer_momentum in (0, 1) (got 0); use outer='sgd' for none")
        self.outer_momentum = float(momentum)
        decay = default_decay if error_decay is None else error_decay
        if not is_number(decay) or not 0.0 < decay <= 1.0:
            raise ValueError(f"error_decay={decay!r} must be a number in (0, 1]")
        if decay != 1.0 and not spec.cls.has_residual:
            raise ValueError(f"error_decay={decay!r} decays the error-feedback residual, and method "
                             f"{spec.name!r} keeps none; use a sparse method with error feedback (e.g. 'topka')")
        self.error_decay = float(decay)
        if bucket_elements is not None:
            check_int("bucket_elements", bucket_elements, minimum=1)
        check_int("dense_below", dense_below, minimum=0)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (the inner optimizer), "
                            f"got {type(optimizer).__name__}")
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameter that requires grad: nothing to synchronize")
        self.model = model
        self.optimizer = optimizer
        self.spec = spec
        self.local_steps = local_steps
        self.process_group = process_group
        self.comm = Communicator(process_group)
        #: inner steps taken since the last synchronization
        self.inner_step = 0
        #: synchronizations made so far
        self.outer_steps = 0
        #: the figures of the last :meth:`step` (``calls=0`` when it only stepped locally)
        self.last_stats = Stats(calls=0)
        self.groups: list[Group] = self._make_groups(bucket_elements, dense_below)
        if broadcast_parameters:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(tensor, src=src, group=process_group)
        #: the global parameters (those of the last synchronization), one flat tensor per group
        self.anchors: list[torch.Tensor] = []
        for group in self.groups:
            anchor = long_lived_empty(group.n, dtype=group.dtype, device=group.device)
            self._gather(group, anchor)
            self.anchors.append(anchor)
        #: the outer momentum buffer of each group (``None`` before the first outer step)
        self.momenta: list[torch.Tensor | None] = [None] * len(self.groups)
        log.info("%r: %d parameters, %d elements", self, len(self.params), sum(g.n for g in self.groups))

    # ------------------------------------------------------------------ groups
    def _make_groups(self, limit: int | None, dense_below: int) -> list[Group]:
        """Consecutive parameters of one dtype and device, at most ``limit`` elements per group, then
        one dense group per dtype and device for the small parameters (``dense_below``)."""
        buckets: list[list[int]] = []
        dense: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        size, kind = 0, None
        for pid, param in enumerate(self.params):
            here = (param.dtype, param.device)
            if self.spec.sparse and goes_dense(param.numel(), param.element_size(), self.spec.density, dense_below):
                dense.setdefault(here, []).append(pid)
                continue
            if not buckets or here != kind or (limit is not None and size + param.numel() > limit and buckets[-1]):
                buckets.append([])
                size, kind = 0, here
            buckets[-1].append(pid)
            size += param.numel()
        members = [(ids, False) for ids in buckets] + [(ids, True) for ids in dense.values()]
        groups = []
        for index, (ids, is_dense) in enumerate(members):
            method = (_DENSE if is_dense else self.spec).build(self.comm)
            first = self.params[ids[0]]
            groups.append(Group(index, tuple(ids), tuple(self.params[pid].numel() for pid in ids), is_dense,
                                method, first.dtype, first.device))
        return groups

    def _group_params(self, group: Group) -> list[nn.Parameter]:
        return [self.params[pid] for pid in group.ids]

    def _gather(self, group: Group, flat: torch.Tensor) -> None:
        """The group's current local parameters, copied into ``flat``."""
        with torch.no_grad():
            for param, offset, numel in zip(self._group_params(group), group.offsets, group.numels, strict=True):
                flat[offset:offset + numel].copy_(param.reshape(-1))

    @property
    def methods(self) -> list[Method]:
        """Each group's method instance (its ``residual`` is the pseudo-gradient's error feedback)."""
        return [group.method for group in self.groups]

    def global_parameters(self) -> list[torch.Tensor]:
        """The global parameters (of the last synchronization), shaped like the model's trainable
        parameters and in their order: views, valid until the next synchronization (clone to keep)."""
        found: dict[int, torch.Tensor] = {}
        for group, anchor in zip(self.groups, self.anchors, strict=True):
            for pid, offset, numel in zip(group.ids, group.offsets, group.numels, strict=True):
                found[pid] = anchor[offset:offset + numel].view_as(self.params[pid])
        return [found[pid] for pid in range(len(self.params))]

    @contextlib.contextmanager
    def global_model(self) -> Iterator[nn.Module]:
        """``with local.global_model() as model:`` the model with the global parameters (those of the
        last synchronization) in place of this replica's, e.g. to evaluate what the ranks agree on in
        the middle of a period; the replica's own parameters are back on exit. Local: no communication."""
        replica = [param.detach().clone() for param in self.params]
        try:
            with torch.no_grad():
                for param, value in zip(self.params, self.global_parameters(), strict=True):
                    param.copy_(value)
            yield self.model
        finally:
            with torch.no_grad():
                for param, value in zip(self.params, replica, strict=True):
                    param.copy_(value)

    # ------------------------------------------------------------------ training
    def step(self, closure=None):
        """One inner step (``optimizer.step(closure)``); after every ``local_steps``-th, a
        synchronization (:meth:`synchronize`). Returns what ``optimizer.step`` returns; the step's
        figures are in :attr:`last_stats`."""
        loss = self.optimizer.step(closure)
        self.inner_step += 1
        if self.inner_step >= self.local_steps:
            self.synchronize()
        else:
            self.last_stats = Stats(calls=0)
        return loss

    def synchronize(self) -> Stats:
        """End the period now: average the pseudo-gradients with the method, take the outer step and
        set every replica's parameters to the new global parameters (identical on every rank).
        Collective: every rank calls it after the same number of inner steps. Returns the figures of
        the method calls (also in :attr:`last_stats`).

        Raises (on every rank, before anything is sent, with parameters, residuals and outer state
        unchanged): :class:`~sparsecomm.methods.NonFiniteGradientError` when a rank's pseudo-gradient
        holds NaN/Inf; :class:`~sparsecomm.transport.agreement.AgreementError` when the ranks are at
        different inner or outer steps. A rank that does not take part is named after the process
        group's timeout (:class:`~sparsecomm.transport.deadline.RankStalledError`)."""
        nonfinite = 0
        with torch.no_grad():
            for group, anchor in zip(self.groups, self.anchors, strict=True):
                delta = group.inbuf()
                for param, offset, numel in zip(self._group_params(group), group.offsets, group.numels,
                                                strict=True):
                    torch.sub(anchor[offset:offset + numel], param.reshape(-1), out=delta[offset:offset + numel])
                nonfinite += count_nonfinite(delta)
                if self.error_decay != 1.0 and group.residual is not None:
                    # the method adds its residual e: e + (delta + (beta - 1) e) = beta e + delta, and the
                    # residual itself stays untouched until the call has agreed
                    delta.add_(group.residual, alpha=self.error_decay - 1.0)
        self._agree(nonfinite)
        calls = []
        for group in self.groups:
            group.call(group.inbuf(), use_layout=True)
            calls.append(group.method.stats)
        with torch.no_grad():
            for group, anchor in zip(self.groups, self.anchors, strict=True):
                self._outer_step(group, anchor)
                for param, offset, numel in zip(self._group_params(group), group.offsets, group.numels,
                                                strict=True):
                    param.copy_(anchor[offset:offset + numel].view_as(param))
        self.inner_step = 0
        self.outer_steps += 1
        self.last_stats = Stats.total(calls)
        return self.last_stats

    def _outer_step(self, group: Group, anchor: torch.Tensor) -> None:
        """``torch.optim.SGD``'s update (dampening 0) of the global parameters with the averaged
        pseudo-gradient (the group's output tensor, left as it is; the Nesterov direction is formed
        in the group's input tensor, whose pseudo-gradient the method has consumed)."""
        averaged = group.outbuf()
        direction = averaged
        momentum = self.outer_momentum
        if momentum:
            buffer = self.momenta[group.index]
            if buffer is None:
                buffer = self.momenta[group.index] = averaged.detach().clone()
            else:
                buffer.mul_(momentum).add_(averaged)
            if self.outer == "nesterov":
                direction = torch.add(averaged, buffer, alpha=momentum, out=group.inbuf())
            else:
                direction = buffer
        anchor.add_(direction, alpha=-self.outer_lr)

    def _agree(self, nonfinite: int) -> None:
        """One header exchange before any method call: the same inner and outer step on every rank
        and no NaN/Inf anywhere, or the same error on every rank."""
        header = {"outer_step": self.outer_steps, "inner_steps": self.inner_step, "groups": len(self.groups),
                  "nonfinite": nonfinite}
        try:
            with self.comm.meter.phase("agreement"):
                # on the parameters' device: NCCL sends only CUDA tensors
                verdict = agree(self.comm, header, zero=("nonfinite",), device=self.groups[0].device)
        except Exception as exc:
            if is_peer_failure(exc):
                raise explain_timeout(exc, self.comm.ranks) from exc
            raise
        if verdict is None:
            return
        mismatched = [name for name in verdict.mismatched() if name != "nonfinite"]
        if mismatched:
            odd = sorted({rank for name in mismatched for rank in verdict.outliers(name)[1]})
            raise AgreementError(f"LocalSteps: the ranks are not at the same point of training "
                                 f"({'; '.join(verdict.describe(name) for name in mismatched)}); every rank must "
                                 f"take the same number of inner steps between synchronizations. Nothing was "
                                 f"sent; parameters, residuals and outer state are unchanged", odd, mismatched[0])
        bad = verdict.nonzero_ranks("nonfinite")
        counts = ", ".join(f"rank {rank}: {verdict.column('nonfinite')[rank]}" for rank in bad)
        raise NonFiniteGradientError(f"LocalSteps: NaN/Inf in the pseudo-gradient (the parameters) of "
                                     f"{'rank' if len(bad) == 1 else 'ranks'} {', '.join(map(str, bad))} ({counts} "
                                     f"non-finite elements); raised on every rank before anything was sent, "
                                     f"parameters, residuals and outer state unchanged", bad, "nonfinite")

    # ------------------------------------------------------------------ checkpoints
    def _layout(self) -> list[dict[str, Any]]:
        return [{"params": list(group.ids), "numels": list(group.numels), "dense": group.dense}
                for group in self.groups]

    def state_dict(self) -> dict[str, Any]:
        """The world it was saved in (world size, rank, method, groups), the period's position, the
        global parameters, the outer momentum and each group's method state (its residual included).
        The model's local parameters and the inner optimizer's state are saved by their owners."""
        return {"world_size": self.comm.size, "rank": self.comm.rank, "method": self.spec.to_dict(),
                "groups": self._layout(), "local_steps": self.local_steps, "inner_step": self.inner_step,
                "outer_steps": self.outer_steps,
                "outer": {"name": self.outer, "lr": self.outer_lr, "momentum": self.outer_momentum,
                          "error_decay": self.error_decay},
                "anchors": [anchor.clone() for anchor in self.anchors],
                "momenta": [None if buffer is None else buffer.clone() for buffer in self.momenta],
                "methods": [group.method.state_dict() for group in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by this rank in the same world (load the model's and the
        inner optimizer's state as well). Refuses, naming the difference, a state of another world
        size, rank, method or grouping, or one saved later in its period than ``local_steps`` allows."""
        if state.get("world_size") != self.comm.size or state.get("rank") != self.comm.rank:
            raise ValueError(f"this LocalSteps state was saved by rank {state.get('rank')} of "
                             f"{state.get('world_size')}; this is rank {self.comm.rank} of {self.comm.size}: each "
                             f"rank loads its own state, in a world of the same size")
        saved = MethodSpec.from_dict(state["method"])
        if saved != self.spec:
            raise ValueError(f"this LocalSteps state was saved with method {saved!r}, this one synchronizes with "
                             f"{self.spec!r}: the residuals belong to that method")
        if state["groups"] != self._layout():
            raise ValueError("this LocalSteps state was saved with other groups (another model, or other "
                             "bucket_elements or dense_below)")
        if state["inner_step"] >= self.local_steps:
            raise ValueError(f"this LocalSteps state was saved after {state['inner_step']} inner steps of its "
                             f"period, this one synchronizes every local_steps={self.local_steps}")
        for anchor, saved_anchor in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved_anchor)
        self.momenta = [None if buffer is None else buffer.clone() for buffer in state["momenta"]]
        for group, method_state in zip(self.groups, state["methods"], strict=True):
            group.method.load_state_dict(method_state)
            group.residual = group.method.residual
        self.inner_step = int(state["inner_step"])
        self.outer_steps = int(state["outer_steps"])

    def __repr__(self) -> str:
        return (f"LocalSteps(method={self.spec.label()!r}, local_steps={self.local_steps}, outer={self.outer!r}, "
                f"outer_lr={self.outer_lr:g}, outer_momentum={self.outer_momentum:g}, "
                f"error_decay={self.error_decay:g}, groups={len(self.groups)})")
