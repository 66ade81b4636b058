"""The grouping engine behind the DDP hook and the synchronizer.

Both integrations synchronize a model's gradients the same way; they differ only in where the
gradients come from and where the results go. The DDP hook (:mod:`.hook`) gets them in DDP's buckets,
on a communication thread, and answers futures; the synchronizer (:mod:`.synchronizer`) reads
``param.grad`` after backward and applies the optimizer-side techniques (DGC momentum correction,
local clipping). Everything else is this engine's:

* **Groups** (:class:`~.residuals.ParamPlan`): the parameters in canonical order, one method call per
  group and step, each group with its flat input and output tensors, its layer layout and its method
  instance; parameters that :func:`~.residuals.goes_dense` (``dense_below``) form one dense group.
* **Residuals** belong to parameters: each group's residual is one flat tensor the method updates in
  place, a parameter's residual a view of it (:meth:`GroupingEngine.residuals`).
* **The dense warm-up** (the first ``dense_warmup_steps`` steps averaged densely: DGC, RedSync).
* **Switching methods** (:meth:`GroupingEngine.switch_method`): the groups stay, each gets the new
  method, and its residual under the old one is carried to its next gradient (:class:`.ResidualCarry`),
  so nothing is lost across the switch.
* **Non-finite gradients** (:mod:`.nonfinite`): one policy for every method the engine builds (the
  groups', the dense group's, the warm-up's); once a call of a step found NaN/Inf on some rank, the
  later groups of that step return the policy's result without a call (:meth:`GroupingEngine._on_nonfinite`).
* **Stats** of every call of a step, and the **checkpoint** (step counter, groups, method states,
  one residual per parameter, carried residuals, the non-finite policy).

The hot path allocates no length-n tensor: a group's method writes into the group's output tensor
(``method(grad, layout, out=...)``), and gathering a gradient that no bucket holds contiguously
reuses the group's input tensor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..methods import Method, MethodSpec, Stats
from ..transport.comm import Communicator
from .auto import DenseFallback
from .nonfinite import Overflow, check_policy, split_policy
from .overlap import hidden_seconds
from .residuals import Group, ParamPlan, goes_dense
from .schedule import ResidualCarry
from .world import (
    StateLoadError,
    World,
    as_state_list,
    check_keys,
    check_own,
    check_siblings,
    fold,
    saved_world,
    tensor_problem,
)

__all__ = ["GroupingEngine", "EngineView", "LoadedState"]

log = logging.getLogger(__name__)

#: The dense method of the warm-up and of the small-tensor group.
_DENSE = MethodSpec("dense")


class GroupingEngine:
    """Groups of parameters, their methods, residuals, warm-up, switches, stats and checkpoint.

    Args:
        spec: the method (a :class:`~sparsecomm.methods.MethodSpec`).
        comm: called once, when the first method is built, for the communicator to use.
        granularity: ``"bucket"`` (one group per bucket given to :meth:`build`) or ``"model"`` (one
            group for every parameter that does not go dense).
        dense_warmup_steps: steps averaged densely before the method takes over.
        dense_below: the small-tensor rule of :func:`~.residuals.goes_dense` (0: off).
        use_layout: pass each group's layer layout to its method.
        nonfinite_default: the non-finite policy when ``spec`` names none (its ``nonfinite`` option):
            ``"propagate"`` for the DDP hook, ``"error"`` for the synchronizer (:mod:`.nonfinite`).
        dense_fallback: time dense and sparse steps and keep the method only where it makes steps
            faster (:class:`~.auto.DenseFallback`), or ``None``.
        warmup_dtype: the floating dtype the dense warm-up's all-reduce travels in (the average is
            cast back to the gradient's), or ``None``: the gradient's own.
    """

    def __init__(self, spec: MethodSpec, comm: Callable[[], Communicator], *, granularity: str = "bucket",
                 dense_warmup_steps: int = 0, dense_below: int = 0, use_layout: bool = True,
                 nonfinite_default: str = "error", dense_fallback: DenseFallback | None = None,
                 warmup_dtype: torch.dtype | None = None) -> None:
        if warmup_dtype is not None and not (isinstance(warmup_dtype, torch.dtype) and warmup_dtype.is_floating_point):
            raise ValueError(f"dense_warmup_dtype={warmup_dtype!r} must be a floating torch dtype "
                             "(e.g. torch.bfloat16) or None")
        spec, policy = split_policy(spec, nonfinite_default)
        #: the method; its ``nonfinite`` option is the engine's (:attr:`nonfinite`)
        self.spec = spec
        self.granularity = granularity
        self.dense_warmup_steps = dense_warmup_steps
        self.dense_fallback = dense_fallback
        self.warmup_dtype = warmup_dtype
        self.dense_below = dense_below
        self.use_layout = bool(use_layout)
        #: steps begun so far (the owner advances it: the hook on DDP's last bucket, the synchronizer
        #: after each step)
        self.iter = 0
        #: residuals of a method switched off, by group index, for the group's next gradient
        self.carry = ResidualCarry()
        #: method calls skipped on every rank for NaN/Inf (``nonfinite="skip"`` or ``"propagate"``)
        self.skipped_calls = 0
        #: the non-finite policy and whether a call of this step found NaN/Inf
        self.overflow = Overflow(policy)
        self.plan: ParamPlan | None = None
        self._comm_factory = comm
        self._comm: Communicator | None = None
        self._warmup_method: Method | None = None
        self._loaded: dict[str, Any] | None = None        # a loaded plan state, until the groups exist
        self._loaded_fresh = False                          # ... from a job of another size
        self._expected_world: World | None = None           # a loaded state's world, checked with the comm
        self._owner = "hook"
        self._deferred_switch: MethodSpec | None = None     # a switch after loading it
        self._calls: list[tuple[Stats, float, float]] = []  # this step's (stats, start, end)
        self._stats: list[Stats] = []                       # finished steps' records, until taken
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup
    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            comm = self._comm_factory()
            if self._expected_world is not None:  # a state loaded before the process group existed
                problem = check_own({"world": self._expected_world._asdict()}, World(comm.size, comm.rank),
                                    self._owner)
                if problem is not None:
                    raise StateLoadError(f"cannot load the {self._owner} state: {problem}")
                self._expected_world = None
            self._comm = comm
        return self._comm

    @property
    def dense_until(self) -> int:
        """The steps averaged densely first: the warm-up, extended for ``dense_fallback``'s timing."""
        if self.dense_fallback is None:
            return self.dense_warmup_steps
        return self.dense_fallback.dense_steps(self.dense_warmup_steps)

    @property
    def in_warmup(self) -> bool:
        return self.iter < self.dense_until

    @property
    def groups(self) -> list[Group]:
        return [] if self.plan is None else self.plan.groups

    @property
    def nonfinite(self) -> str:
        """The non-finite policy of every method the engine builds (:mod:`.nonfinite`)."""
        return self.overflow.policy

    @property
    def overflowed(self) -> bool:
        """Whether a call of the current step found NaN/Inf on some rank (the same on every rank): the
        step is dropped (``"propagate"``, ``"skip"``) and the later groups make no call."""
        return self.overflow.seen

    def _build(self, spec: MethodSpec) -> Method:
        method = spec.build(self.comm)
        method.nonfinite = self.nonfinite
        return method

    def _new_method(self, dense: bool) -> Method:
        return self._build(_DENSE if dense else self.spec)

    def _is_dense(self, numel: int, itemsize: int) -> bool:
        return self.spec.sparse and goes_dense(numel, itemsize, self.spec.density, self.dense_below)

    def build(self, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
        """Number the parameters of ``buckets`` (lists of parameters, in order) and form the groups,
        or take a loaded checkpoint's groups."""
        self.plan = plan = ParamPlan(self.granularity, self._is_dense, self._new_method)
        plan.number(buckets)
        if self._loaded is not None:
            plan.load_state_dict(self._loaded, fresh_methods=self._loaded_fresh)
            self._loaded = None
        else:
            plan.set_groups(plan.members_of(buckets))
        if self._deferred_switch is not None:
            self._swap_methods(self._deferred_switch)
            self._deferred_switch = None

    def regroup(self, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
        """Form the groups on new buckets (DDP rebuilt its own); groups that stay keep their state."""
        assert self.plan is not None
        self.plan.set_groups(self.plan.members_of(buckets))

    # ------------------------------------------------------------------ one step
    def reduce(self, group: Group, grad: torch.Tensor, *, warmup: bool = False, **figures: Any) -> torch.Tensor:
        """The average over ranks of ``grad``, the gradient of ``group`` (plus a residual carried from
        a switched-off method), written into the group's output tensor; the call's stats get
        ``figures``. ``warmup``: averaged densely instead (the dense warm-up). After an overflow
        earlier in the step: the policy's result, without a call."""
        out = group.outbuf()
        skipped = self.overflow.short_circuit(grad, out=out)
        if skipped is not None:
            return skipped
        grad = self.carry.added_to(group.index, grad)
        if warmup:
            result = self.warmup_reduce(grad, out=out, **figures)
        else:
            start = time.perf_counter()
            result = group.call(grad, self.use_layout)
            self._record(group.method, start, dense_calls=int(group.dense), **figures)
            if group.dense:
                group.method.stats["dense_params"] = len(group.ids)
        if not self.overflowed:  # a dropped step leaves a carried residual for the group's next gradient
            self.carry.discard(group.index)
        return result

    def warmup_reduce(self, grad: torch.Tensor, *, out: torch.Tensor | None = None, **figures: Any) -> torch.Tensor:
        """The dense average of ``grad`` (into ``out`` when given), recorded as a warm-up call; after
        an overflow earlier in the step, the policy's result without a call."""
        skipped = self.overflow.short_circuit(grad, out=out)
        if skipped is not None:
            return skipped
        if self._warmup_method is None:
            self._warmup_method = self._build(_DENSE)
        start = time.perf_counter()
        if self.warmup_dtype is not None and grad.dtype != self.warmup_dtype:
            # the average in the narrower dtype (its bytes on the wire), then cast back, as torch's
            # bf16_compress_hook; cost: the dense all-reduce's at the dtype's item size
            low = self._warmup_method(grad.to(self.warmup_dtype))
            result = out.copy_(low) if out is not None else low.to(grad.dtype)
        else:
            result = self._warmup_method(grad, out=out)
        self._record(self._warmup_method, start, warmup=True, **figures)
        return result

    def _record(self, method: Method, start: float, **figures: Any) -> None:
        self._calls.append((method.stats, start, time.perf_counter()))
        method.stats.update(**figures)
        if method.stats.skipped:
            self._on_nonfinite(method)

    def _on_nonfinite(self, method: Method) -> None:
        """The one place where the engine learns of a call skipped for NaN/Inf gradients.

        The method has already decided, on every rank alike (its ``nonfinite`` policy,
        :attr:`~sparsecomm.methods.Method.nonfinite`): ``"error"`` raised before anything was sent,
        ``"skip"`` returned zeros and ``"propagate"`` NaN, with the residual and step unchanged. Here
        the skip is counted, and the rest of the step is short-circuited (:class:`.nonfinite.Overflow`):
        the later groups return the same without a call, so no more state moves in a dropped step."""
        self.skipped_calls += 1
        self.overflow.note(method)

    def record_stats(self, stats: Stats) -> None:
        """Keep the stats of a call made outside the groups (the hook's sparse-gradient buckets) for
        :meth:`take_stats`."""
        with self._lock:
            self._stats.append(stats)

    def end_step(self, backward_end: float | None = None, keep: bool = True) -> Stats:
        """Close a step: each call's ``hidden_time`` (its seconds before ``backward_end``, when the
        calls overlapped backward) is set, the records are kept for :meth:`take_stats` (``keep``),
        their total is returned, and the next step starts without an overflow."""
        records = [stats for stats, _, _ in self._calls]
        if backward_end is not None:
            for stats, start, end in self._calls:
                stats.hidden_time = hidden_seconds([(start, end)], backward_end)
        self._calls = []
        self.overflow.reset()
        self.end_native_step()  # dense_fallback's clock
        if keep:
            with self._lock:
                self._stats.extend(records)
        return Stats.total(records)

    def end_native_step(self) -> None:
        """Tell ``dense_fallback``'s clock that a step ended: all that closes a step whose buckets the
        owner handed to the backend's all-reduce itself (the hook's dense path), and part of
        :meth:`end_step` (the owner advanced iter when the step's last call began)."""
        if self.dense_fallback is not None:
            self.dense_fallback.step_ended(self.iter - 1, self.dense_until, self.comm,
                                           lambda: self.switch_method(_DENSE))

    def take_stats(self) -> Stats:
        """Totals over the calls of the steps closed since the last call; then start afresh."""
        with self._lock:
            total = Stats.total(self._stats)
            self._stats.clear()
        return total

    def detach(self, comm: Callable[[], Communicator]) -> GroupingEngine:
        """A copy of this engine that holds no communicator and no method instance: the same method,
        options, policy, step counter, carried residuals and stats not yet taken, and the groups as
        a saved state (their residuals stay readable, :meth:`residuals`); this engine gives up its
        groups, methods and communicator. The hook's ``close()`` keeps the copy, so that nothing
        refers to the process group any more and torch frees it at once (a gloo group holds its
        threads and sockets until its last reference goes; the groups refer back to their engine, so
        without this they would wait for the garbage collector). ``comm`` is the copy's communicator
        factory."""
        engine = GroupingEngine(self.spec, comm, granularity=self.granularity,
                                dense_warmup_steps=self.dense_warmup_steps, dense_below=self.dense_below,
                                use_layout=self.use_layout, nonfinite_default=self.nonfinite,
                                dense_fallback=self.dense_fallback, warmup_dtype=self.warmup_dtype)
        engine.iter, engine.skipped_calls = self.iter, self.skipped_calls
        engine.carry.load_state_dict(self.carry.state_dict())
        engine._loaded = self.plan.state_dict() if self.plan is not None else self._loaded
        engine._loaded_fresh = self._loaded_fresh
        with self._lock:
            engine._stats = list(self._stats)
        self.drop()
        return engine

    def drop(self) -> None:
        """Give up the groups, their methods and the communicator (when the owner closes or goes):
        the groups refer back to the engine, so without this they, and the process group their
        methods hold, would wait for the garbage collector."""
        self.plan, self._comm, self._warmup_method = None, None, None

    # ------------------------------------------------------------------ changes between steps
    def switch_method(self, spec: MethodSpec) -> None:
        """Synchronize with ``spec`` from the next step on: each non-dense group gets a new method,
        and its residual under the old one is carried to its next gradient (Shi et al., section 5.6).
        A ``nonfinite`` option in ``spec`` becomes the policy of every method (else it stays)."""
        spec, policy = split_policy(spec, self.nonfinite)
        self.set_nonfinite(policy)
        if self.plan is None and self._loaded is not None:
            self._deferred_switch = spec  # the loaded groups, formed later, hold the old method's state
            return
        self._swap_methods(spec)

    def _swap_methods(self, spec: MethodSpec) -> None:
        old, self.spec = self.spec, spec
        if self.plan is None:
            return
        for group in self.plan.groups:
            if group.dense:
                continue
            self.carry.put(group.index, group.residual)
            self.plan.replace_method(group, self._build(spec))
        log.info("switched from %s to %s at step %d (%d residuals carried)", old.label(), spec.label(),
                 self.iter, len(self.carry))

    def set_nonfinite(self, policy: str) -> None:
        """The non-finite policy of every method, those built already included."""
        self.overflow.policy = check_policy(policy)
        built = [group.method for group in self.groups]
        for method in (*built, self._warmup_method):
            if method is not None:
                method.nonfinite = policy

    def set_density(self, density: float) -> None:
        """Select this density from the next call on, in every group the method sparsifies."""
        self.spec = self.spec.replace(density=density)
        for group in self.groups:
            if not group.dense:
                group.method.set_density(density)

    # ------------------------------------------------------------------ residuals and checkpoints
    def residuals(self) -> dict[int, torch.Tensor]:
        """Each parameter's residual (a view, by canonical id); before the groups form, those of a
        loaded state."""
        if self.plan is None:
            return {} if self._loaded is None else dict(self._loaded["residuals"])
        found = {pid: self.plan.residual_of(pid) for pid in range(len(self.plan.numels))}
        return {pid: r for pid, r in found.items() if r is not None}

    def state_dict(self, world: World | None) -> dict[str, Any]:
        """The method, the non-finite policy, the step counter, the world it is saved in (``world``:
        ``{"size": P, "rank": r}``, ``None`` before any process group), the groups (the parameter
        layout, their methods' state, one residual per parameter) and the carried residuals."""
        plan = self.plan.state_dict() if self.plan is not None else self._loaded
        state = {"method": self.spec.name, "options": dict(self.spec.options), "nonfinite": self.nonfinite,
                 "iter": self.iter, "world": None if world is None else {"size": world.size, "rank": world.rank},
                 "plan": plan, "carry": self.carry.state_dict()}
        if self.dense_fallback is not None:
            state["dense_fallback"] = self.dense_fallback.state_dict()
        return state

    def _fell_back(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` was saved after ``dense_fallback`` switched to the dense all-reduce."""
        return self.dense_fallback is not None and (state.get("dense_fallback") or {}).get("decision") == "dense"

    def prepare_load(self, states: Mapping[str, Any] | Sequence[Mapping[str, Any]], owner: str,
                     world: World | None, *, same: Sequence[str] = (),
                     ignore_options: Sequence[str] = ()) -> tuple[LoadedState | None, str | None]:
        """Check saved state(s) against this engine and ``world`` without changing anything.

        ``states`` is this rank's own :meth:`state_dict`, or every rank's of the job that saved them
        (a list, in any order): then a job of the same size takes its own rank's, and a job of another
        size this rank's share of the residuals (:func:`~.world.fold`). ``same``: the owner's keys
        that must match among the saved states; ``ignore_options``: method options that may differ
        from this engine's (a density under warm-up). Returns (what to load, ``None``) or
        (``None``, the problem)."""
        try:
            listed = as_state_list(states)
        except TypeError as exc:
            return None, str(exc)
        for state in listed:
            problem = check_keys(state, _STATE_KEYS, owner)
            if problem is not None:
                return None, problem
        first = listed[0]
        live = _DENSE if self._fell_back(first) else self.spec  # a run that fell back saved the dense method
        if first["method"] != live.name:
            return None, (f"it was saved with method {first['method']!r} and this {owner} runs "
                          f"{live.name!r} (switch_method() to it first, or build the {owner} with it)")
        saved_options = {k: v for k, v in first["options"].items() if k not in ignore_options}
        live_options = {k: v for k, v in live.options.items() if k not in ignore_options}
        if saved_options != live_options:
            keys = sorted(set(saved_options) | set(live_options), key=str)
            key = next(k for k in keys if saved_options.get(k, _ABSENT) != live_options.get(k, _ABSENT))
            return None, (f"method option {key!r} was {saved_options.get(key, 'unset')!r} when it was saved, "
                          f"this {owner} has {live_options.get(key, 'unset')!r}")
        if isinstance(states, Mapping):
            problem = check_own(first, world, owner)
            if problem is not None:
                return None, problem
            sources: list[Mapping[str, Any]] = [first]
        else:
            sources, problem = check_siblings(listed, owner, ("method", "options", "iter", *same))
            if problem is None:
                layouts = [_plan_layout(s["plan"]) for s in sources]
                odd = next((q for q, layout in enumerate(layouts) if layout != layouts[0]), None)
                if odd is not None:
                    problem = f"the saved {owner} states of ranks 0 and {odd} number different parameters or groups"
            if problem is not None:
                return None, problem
        for source in sources:
            problem = _residual_problem(source, owner, multi=len(sources) > 1)
            if problem is not None:
                return None, problem
        if self.plan is not None and first["plan"] is not None:
            problem = self.plan.layout_mismatch(first["plan"])
            if problem is not None:
                return None, problem
        if len(sources) == 1:
            return LoadedState(dict(first), sources, resized=False), None
        assert world is not None  # check_siblings needs recorded worlds; a list is loaded in a process group
        if len(sources) == world.size:
            return LoadedState(dict(sources[world.rank]), sources, resized=False), None
        return LoadedState(_folded(sources, world), sources, resized=True), None

    def load(self, loaded: LoadedState, owner: str, world: World | None) -> None:
        """Apply what :meth:`prepare_load` checked: step counter, carried residuals, groups (now, or
        when they form on the first bucket). Without a process group yet, the saved world is checked
        when the communicator is made."""
        state = loaded.state
        if self.dense_fallback is not None and state.get("dense_fallback"):
            self.dense_fallback.load_state_dict(state["dense_fallback"])
            if self._fell_back(state) and self.spec.name != _DENSE.name:
                self._swap_methods(_DENSE)
        self.iter = int(state["iter"])
        self.carry.load_state_dict(state["carry"])
        if loaded.resized:
            assert world is not None
            old = len(loaded.sources)
            log.warning("%s state of a job of %d ranks loaded on rank %d of %d: it holds the residuals of old "
                        "rank(s) %s (the sum over ranks is conserved); the method's adaptive state (thresholds, "
                        "partitions) starts afresh at step %d", owner, old, world.rank, world.size,
                        list(range(world.rank, old, world.size)), self.iter)
        self._expected_world = saved_world(state) if world is None and not loaded.resized else None
        self._owner = owner
        saved = state["plan"]
        if saved is not None and self.plan is not None:
            self.plan.load_state_dict(saved, fresh_methods=loaded.resized)
        else:
            self._loaded, self._loaded_fresh = saved, loaded.resized


@dataclass
class LoadedState:
    """A saved state checked by :meth:`GroupingEngine.prepare_load`: ``state`` is this rank's (its
    own, or its share of every old rank's), ``sources`` the saved states it comes from (by old rank),
    ``resized`` whether they come from a job of another size."""

    state: dict[str, Any]
    sources: list[Mapping[str, Any]]
    resized: bool


_ABSENT = object()
#: the keys of every engine state
_STATE_KEYS = ("method", "options", "nonfinite", "iter", "world", "plan", "carry")


def _plan_layout(plan: Mapping[str, Any] | None) -> Any:
    if plan is None:
        return None
    return (list(plan["numels"]), list(plan["dtypes"]), plan["granularity"],
            [(list(g["params"]), bool(g["dense"])) for g in plan["groups"]])


def _residual_problem(state: Mapping[str, Any], owner: str, multi: bool) -> str | None:
    """The first residual of ``state`` (per parameter, or carried) that is not a finite 1-D tensor of
    its parameter's size and dtype."""
    whose = f"rank {state['world']['rank']}'s saved " if multi else "the saved "
    plan = state["plan"]
    if plan is not None:
        numels, dtypes = list(plan["numels"]), list(plan["dtypes"])
        if len(numels) != len(dtypes):
            return f"{whose}{owner} state's layout is damaged ({len(numels)} sizes, {len(dtypes)} dtypes)"
        for pid, residual in plan["residuals"].items():
            if not isinstance(pid, int) or not 0 <= pid < len(numels):
                return f"{whose}{owner} state holds a residual for parameter {pid!r}, which its layout does not have"
            problem = tensor_problem(residual, numels[pid], dtypes[pid], f"{whose}residual of parameter {pid}")
            if problem is not None:
                return problem
    for key, residual in state["carry"].items():
        problem = tensor_problem(residual, None, None, f"{whose}carried residual of group {key!r}")
        if problem is not None:
            return problem
    return None


def _folded(sources: Sequence[Mapping[str, Any]], world: World) -> dict[str, Any]:
    """Rank ``world.rank``'s share of every old rank's state (``sources``, by old rank): residuals and
    carried residuals folded (:func:`~.world.fold`), the rest from old rank 0's state."""
    first = sources[0]
    state = dict(first)
    state["world"] = {"size": world.size, "rank": world.rank}
    plan = first["plan"]
    if plan is not None:
        residuals = {}
        for pid in sorted({pid for s in sources for pid in s["plan"]["residuals"]}):
            share = fold([s["plan"]["residuals"].get(pid) for s in sources], world.rank, world.size)
            if share is not None:
                residuals[pid] = share
        state["plan"] = {**plan, "residuals": residuals}
    carry = {}
    for key in {key for s in sources for key in s["carry"]}:
        share = fold([s["carry"].get(key) for s in sources], world.rank, world.size)
        if share is not None:
            carry[key] = share
    state["carry"] = carry
    return state


class EngineView:
    """What the DDP hook's state and the synchronizer both show of their :class:`GroupingEngine`
    (``self.engine``), read-only: the method, the policy, the warm-up, the carried residuals."""

    engine: GroupingEngine

    @property
    def spec(self) -> MethodSpec:
        """The method (name and options) that synchronizes the next step."""
        return self.engine.spec

    @property
    def method_name(self) -> str:
        return self.engine.spec.name

    @property
    def method_options(self) -> dict[str, Any]:
        return dict(self.engine.spec.options)

    @property
    def nonfinite(self) -> str:
        """The non-finite policy of every group (:mod:`.nonfinite`)."""
        return self.engine.nonfinite

    @property
    def carry(self) -> ResidualCarry:
        """Residuals of a method switched off, by group, added to the group's next gradient."""
        return self.engine.carry

    @property
    def dense_warmup_steps(self) -> int:
        return self.engine.dense_warmup_steps

    @property
    def in_warmup(self) -> bool:
        return self.engine.in_warmup
