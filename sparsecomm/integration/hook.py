"""A DDP communication hook that synchronizes gradients with a sparsecomm method, overlapped with backward.

One line in an existing DDP script::

    state = sparsecomm.SparseHookState(None, method="spardl", density=0.01)
    ddp_model.register_comm_hook(state, sparsecomm.hook)

The state follows the conventions of torch's ``PowerSGDState``
(``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``): the process group comes first,
the iteration counter advances on the last bucket, the state pickles without its process group, small
tensors are not compressed (``dense_below``, the analogue of ``min_compression_rate``), and the hook
returns a ``torch.futures.Future`` of a tensor shaped like the bucket: the bucket's *average* gradient
over the ranks, as plain DDP's.

How a step runs:

* **Overlap** (``overlap=True``, :mod:`.overlap`): the hook returns a pending future at once and hands
  the bucket to the state's communication thread, which selects and communicates while backward
  computes the next buckets; DDP waits on the futures at the end of backward. The thread takes the
  buckets in DDP's order (bucket index order, the same on every rank) over a process group of its
  own, so every rank issues the same collectives in the same order. ``overlap=False`` runs the same
  work inside the hook (the synchronous path; bit-identical results).
* **Groups** (:mod:`.residuals`): one method call per group and step. ``granularity="bucket"``: one
  group per bucket of DDP's first iteration; ``granularity="model"``: the whole model in one flat
  buffer (canonical parameter order) and one call when its last gradient arrives, as SparDL, Ok-Topk
  and ExDyna select over the whole model. With ``dense_below`` > 0 (default 0: off), parameters
  that :func:`~.residuals.goes_dense` (fewer elements, or a sparse message not smaller than the
  dense one) are all-reduced densely in one fused call (stats ``dense_calls``).
* **Residuals belong to parameters**: each group's residual is one flat tensor the method updates in
  place, each parameter's residual a view of it. The groups never change, so DDP's bucket rebuild
  after the first iteration and a checkpoint reload are lookups, and a resumed run continues
  bit-identically.
* For the first ``dense_warmup_steps`` iterations each bucket is all-reduced densely (the dense
  warm-up of DGC and RedSync).

Bad options raise at construction (``ValueError`` / ``TypeError`` naming the option), before the
first backward: the state builds a probe instance of the method when the process group is up.
"""

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.validate import check_choice, check_int
from ..methods import Method, Stats, make_method, method_class
from ..transport.comm import Communicator
from .nonfinite import HOOK_DEFAULT, Overflow, check_policy
from .options import check_options_offline
from .overlap import CommThread, hidden_seconds, private_group
from .residuals import ParamPlan, Route, goes_dense
from .schedule import ResidualCarry
from .sparse_buckets import SparseBuckets

__all__ = ["SparseHookState", "hook", "GRANULARITIES", "DENSE_BELOW"]

log = logging.getLogger(__name__)

_STATE_VERSION = 2
#: The values of ``SparseHookState(granularity=...)``.
GRANULARITIES = ("bucket", "model")
#: Default ``dense_below``: 0, every parameter goes to the method (see docs/training.md).
DENSE_BELOW = 0


@dataclass
class _Bucket:
    """What the hook hands the communication thread: one DDP bucket of one iteration."""

    index: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    is_last: bool
    warmup: bool
    arrival: float
    future: torch.futures.Future
    route: Route | None = None
    result: torch.Tensor | None = None


class SparseHookState:
    """State of :func:`hook`: the method's groups, their per-parameter residuals, the iteration counter.

    Args:
        process_group: the group to synchronize over (``None``: the default group), as for DDP.
            The state communicates over a private copy of it (same ranks and backend).
        method: a name from :func:`sparsecomm.available_methods`.
        dense_warmup_steps: all-reduce densely for this many first iterations (>= 0).
        use_layout: pass each group's layer layout to the method (layer-wise methods need it).
        granularity: ``"bucket"`` (one method call per DDP bucket of the first iteration, overlapped
            with backward) or ``"model"`` (one call over the whole model when its last gradient
            arrives).
        overlap: run selection and communication on a thread, behind backward (default), or inside
            the hook (``False``, the synchronous path).
        dense_below: parameters with fewer elements, or whose sparse message would not be smaller
            than the dense one, are all-reduced densely in one fused call; 0: none (sparse methods).
        nonfinite: when any rank's gradient holds NaN/Inf: ``"propagate"`` (default; every rank gets
            NaN, nothing is sent, state untouched, so ``GradScaler`` skips the step as under plain
            DDP), ``"skip"`` (zeros) or ``"error"`` (raise); for every group, dense ones and the
            warm-up included (:mod:`.nonfinite`).
        **method_options: passed to :func:`sparsecomm.make_method`, e.g. ``density=0.01``.

    Raises:
        ValueError / TypeError: unknown method, density outside (0, 1], unknown option, bad warm-up,
            granularity or dense_below.
    """

    _comm: Communicator | None

    def __init__(self, process_group: dist.ProcessGroup | None = None, method: str = "spardl", *,
                 dense_warmup_steps: int = 0, use_layout: bool = True, granularity: str = "bucket",
                 overlap: bool = True, dense_below: int = DENSE_BELOW, **method_options: Any) -> None:
        method_class(method)  # unknown name: ValueError listing the available ones
        check_int("dense_warmup_steps", dense_warmup_steps, minimum=0)
        check_choice("granularity", granularity, GRANULARITIES)
        check_int("dense_below", dense_below, minimum=0)
        self.nonfinite = check_policy(method_options.pop("nonfinite", HOOK_DEFAULT))
        check_options_offline(method, method_options)  # before the process group exists too
        self.process_group = process_group
        self.method_name = method
        self.method_options = dict(method_options)
        self.dense_warmup_steps = dense_warmup_steps
        self.use_layout = bool(use_layout)
        self.granularity = granularity
        self.overlap = bool(overlap)
        self.dense_below = dense_below
        self.iter = 0
        #: residuals of a method switched off (:meth:`switch_method`), by group, for the next gradient
        self.carry = ResidualCarry()
        self._reset_runtime()
        if dist.is_available() and dist.is_initialized():
            make_method(method, Communicator(process_group), **self._options())  # probe: validates options
            self._comm = Communicator(private_group(process_group))
        else:
            log.info("process group not initialized yet: %r options that depend on the ranks are checked "
                     "on the first bucket", method)

    def _reset_runtime(self) -> None:
        self._comm = None
        self.plan: ParamPlan | None = None
        self._loaded: dict[str, Any] | None = None   # a loaded plan state, until the groups exist
        self._deferred_switch: tuple[str, dict[str, Any]] | None = None  # a switch after loading it
        self._thread: CommThread | None = None
        self._warmup_method: Method | None = None
        self._first: list[_Bucket] = []              # first-iteration buckets, until the groups exist
        self._pending: list[_Bucket] = []            # this iteration's buckets not yet answered
        self._inputs: dict[int, torch.Tensor] = {}   # group -> its gradient this iteration
        self._outputs: dict[int, torch.Tensor] = {}  # group -> its averaged gradient this iteration
        self._calls: list[tuple[Stats, float, float]] = []  # this iteration's (stats, start, end)
        self._bucketing: list[tuple[int, ...]] = []   # this iteration's buckets (parameter data_ptrs)
        self._last_bucketing: list[tuple[int, ...]] | None = None
        self._bucket_params: list[list[torch.Tensor]] = []
        self._error: BaseException | None = None
        self._sparse = SparseBuckets(lambda: self.comm)  # buckets of sparse gradients (nn.Embedding(sparse=True))
        self._stats: list[Stats] = []
        self._lock = threading.Lock()
        self._overflow = Overflow(getattr(self, "nonfinite", HOOK_DEFAULT))

    # ------------------------------------------------------------------ setup
    @property
    def comm(self) -> Communicator:
        """The communicator of the state's private process group."""
        if self._comm is None:
            self._comm = Communicator(private_group(self.process_group))
        return self._comm

    @property
    def in_warmup(self) -> bool:
        return self.iter < self.dense_warmup_steps

    def _options(self, dense: bool = False) -> dict[str, Any]:
        return {"nonfinite": self.nonfinite} if dense else {**self.method_options, "nonfinite": self.nonfinite}

    def _new_method(self, dense: bool) -> Method:
        return make_method("dense", self.comm, **self._options(dense)) if dense else \
            make_method(self.method_name, self.comm, **self._options())

    def _is_dense(self, numel: int, itemsize: int) -> bool:
        if not method_class(self.method_name).sparse:
            return False
        return goes_dense(numel, itemsize, self.method_options.get("density"), self.dense_below)

    def _build(self, buckets: list[_Bucket]) -> None:
        self.plan = plan = ParamPlan(self.granularity, self._is_dense, self._new_method)
        params = [b.params for b in buckets]
        plan.number(params)
        if self._loaded is not None:
            plan.load_state_dict(self._loaded)
            self._loaded = None
        else:
            plan.set_groups(plan.members_of(params))
        if self._deferred_switch is not None:
            self._swap_methods(*self._deferred_switch)
            self._deferred_switch = None

    # ------------------------------------------------------------------ the work of one bucket
    def submit(self, bucket: _Bucket) -> None:
        """Process ``bucket`` on the communication thread (``overlap``) or right here."""
        if not self.overlap:
            self._process(bucket)
            return
        if self._thread is None:
            self._thread = CommThread()
        self._thread.submit(self._process, bucket)

    def _process(self, bucket: _Bucket) -> None:
        try:
            if self._error is not None:
                raise self._error
            todo: list[_Bucket] = []
            if bucket.buffer.is_sparse:  # its own bucket, outside the groups (:mod:`.sparse_buckets`)
                self._reduce_sparse(bucket)
                if bucket.is_last and self.plan is None and self._first:
                    self._build(self._first)
                    todo, self._first = self._first, []
            elif self.plan is None:  # DDP's first iteration: the groups exist once every bucket is seen
                self._first.append(bucket)
                if not bucket.is_last:
                    return
                self._build(self._first)
                todo, self._first = self._first, []
            else:
                todo = [bucket]
            for item in todo:
                self._step(item)
            if bucket.is_last and self.plan is not None:
                self._finish(bucket)
        except BaseException as exc:  # noqa: BLE001 - fail every waiting future, DDP raises it
            self._fail(exc, bucket)

    def _reduce_sparse(self, bucket: _Bucket) -> None:
        """A bucket of one sparse gradient: averaged by the row-sparse reducer, answered at once."""
        result, stats = self._sparse.reduce(bucket.index, bucket.buffer, self.method_name)
        with self._lock:
            self._stats.append(stats)
        bucket.future.set_result(result)

    def _step(self, bucket: _Bucket) -> None:
        plan = self.plan
        assert plan is not None
        bucket.route = route = plan.route(bucket.index, bucket.params, bucket.buffer.numel())
        self._pending.append(bucket)
        self._bucketing.append(tuple(p.data_ptr() for p in bucket.params))
        self._bucket_params.append(bucket.params)
        if bucket.warmup:
            if self._warmup_method is None:
                self._warmup_method = make_method("dense", self.comm, **self._options(dense=True))
            bucket.result = self._call(self._warmup_method, self._warmup_method, bucket.buffer, warmup=True)
            return
        if route.direct is not None:
            self._inputs[route.direct] = bucket.buffer
        else:
            for boff, gi, goff, numel in route.pieces:
                plan.groups[gi].inbuf()[goff:goff + numel].copy_(bucket.buffer[boff:boff + numel])
        for _, gi, _, _ in route.pieces:
            plan.groups[gi].arrived += 1
        for gi in route.groups:
            group = plan.groups[gi]
            if group.arrived == len(group.ids):
                grad = self._inputs.pop(gi, None)
                grad = self.carry.flush_into(gi, group.inbuf() if grad is None else grad)
                self._outputs[gi] = self._call(group.method, group.call, grad, self.use_layout,
                                               dense_calls=int(group.dense))
                if group.dense:
                    group.method.stats["dense_params"] = len(group.ids)

    def _call(self, method: Method, run: Any, *args: Any, **figures: Any) -> torch.Tensor:
        """``run(*args)``, timed; ``method``'s stats of the call get ``figures``."""
        skipped = self._overflow.short_circuit(args[0])
        if skipped is not None:  # an earlier group of this iteration overflowed: no call
            return skipped
        start = time.perf_counter()
        out = run(*args)
        self._calls.append((method.stats, start, time.perf_counter()))
        method.stats.update(**figures)
        self._overflow.note(method)
        return out

    def _answer(self, bucket: _Bucket) -> None:
        route = bucket.route
        assert route is not None
        if bucket.result is not None:
            result = bucket.result
        elif route.direct is not None:
            result = self._outputs[route.direct]
        else:
            for boff, gi, goff, numel in route.pieces:
                bucket.buffer[boff:boff + numel].copy_(self._outputs[gi][goff:goff + numel])
            result = bucket.buffer
        bucket.future.set_result(result.view_as(bucket.buffer))

    def _finish(self, last: _Bucket) -> None:
        """End of an iteration: every group has run; record the stats, then answer every bucket."""
        plan = self.plan
        assert plan is not None
        if not last.warmup and len(self._outputs) != len(plan.groups):
            missing = [g.index for g in plan.groups if g.index not in self._outputs]
            raise RuntimeError(f"hook groups {missing} did not receive all their gradients this iteration")
        for stats, start, end in self._calls:
            stats.hidden_time = hidden_seconds([(start, end)], last.arrival) if self.overlap else 0.0
        with self._lock:
            self._stats.extend(stats for stats, _, _ in self._calls)
        for bucket in self._pending:
            self._answer(bucket)
        for group in plan.groups:
            group.arrived = 0
        if self.granularity == "bucket" and self._last_bucketing is not None \
                and self._bucketing != self._last_bucketing:
            plan.set_groups(plan.members_of(self._bucket_params))  # DDP rebuilt its buckets
        self._last_bucketing = self._bucketing
        self._pending, self._calls, self._outputs, self._inputs = [], [], {}, {}
        self._overflow.reset()
        self._bucketing, self._bucket_params = [], []

    def _fail(self, exc: BaseException, current: _Bucket) -> None:
        """Fail every bucket DDP is waiting on: those of this iteration handed over so far and
        ``current`` (which may not have reached them), so that backward raises instead of hanging."""
        if self._error is None:  # later buckets fail with the first error, unchanged
            self._error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
        error = self._error
        for bucket in [*self._pending, *self._first, current]:
            if not bucket.future.done():
                bucket.future.set_exception(error)
        self._pending, self._first = [], []

    def raise_if_failed(self, bucket: "_Bucket") -> None:
        """Raise the error that failed ``bucket`` (after the thread finished the iteration, for its
        last bucket), so that ``backward()`` raises the library's own exception: a future failed with
        ``set_exception`` reaches DDP's reducer as "Unable to cast <message> to Tensor"."""
        if self.overlap and bucket.is_last:
            self.wait_idle()
        if bucket.future.done() and self._error is not None:
            raise self._error

    def wait_idle(self) -> None:
        """Block until the communication thread has finished everything handed to it so far."""
        if self._thread is not None:
            done = threading.Event()
            self._thread.submit(done.set)
            done.wait()

    def close(self) -> None:
        """Stop the communication thread (a later bucket starts a new one)."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    # ------------------------------------------------------------------ statistics
    def take_stats(self) -> Stats:
        """Totals over the method calls since the last call: elements ``n``, output non-zeros,
        ``density``, bytes, rounds, seconds per phase, ``dense_calls`` (small-tensor and warm-up
        calls) and ``hidden_time`` (method seconds that ran while backward was still computing);
        then start counting afresh."""
        with self._lock:
            total = Stats.total(self._stats)
            self._stats.clear()
        return total

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.dense_warmup_steps and self.dense_warmup_steps:
                log.info("dense warm-up over after %d iterations: %s starts", self.iter, self.method_name)

    def switch_method(self, method: str, **method_options: Any) -> None:
        """Synchronize with ``method`` (built with ``method_options``) from the next iteration on.

        The groups stay as they are (so a resumed run that switches at the same iteration selects over
        the same elements); each sparse group gets a new method instance, and its residual under the
        old method is flushed: added to the group's next gradient before the new method averages it
        (Shi et al., section 5.6: MSTopK-SGD first, then a dense all-reduce). Call it between
        iterations; it waits for the communication thread.

        Raises:
            ValueError / TypeError: unknown method or option; the state is then unchanged.
        """
        method_class(method)
        nonfinite = check_policy(method_options.pop("nonfinite", self.nonfinite))
        if dist.is_available() and dist.is_initialized():
            make_method(method, self.comm, **method_options, nonfinite=nonfinite)  # probe: validates options
        self.nonfinite = self._overflow.policy = nonfinite
        self.wait_idle()
        if self.plan is None and self._loaded is not None:
            # a loaded state whose groups form on the first bucket: its methods are the old method's
            self._deferred_switch = (method, dict(method_options))
            return
        self._swap_methods(method, method_options)

    def _swap_methods(self, method: str, method_options: dict[str, Any]) -> None:
        self.method_name, self.method_options = method, dict(method_options)
        if self.plan is None:
            return
        for group in self.plan.groups:
            if group.dense:
                continue
            self.carry.put(group.index, group.residual)
            group.method = self._new_method(dense=False)
            group.residual = None
            if group.method.has_residual:
                group.residual = torch.zeros(group.n, dtype=group.dtype, device=group.device)
                group.method.residual = group.residual
        log.info("hook switched to %s at iteration %d (%d residuals carried)", method, self.iter, len(self.carry))

    def residuals(self) -> dict[int, torch.Tensor]:
        """Each parameter's residual (a view, by canonical id: DDP's first-iteration bucket order)."""
        if self.plan is None:
            return {}
        found = {pid: self.plan.residual_of(pid) for pid in range(len(self.plan.numels))}
        return {pid: r for pid, r in found.items() if r is not None}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Iteration counter, options, and the plan: the groups' method states and one residual per
        parameter (by canonical id)."""
        self.wait_idle()
        plan = self.plan.state_dict() if self.plan is not None else self._loaded
        return {"version": _STATE_VERSION, "method": self.method_name, "options": dict(self.method_options),
                "dense_warmup_steps": self.dense_warmup_steps, "granularity": self.granularity,
                "dense_below": self.dense_below, "nonfinite": self.nonfinite, "iter": self.iter, "plan": plan,
                "carry": self.carry.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: residuals are looked up per parameter, method states per
        group (now, or when the groups form on the first bucket)."""
        if state.get("method") != self.method_name:
            raise ValueError(f"state_dict of method {state.get('method')!r} cannot load into a hook "
                             f"state of method {self.method_name!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"hook state_dict version {state.get('version')!r} is not {_STATE_VERSION} "
                             "(per-parameter residuals); it was saved by an older sparsecomm")
        self.wait_idle()
        self.iter = int(state["iter"])
        self.carry.load_state_dict(state.get("carry", {}))
        saved = state["plan"]
        if saved is not None and self.plan is not None:
            self.plan.load_state_dict(saved)
            self._last_bucketing = None  # keep the saved groups until DDP's buckets change
        else:
            self._loaded = saved

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group, communicator and thread (like ``PowerSGDState``)."""
        return {"state": self.state_dict(), "use_layout": self.use_layout, "overlap": self.overlap}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        """Unpickle onto the default process group; set ``process_group`` after loading for another."""
        state = pickled["state"]
        self.process_group = None
        self.method_name = state["method"]
        self.method_options = dict(state["options"])
        self.dense_warmup_steps = state["dense_warmup_steps"]
        self.granularity = state["granularity"]
        self.dense_below = state["dense_below"]
        self.nonfinite = state.get("nonfinite", HOOK_DEFAULT)
        self.use_layout = pickled["use_layout"]
        self.overlap = pickled["overlap"]
        self.carry = ResidualCarry()
        self._reset_runtime()
        self.load_state_dict(state)

    def __repr__(self) -> str:
        groups = 0 if self.plan is None else len(self.plan.groups)
        return (f"SparseHookState(method={self.method_name!r}, options={self.method_options}, "
                f"granularity={self.granularity!r}, overlap={self.overlap}, iter={self.iter}, groups={groups})")


# No ``from __future__ import annotations`` in this module: DDP checks these annotations at runtime.
def hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average gradient over the ranks, by ``state``'s method.

    Register with ``ddp_model.register_comm_hook(state, sparsecomm.hook)``. Returns a future (pending
    while the state's thread works on it) of a tensor shaped like ``bucket.buffer()``.
    """
    future: torch.futures.Future = torch.futures.Future()
    state.comm  # noqa: B018 - the private group is made here, on every rank, before any thread uses it
    item = _Bucket(bucket.index(), bucket.buffer(), list(bucket.parameters()), bucket.is_last(),
                   state.in_warmup, time.perf_counter(), future)
    state.maybe_increase_iter(bucket)
    state.submit(item)
    state.raise_if_failed(item)
    return future
