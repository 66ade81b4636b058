"""Residuals that belong to parameters: the groups of the grouping engine (:mod:`.engine`, behind the
DDP hook and the synchronizer), laid out in canonical parameter order.

GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine Learning",
ICDCS 2021) keeps its error-feedback ``Memory`` keyed by tensor name, not by communication bucket.
This module does the same for the DDP hook, so that a DDP bucket rebuild and a checkpoint reload are
lookups instead of re-homing:

* Every parameter gets a *canonical id*: the order in which the hook first sees it, i.e. DDP's
  first-iteration bucketing (bucket 0's parameters in bucket order, then bucket 1's, ...). A fresh
  DDP over the same model starts with the same bucketing, so the run that saves a checkpoint and the
  run that loads it number the parameters alike.
* Parameters are synchronized in *groups*, one method call per group and step:
  ``granularity="bucket"``: one group per DDP bucket; ``granularity="model"``: one group holding
  every parameter. Parameters too small to be worth sparsifying form one more, dense group (see
  :func:`goes_dense`). Bucket groups follow DDP's buckets only when DDP rebuilds them (once, after
  its first iteration: :meth:`ParamPlan.set_groups`, a group with the same parameters keeps its
  method and residual); a checkpoint carries its groups, and a resumed run uses them from its first
  step although DDP starts again from its initial bucketing, so a method always selects over the
  same elements as in the uninterrupted run (the condition for an exact resume).
* A group's residual is one flat tensor; each parameter's residual is a view into it
  (:meth:`ParamPlan.residual_of`). The method is handed that tensor as its ``residual`` and updates
  it in place: no copy per step. Checkpoints store one residual per parameter id.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.buffers import long_lived_empty, long_lived_zeros
from ..methods import Method

__all__ = ["Group", "ParamPlan", "Route", "goes_dense", "INDEX_BYTES"]

log = logging.getLogger(__name__)

#: Bytes of one transmitted index (int32 while n < 2**31), for the small-tensor rule.
INDEX_BYTES = 4


def goes_dense(numel: int, itemsize: int, density: float | None, dense_below: int) -> bool:
    """Whether a parameter of ``numel`` elements is all-reduced densely instead of sparsely.

    The analogue of PowerSGD's ``min_compression_rate`` (Vogels et al. 2019; torch's
    ``powerSGD_hook``): dense when ``numel < dense_below``, or when its sparse message,
    ``ceil(density * numel)`` (value, int32 index) pairs, would not be smaller than the dense one,
    ``numel`` values. ``dense_below=0`` turns the rule off (every parameter goes to the method).
    """
    if dense_below <= 0 or density is None:
        return False
    sparse_bytes = math.ceil(density * numel) * (itemsize + INDEX_BYTES)
    return numel < dense_below or sparse_bytes >= numel * itemsize


@dataclass
class Group:
    """Parameters synchronized by one method call, contiguous in the group's flat buffers.

    Attributes:
        index: position in :attr:`ParamPlan.groups` (groups run in this order when several complete
            at once).
        ids: canonical parameter ids, in group order; ``offsets``/``numels`` locate each one.
        dense: the small-tensor group (all-reduced densely in one fused call).
        method: the method instance of this group.
        residual: the group's error-feedback residual (``None`` when the method keeps none); the
            method's ``residual`` attribute is this very tensor (after every call, :meth:`call`).
    """

    index: int
    ids: tuple[int, ...]
    numels: tuple[int, ...]
    dense: bool
    method: Method
    dtype: torch.dtype
    device: torch.device
    residual: torch.Tensor | None = None
    offsets: tuple[int, ...] = ()
    _inbuf: torch.Tensor | None = None
    _outbuf: torch.Tensor | None = None
    arrived: int = 0

    def __post_init__(self) -> None:
        offsets, offset = [], 0
        for numel in self.numels:
            offsets.append(offset)
            offset += numel
        self.offsets = tuple(offsets)
        if self.method.has_residual:
            self.residual = long_lived_zeros(self.n, dtype=self.dtype, device=self.device)
            self.method.residual = self.residual

    @property
    def n(self) -> int:
        return sum(self.numels)

    @property
    def layout(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets, self.numels, strict=True))

    def inbuf(self) -> torch.Tensor:
        """The group's reused input buffer, where gradients are gathered when no bucket holds the
        group's parameters contiguously in group order."""
        if self._inbuf is None:
            self._inbuf = long_lived_empty(self.n, dtype=self.dtype, device=self.device)
        return self._inbuf

    def outbuf(self) -> torch.Tensor:
        """The group's reused output tensor: every call writes its result there (``out=``), so a
        step allocates no length-n tensor. Valid until the group's next call."""
        if self._outbuf is None:
            self._outbuf = long_lived_empty(self.n, dtype=self.dtype, device=self.device)
        return self._outbuf

    def call(self, grad: torch.Tensor, use_layout: bool) -> torch.Tensor:
        """Run the method on the group's gradient into :meth:`outbuf`; its residual stays the group's
        tensor."""
        out = self.method(grad, self.layout if use_layout else None, out=self.outbuf())
        if self.residual is not None:
            # a method that accumulates before its call's checks keeps two residual buffers and
            # alternates them (methods.residual.ResidualStore): the group's residual is the method's current one
            assert self.method.residual is not None
            self.residual = self.method.residual
        return out


@dataclass
class Route:
    """Where one DDP bucket's parameters live in the groups.

    ``direct`` is set when the bucket's buffer *is* one group's gradient (same parameters, same
    order): the method then reads the buffer itself and its output is the bucket's result.
    Otherwise ``pieces`` lists ``(buffer offset, group, group offset, numel)`` to copy in and out.
    """

    groups: tuple[int, ...]
    direct: int | None
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)


class ParamPlan:
    """Canonical parameter ids, the fixed groups and each bucket's route into them.

    Args:
        granularity: ``"bucket"`` (one group per first-iteration bucket) or ``"model"`` (one group).
        is_dense: ``is_dense(numel, itemsize)``: the small-tensor rule (:func:`goes_dense`).
        make_method: ``make_method(dense)``: a new method instance for a group.
    """

    def __init__(self, granularity: str, is_dense: Callable[[int, int], bool],
                 make_method: Callable[[bool], Method]) -> None:
        self.granularity = granularity
        self._is_dense = is_dense
        self._make_method = make_method
        self.ids: dict[int, int] = {}            # data_ptr -> canonical id
        self.numels: list[int] = []              # canonical id -> numel
        self.where: list[tuple[int, int]] = []   # canonical id -> (group index, offset)
        self._kinds: list[tuple[torch.dtype, torch.device, int]] = []  # canonical id -> dtype, device, itemsize
        self.groups: list[Group] = []
        self._routes: dict[tuple[int, tuple[int, ...]], Route] = {}

    # ------------------------------------------------------------------ numbering and groups
    def number(self, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
        """Number the parameters from the first iteration's buckets (each a list of parameters in
        bucket order, buckets in index order)."""
        if self.numels:
            raise RuntimeError("ParamPlan.number: the parameters are numbered once, on the first iteration")
        for params in buckets:
            for param in params:
                self.ids[param.data_ptr()] = len(self.numels)
                self.numels.append(param.numel())
                self._kinds.append((param.dtype, param.device, param.element_size()))

    def members_of(self, buckets: Sequence[Sequence[torch.Tensor]]) -> list[tuple[tuple[int, ...], bool]]:
        """The groups (parameter ids, dense?) for DDP buckets holding ``buckets``' parameters: one per
        bucket (its parameters that are not dense) or one for the model, then the dense group."""
        members: list[tuple[tuple[int, ...], bool]] = []
        model: list[int] = []
        dense: list[int] = []
        for params in buckets:
            sparse_here = []
            for param in params:
                pid = self.ids[param.data_ptr()]
                if self._is_dense(self.numels[pid], self._kinds[pid][2]):
                    dense.append(pid)
                elif self.granularity == "model":
                    model.append(pid)
                else:
                    sparse_here.append(pid)
            if sparse_here:
                members.append((tuple(sparse_here), False))
        if model:
            members.append((tuple(sorted(model)), False))
        if dense:
            members.append((tuple(sorted(dense)), True))
        return members

    def replace_method(self, group: Group, method: Method) -> None:
        """Give ``group`` a new method instance (a switch of methods), with a zero residual of its own
        when the method keeps one."""
        group.method = method
        group.residual = None
        if method.has_residual:
            group.residual = long_lived_zeros(group.n, dtype=group.dtype, device=group.device)
            method.residual = group.residual

    def set_groups(self, members: Sequence[tuple[tuple[int, ...], bool]]) -> None:
        """Use these groups from now on. A group with the same parameters as a current one is that
        group (method state, residual); a new group gets its parameters' residuals by lookup (a copy,
        once) and a new method instance at the current groups' step."""
        old = {(g.ids, g.dense): g for g in self.groups}
        step = max((g.method.step for g in self.groups), default=0)
        old_views = {pid: self.residual_of(pid) for pid in range(len(self.where))}
        groups: list[Group] = []
        for ids, dense in members:
            group = old.pop((ids, dense), None)
            if group is None:
                group = self._new_group(len(groups), ids, dense)
                group.method.step = step
                if group.residual is not None:
                    for pid, offset in zip(group.ids, group.offsets, strict=True):
                        view = old_views.get(pid)
                        if view is not None:
                            group.residual[offset:offset + self.numels[pid]].copy_(view)
            group.index = len(groups)
            groups.append(group)
        if self.groups:
            log.info("hook groups re-formed on DDP's new buckets: %d kept, %d new",
                     len(self.groups) - len(old), len(groups) - len(self.groups) + len(old))
        self.groups = groups
        self.where = [(-1, 0)] * len(self.numels)
        for group in groups:
            for pid, offset in zip(group.ids, group.offsets, strict=True):
                self.where[pid] = (group.index, offset)
        if any(gi < 0 for gi, _ in self.where):
            raise ValueError("hook groups must hold every parameter exactly once")
        self._routes.clear()

    def _new_group(self, index: int, ids: tuple[int, ...], dense: bool) -> Group:
        found = {self._kinds[pid][:2] for pid in ids}
        if len(found) > 1:
            raise ValueError(f"the hook's {'dense' if dense else self.granularity} group mixes dtypes/devices "
                             f"{sorted(map(str, found))}; use granularity='bucket' (DDP buckets hold one dtype)")
        dtype, device = found.pop()
        return Group(index, ids, tuple(self.numels[pid] for pid in ids), dense, self._make_method(dense),
                     dtype, device)

    # ------------------------------------------------------------------ routing (every step)
    def route(self, index: int, params: Sequence[torch.Tensor], buffer_numel: int) -> Route:
        """The route of DDP bucket ``index`` holding ``params`` (cached; DDP's rebuilt buckets get
        theirs on first sight, by looking their parameters up)."""
        key = (index, tuple(p.data_ptr() for p in params))
        route = self._routes.get(key)
        if route is not None:
            return route
        if sum(p.numel() for p in params) != buffer_numel:
            raise RuntimeError(f"bucket {index}: its parameters hold {sum(p.numel() for p in params)} elements "
                               f"but its buffer {buffer_numel}; cannot locate them in the buffer")
        known = [self.ids.get(param.data_ptr()) for param in params]
        if params and all(pid is None for pid in known):
            raise RuntimeError(f"bucket {index}: none of its {len(params)} parameters belongs to the model whose "
                               "gradients this SparseHookState synchronized first: one SparseHookState is "
                               "registered on two DDP models; give each model its own SparseHookState")
        pids = []
        for param, pid in zip(params, known, strict=True):
            if pid is None or self.numels[pid] != param.numel():
                raise RuntimeError(f"bucket {index}: a parameter of {param.numel()} elements was not in DDP's "
                                   "first-iteration buckets (was a parameter replaced after the first step?)")
            pids.append(pid)
        groups = sorted({self.where[pid][0] for pid in pids})
        direct = None
        if len(groups) == 1 and self.groups[groups[0]].ids == tuple(pids):
            direct = groups[0]
        route = Route(tuple(groups), direct)
        offset = 0
        for pid in pids:
            gi, goff = self.where[pid]
            route.pieces.append((offset, gi, goff, self.numels[pid]))
            offset += self.numels[pid]
        self._routes[key] = route
        return route

    # ------------------------------------------------------------------ per-parameter residuals
    def residual_of(self, pid: int) -> torch.Tensor | None:
        """Parameter ``pid``'s residual: a view into its group's residual (``None``: none kept)."""
        gi, offset = self.where[pid]
        residual = self.groups[gi].residual
        return None if residual is None else residual[offset:offset + self.numels[pid]]

    def layout(self) -> dict[str, list[Any]]:
        """The parameters as numbered: each one's element count and dtype (the dtype's ``str``)."""
        return {"numels": list(self.numels), "dtypes": [str(kind[0]) for kind in self._kinds]}

    def state_dict(self) -> dict[str, Any]:
        """The numbering (:meth:`layout`), the groups (their methods' step and extra state) and one
        residual per parameter id."""
        groups = []
        for group in self.groups:
            method_state = group.method.state_dict()
            method_state["residual"] = None  # kept per parameter below
            groups.append({"params": list(group.ids), "dense": group.dense, "method": method_state})
        residuals = {}
        for pid in range(len(self.numels)):
            residual = self.residual_of(pid)
            if residual is not None:
                residuals[pid] = residual.clone()
        return {**self.layout(), "granularity": self.granularity, "groups": groups, "residuals": residuals}

    def layout_mismatch(self, saved: dict[str, Any]) -> str | None:
        """``None`` when the saved plan numbers the same parameters (count, sizes, dtypes) with the same
        granularity as this one, else the first difference."""
        numels, dtypes = [int(m) for m in saved["numels"]], list(saved["dtypes"])
        mine = self.layout()
        if numels != self.numels:
            pairs = zip(numels, self.numels, strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(numels), len(self.numels)))
            return (f"the saved state numbers {len(numels)} parameters ({sum(numels)} elements), this model "
                    f"{len(self.numels)} ({sum(self.numels)}); they differ from parameter {first} on: "
                    "not the same model")
        if dtypes != mine["dtypes"]:
            first = next(i for i, (a, b) in enumerate(zip(dtypes, mine["dtypes"], strict=True)) if a != b)
            return f"parameter {first} was saved as {dtypes[first]}, this model's is {mine['dtypes'][first]}"
        if saved["granularity"] != self.granularity:
            return f"the state was saved with granularity={saved['granularity']!r}, this one has {self.granularity!r}"
        return None

    def load_state_dict(self, saved: dict[str, Any], fresh_methods: bool = False) -> None:
        """Use the saved groups (so a method selects over the same elements as in the run that saved
        them, whatever DDP's bucketing now), with their methods' step and extra state, and give each
        parameter its saved residual (a lookup by id). ``fresh_methods``: restore only each method's
        step, and let its adaptive state (thresholds, partitions) start afresh (a job of another size:
        that state depends on the ranks)."""
        problem = self.layout_mismatch(saved)
        if problem is not None:
            raise ValueError(problem)
        self.set_groups([(tuple(int(i) for i in g["params"]), bool(g["dense"])) for g in saved["groups"]])
        for group, group_state in zip(self.groups, saved["groups"], strict=True):
            if fresh_methods:
                group.method.step = int(group_state["method"]["step"])
            else:
                group.method.load_state_dict(group_state["method"])
            group.method.residual = group.residual
        for pid, residual in saved["residuals"].items():
            mine = self.residual_of(int(pid))
            if mine is not None:
                mine.copy_(residual)
