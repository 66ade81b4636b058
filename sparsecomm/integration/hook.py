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
* **Groups** (:mod:`.engine`, the grouping engine the synchronizer shares; :mod:`.residuals`): one
  method call per group and step. ``granularity="bucket"``: one
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
* **The dense all-reduce as DDP's own**: in the dense warm-up, and once the state synchronizes with
  ``"dense"`` (after ``dense_fallback`` fell back, or chosen so), where no residual waits to be
  flushed, the policy is ``"propagate"``, no bucket holds a sparse gradient and the backend takes
  the bucket where it lives (not a CUDA bucket under gloo, which the engine stages through the
  host), each bucket goes straight to the backend's all-reduce from the hook, as torch's
  ``allreduce_hook`` does: no thread, no copy, no agreement round, so such a step is as fast as
  DDP's (cost: the backend's all-reduce of the bucket, about 2 (P - 1)/P n values per rank over
  2 (P - 1) rounds for a ring). Whether an iteration goes so is decided at its first bucket from
  what every rank holds alike (the step count, the method, set at the end of an earlier iteration,
  and the carry, emptied by the iteration before) and kept for the iteration; DDP's first
  iteration, which forms the groups, does not.
* **Non-finite gradients** (:mod:`.nonfinite`): by default (``nonfinite="propagate"``) every rank
  gets NaN when any rank's gradient holds NaN/Inf, with nothing sent and no state moved, so that
  ``torch.amp.GradScaler`` skips the step and lowers its scale as under plain DDP.
* **Sparse gradients** (``nn.Embedding(sparse=True)``): DDP hands them over in buckets of their own;
  they go through the row-sparse reducer (:mod:`.sparse_buckets`), outside the groups.
* **Checkpoints know their world** (:mod:`.world`): a state records the world size and rank it was
  saved in; :meth:`SparseHookState.load_state_dict` is collective, refuses another rank's state or
  damaged residuals with the same error on every rank, and takes every old rank's states (a list) to
  redistribute the residuals into a job of another size, conserving their sum.
* **Resources**: the thread and the private process group are released by
  :meth:`SparseHookState.close` and by garbage collection (a gloo group holds threads and sockets).

Bad options raise at construction (``ValueError`` / ``TypeError`` naming the option), before the
first backward and before the process group exists (the method's spec checks names and values); a
probe instance of the method checks what depends on the ranks when the process group is up. An error
of the hook reaches ``backward()`` as the library's own exception (:meth:`SparseHookState.raise_if_failed`).
"""

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.validate import check_choice, check_int
from ..methods import MethodSpec, Stats
from ..transport.collectives import ring_cost
from ..transport.comm import Communicator
from ..transport.deadline import explain_timeout, is_peer_failure
from .auto import DenseFallback, as_dense_fallback
from .engine import EngineView, GroupingEngine
from .nonfinite import HOOK_DEFAULT
from .overlap import CommThread, PrivateGroup, private_group
from .residuals import ParamPlan, Route
from .sparse_buckets import SparseBuckets
from .world import StateLoadError, World, agree_on_load, live_world

__all__ = ["SparseHookState", "hook", "GRANULARITIES", "DENSE_BELOW"]

log = logging.getLogger(__name__)

#: The values of ``SparseHookState(granularity=...)``.
GRANULARITIES = ("bucket", "model")
#: Default ``dense_below``: 0, every parameter goes to the method (see docs/hook-and-synchronizer.md).
DENSE_BELOW = 0


#: the hook's own options, saved beside the engine's state and matched on load
_HOOK_KEYS = ("dense_warmup_steps", "granularity", "dense_below")


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


class _Resources:
    """What a :class:`SparseHookState` holds outside Python's memory: its communication thread and
    its private process group (a gloo group keeps threads and sockets until it is destroyed).

    Kept apart from the state, and referring to nothing of it but its engine, so that
    :meth:`release` can run from the state's finalizer when the state goes (the state itself is in
    no reference cycle, so that is as soon as the last reference, DDP's, goes)."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.thread: CommThread | None = None
        self.group: PrivateGroup | None = None
        #: the state's engine, whose groups and methods hold the private group
        self.engine: GroupingEngine | None = None
        self.closed = False

    def comm(self) -> Communicator:
        """The communicator over a new private group (made once per state, on every rank)."""
        if self.closed:
            raise RuntimeError("this SparseHookState was closed: make a new one to synchronize again")
        self.group = private_group(self.process_group)
        return Communicator(self.group.group)

    def release(self) -> None:
        """Stop the thread (after the work handed to it), destroy the private group and drop the
        engine's groups and methods (the group's last references: torch frees it then)."""
        self.closed = True
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.close()
        group, self.group = self.group, None
        if group is not None:
            group.release()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.drop()


class SparseHookState(EngineView):
    """State of :func:`hook`: DDP's buckets, the communication thread and the futures, around the
    grouping engine (:class:`~.engine.GroupingEngine`: the method's groups, their per-parameter
    residuals, the iteration counter, warm-up, switches, stats).

    Args:
        process_group: the group to synchronize over (``None``: the default group), as for DDP.
            The state communicates over a private copy of it (same ranks and backend).
        method: a :class:`~sparsecomm.methods.MethodSpec`, or a name from
            :func:`sparsecomm.available_methods` with ``method_options``.
        dense_warmup_steps: all-reduce densely for this many first iterations (>= 0).
        dense_warmup_dtype: the floating dtype the warm-up's all-reduce travels in, the average cast
            back to the gradient's (``torch.bfloat16``: half the bytes, as torch's
            ``bf16_compress_hook``); ``None``: the gradient's own.
        use_layout: pass each group's layer layout to the method (layer-wise methods need it).
        granularity: ``"bucket"`` (one method call per DDP bucket of the first iteration, overlapped
            with backward) or ``"model"`` (one call over the whole model when its last gradient
            arrives).
        overlap: run selection and communication on a thread, behind backward (default), or inside
            the hook (``False``, the synchronous path).
        dense_below: parameters with fewer elements, or whose sparse message would not be smaller
            than the dense one, are all-reduced densely in one fused call; 0: none (sparse methods).
        dense_fallback: time the first dense and sparse iterations and keep the method only if its
            iterations are enough shorter (``True``); otherwise all-reduce densely from then on, so
            the hook is never slower than a dense all-reduce (:mod:`.auto`). A
            :class:`~.auto.DenseFallback` sets the probe, the margin or a pinned decision.
        **method_options: passed to :func:`sparsecomm.make_method`, e.g. ``density=0.01``, and
            ``nonfinite``: when any rank's gradient holds NaN/Inf, ``"propagate"`` (default: NaN on
            every rank, nothing sent, state untouched, so ``GradScaler`` skips the step as under plain
            DDP), ``"skip"`` (zeros) or ``"error"`` (raise); for every group, dense ones and the
            warm-up included (:mod:`.nonfinite`).

    Raises:
        ValueError / TypeError: unknown method, density outside (0, 1], unknown option, bad warm-up,
            granularity or dense_below.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, method: MethodSpec | str = "spardl", *,
                 dense_warmup_steps: int = 0, dense_warmup_dtype: torch.dtype | None = None,
                 use_layout: bool = True, granularity: str = "bucket",
                 overlap: bool = True, dense_below: int = DENSE_BELOW,
                 dense_fallback: bool | DenseFallback | None = False,
                 **method_options: Any) -> None:
        spec = MethodSpec.of(method, method_options)  # unknown name or option, bad density: raises here
        check_int("dense_warmup_steps", dense_warmup_steps, minimum=0)
        check_choice("granularity", granularity, GRANULARITIES)
        check_int("dense_below", dense_below, minimum=0)
        self.overlap = bool(overlap)
        resources = _Resources(process_group)
        self._start(resources, GroupingEngine(
            spec, resources.comm, granularity=granularity, dense_warmup_steps=dense_warmup_steps,
            dense_below=dense_below, use_layout=use_layout, nonfinite_default=HOOK_DEFAULT,
            dense_fallback=as_dense_fallback(dense_fallback), warmup_dtype=dense_warmup_dtype))
        if dist.is_available() and dist.is_initialized():
            spec.build(Communicator(process_group))  # probe: checks the values of the options
            self.engine.comm  # noqa: B018 - the private group, made now on every rank
        else:
            log.info("process group not initialized yet: %r options are checked on the first bucket", spec.name)

    def _start(self, resources: _Resources, engine: GroupingEngine) -> None:
        """Take ``engine`` and ``resources``; these are released by :meth:`close` or by garbage
        collection (a finalizer: the state has no reference cycle)."""
        self._resources = resources
        self.engine = resources.engine = engine
        self._reset_runtime()
        finalizer = weakref.finalize(self, resources.release)
        finalizer.atexit = False  # at exit the process's groups go with it

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the state synchronizes over (``None``: the default group)."""
        return self._resources.process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        if self.engine._comm is not None:
            raise RuntimeError("the process group of a SparseHookState is set before its first bucket")
        self._resources.process_group = group

    def _reset_runtime(self) -> None:
        self._first: list[_Bucket] = []              # first-iteration buckets, until the groups exist
        self._pending: list[_Bucket] = []            # this iteration's buckets not yet answered
        self._inputs: dict[int, torch.Tensor] = {}   # group -> its gradient this iteration
        self._outputs: dict[int, torch.Tensor] = {}  # group -> its averaged gradient this iteration
        self._bucketing: list[tuple[int, ...]] = []   # this iteration's buckets (parameter data_ptrs)
        self._last_bucketing: list[tuple[int, ...]] | None = None
        self._bucket_params: list[list[torch.Tensor]] = []
        self._error: Exception | None = None        # the first failure; every later bucket fails with it
        self._native = False                         # this iteration's buckets go to the backend directly
        engine = self.engine  # (not ``self``: the state keeps no reference cycle, see _Resources)
        self._sparse = SparseBuckets(lambda: engine.comm)  # buckets of sparse gradients, outside the groups

    # ------------------------------------------------------------------ setup
    @property
    def comm(self) -> Communicator:
        """The communicator of the state's private process group."""
        return self.engine.comm

    @property
    def plan(self) -> ParamPlan | None:
        """The groups (``None`` until DDP's first iteration has handed over every bucket)."""
        return self.engine.plan

    @property
    def iter(self) -> int:
        return self.engine.iter

    @iter.setter
    def iter(self, value: int) -> None:
        self.engine.iter = value

    @property
    def granularity(self) -> str:
        return self.engine.granularity

    @property
    def dense_below(self) -> int:
        return self.engine.dense_below

    @property
    def use_layout(self) -> bool:
        return self.engine.use_layout

    # ------------------------------------------------------------------ the dense all-reduce as DDP's
    def goes_native(self, bucket: dist.GradBucket) -> bool:
        """Whether this iteration's buckets go straight to the backend's all-reduce (the module
        docstring: the state synchronizes densely, nothing is carried, the ``"propagate"`` policy, no
        sparse-gradient bucket). Decided at the iteration's first bucket, kept for the others."""
        if bucket.index() == 0:
            engine = self.engine
            self._native = (engine.plan is not None and self._error is None
                            and (engine.in_warmup or engine.spec.name == "dense")
                            and not len(engine.carry) and engine.nonfinite == "propagate"
                            and not self._sparse.seen and not self._first
                            and self.comm.takes_as_is(bucket.buffer()))
        return self._native

    def native_all_reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's average by the backend's all-reduce over the state's private group, summed
        then divided by P as the ``dense`` method does (so an iteration gives the same bits by either
        path); its call is counted in the stats (the ring formula's bytes, as ``dense`` books them).
        A warm-up in ``dense_warmup_dtype`` all-reduces a cast copy and casts the average back, as the
        engine's warm-up does."""
        engine, comm, buffer = self.engine, self.comm, bucket.buffer()
        size = comm.size
        low = engine.warmup_dtype if engine.in_warmup and engine.warmup_dtype not in (None, buffer.dtype) else None
        sent = buffer if low is None else buffer.to(low)
        # cost: 2 (P - 1) / P x n x itemsize bytes sent per rank, in 2 (P - 1) rounds (the ring)
        modelled = ring_cost(P=comm.size, n=sent.numel(), rank=comm.rank, itemsize=sent.element_size())
        engine.record_stats(Stats(n=buffer.numel(), selected=buffer.numel(), nnz_out=buffer.numel(),
                                  bytes_sent=modelled.bytes_sent, bytes_recv=modelled.bytes_recv, rounds=1,
                                  dense_calls=1, modelled_bytes=True, warmup=engine.in_warmup))
        work = dist.all_reduce(sent, group=comm.group, async_op=True)
        self._note_bucket(list(bucket.parameters()))
        self.maybe_increase_iter(bucket)
        if bucket.is_last():
            self._end_bucketing()  # (the communication thread is idle: its last iteration was waited for)
            engine.end_native_step()
        members = comm.ranks

        def average(fut: torch.futures.Future) -> torch.Tensor:
            try:
                average = fut.value()[0].div_(size)
                return average if low is None else buffer.copy_(average)
            except RuntimeError as exc:  # a timed-out peer: named on every waiting rank, as a method call does
                if is_peer_failure(exc):
                    raise explain_timeout(exc, members) from exc
                raise

        return work.get_future().then(average)

    # ------------------------------------------------------------------ the work of one bucket
    def submit(self, bucket: _Bucket) -> None:
        """Process ``bucket`` on the communication thread (``overlap``) or right here."""
        resources = self._resources
        if resources.closed:
            raise RuntimeError("this SparseHookState was closed: make a new one to synchronize again")
        if not self.overlap:
            self._process(bucket)
            return
        if resources.thread is None:
            resources.thread = CommThread()
        resources.thread.submit(self._process, bucket)

    def _process(self, bucket: _Bucket) -> None:
        try:
            if self._error is not None:
                raise self._error
            todo: list[_Bucket] = []
            if bucket.buffer.is_sparse:  # a bucket of its own, outside the groups (:mod:`.sparse_buckets`)
                self._reduce_sparse(bucket)
                if bucket.is_last and self.plan is None and self._first:
                    self.engine.build([b.params for b in self._first])
                    todo, self._first = self._first, []
            elif self.plan is None:  # DDP's first iteration: the groups exist once every bucket is seen
                self._first.append(bucket)
                if not bucket.is_last:
                    return
                self.engine.build([b.params for b in self._first])
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
        self.engine.record_stats(stats)
        bucket.future.set_result(result)

    def _step(self, bucket: _Bucket) -> None:
        plan = self.plan
        assert plan is not None
        bucket.route = route = plan.route(bucket.index, bucket.params, bucket.buffer.numel())
        self._pending.append(bucket)
        self._note_bucket(bucket.params)
        if bucket.warmup:
            bucket.result = self.engine.warmup_reduce(bucket.buffer)
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
                self._outputs[gi] = self.engine.reduce(group, group.inbuf() if grad is None else grad)

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
        self.engine.end_step(last.arrival if self.overlap else None)
        for bucket in self._pending:
            self._answer(bucket)
        for group in plan.groups:
            group.arrived = 0
        self._end_bucketing()
        self._pending, self._outputs, self._inputs = [], {}, {}

    def _note_bucket(self, params: list[torch.Tensor]) -> None:
        """Record a bucket of this iteration (its parameters), for :meth:`_end_bucketing`."""
        self._bucketing.append(tuple(p.data_ptr() for p in params))
        self._bucket_params.append(params)

    def _end_bucketing(self) -> None:
        """At an iteration's end: where DDP rebuilt its buckets since the last iteration, form the
        groups on the new ones (``granularity="bucket"``), on either path, so that the groups a method
        step sees do not depend on which path the iterations before it took."""
        if self.granularity == "bucket" and self._last_bucketing is not None \
                and self._bucketing != self._last_bucketing:
            self.engine.regroup(self._bucket_params)  # DDP rebuilt its buckets
        self._last_bucketing = self._bucketing
        self._bucketing, self._bucket_params = [], []

    def _fail(self, exc: BaseException, current: _Bucket) -> None:
        """Fail every bucket DDP is waiting on: those of this iteration handed over so far and
        ``current`` (which may not have reached them), so that backward raises instead of hanging.
        The first failure stays: every later bucket fails with it, unchanged."""
        if self._error is None:
            self._error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
        error = self._error
        for bucket in [*self._pending, *self._first, current]:
            if not bucket.future.done():
                bucket.future.set_exception(error)
        self._pending, self._first = [], []

    def raise_if_failed(self, bucket: _Bucket) -> None:
        """Raise the error that failed ``bucket`` (for DDP's last bucket, once the thread has finished
        the iteration), so that ``backward()`` raises the library's own exception: a future failed
        with ``set_exception`` reaches DDP's reducer as "Unable to cast <message> to Tensor"."""
        if self.overlap and bucket.is_last:
            self.wait_idle()
        if bucket.future.done() and self._error is not None:
            raise self._error

    def wait_idle(self) -> None:
        """Block until the communication thread has finished everything handed to it so far."""
        thread = self._resources.thread
        if thread is not None:
            done = threading.Event()
            thread.submit(done.set)
            done.wait()

    def close(self) -> None:
        """Release what the state holds outside Python's memory: stop its communication thread (after
        the work handed to it) and destroy its private process group, so that states made one after
        another (a sweep, a notebook) leave no thread or socket behind. Garbage collection of the
        state does the same. The state cannot synchronize afterwards; its ``state_dict``, residuals
        and stats stay readable. Over a subgroup of the job the private group stays until the job's
        group is destroyed (:class:`~.overlap.PrivateGroup`)."""
        self.wait_idle()
        # the methods and communicators refer to the group: the state keeps its state without them
        detached = self.engine.detach(self._resources.comm)
        self._resources.release()
        self.engine = detached
        self._reset_runtime()

    # ------------------------------------------------------------------ statistics
    def take_stats(self) -> Stats:
        """Totals over the method calls since the last call: elements ``n``, output non-zeros,
        ``density``, bytes, rounds, seconds per phase, ``dense_calls`` (small-tensor and warm-up
        calls) and ``hidden_time`` (method seconds that ran while backward was still computing);
        then start counting afresh."""
        return self.engine.take_stats()

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.dense_warmup_steps and self.dense_warmup_steps:
                log.info("dense warm-up over after %d iterations: %s starts", self.iter, self.spec.label())

    def switch_method(self, method: MethodSpec | str, **method_options: Any) -> None:
        """Synchronize with ``method`` (a spec, or a name built with ``method_options``) from the next
        iteration on.

        The groups stay as they are (so a resumed run that switches at the same iteration selects over
        the same elements); each sparse group gets a new method instance, and its residual under the
        old method is flushed: added to the group's next gradient before the new method averages it
        (Shi et al., section 5.6: MSTopK-SGD first, then a dense all-reduce). Call it between
        iterations; it waits for the communication thread.

        Raises:
            ValueError / TypeError: unknown method or option; the state is then unchanged.
        """
        spec = MethodSpec.of(method, method_options)
        if dist.is_available() and dist.is_initialized():
            spec.build(self.comm)  # probe: checks the values of the options
        self.wait_idle()
        self.engine.switch_method(spec)

    def residuals(self) -> dict[int, torch.Tensor]:
        """Each parameter's residual (a view, by canonical id: DDP's first-iteration bucket order)."""
        return self.engine.residuals()

    # ------------------------------------------------------------------ checkpoints
    def _world(self) -> World | None:
        return live_world(self.process_group)

    def state_dict(self) -> dict[str, Any]:
        """The state of this rank, recording its world: iteration counter, method and options, the
        world it was saved in (world size and this rank), the plan (parameter layout, the groups'
        method states, one residual per parameter by canonical id), carried residuals, and the hook's
        options. Save one per rank (each rank's residuals are its own share of the gradient)."""
        self.wait_idle()
        return {**self.engine.state_dict(self._world()), "dense_warmup_steps": self.dense_warmup_steps,
                "granularity": self.granularity, "dense_below": self.dense_below}

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`: this rank's own state, or every rank's of the job that saved them
        (a list, in any order), which a job of another size needs.

        Collective (call it on every rank): each rank checks what it loads against the live job:
        method and options, the hook's options, the world (its own rank's state; another rank's is an
        error naming both), the parameter layout, and every residual's shape, dtype and finiteness;
        then every rank raises the same :class:`~sparsecomm.integration.world.StateLoadError` if any
        rank found a problem. From a job of another size, this rank takes the residuals of the old
        ranks ``q`` with ``q % P == rank`` (their sum over ranks is conserved) and the methods'
        adaptive state starts afresh (a warning says so). Residuals are looked up per parameter,
        method states per group (now, or when the groups form on the first bucket)."""
        self._load(state, collective=True)

    def _load(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]], collective: bool) -> None:
        self.wait_idle()
        world = self._world()
        loaded, problem = self.engine.prepare_load(state, "hook", world, same=_HOOK_KEYS)
        if loaded is not None:
            mine = {key: getattr(self, key) for key in _HOOK_KEYS}
            saved = {key: loaded.state.get(key) for key in _HOOK_KEYS}
            if saved != mine:
                key = next(k for k in _HOOK_KEYS if saved[k] != mine[k])
                problem = f"it was saved with {key}={saved[key]!r}, this SparseHookState has {mine[key]!r}"
        if collective:
            agree_on_load(problem, self.process_group, "hook")
        elif problem is not None:
            raise StateLoadError(f"cannot load the hook state: {problem}")
        assert loaded is not None
        self.engine.load(loaded, "hook", world)
        self._last_bucketing = None  # keep the saved groups until DDP's buckets change

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group, communicator and thread (like ``PowerSGDState``); the
        ``dense_fallback`` settings go with its decision (in the state), so the copy keeps measuring
        or keeps what it decided."""
        fallback = self.engine.dense_fallback
        settings = None if fallback is None else {"probe": fallback.probe, "skip": fallback.skip,
                                                  "margin": fallback.margin, "pinned": fallback.pinned}
        return {"state": self.state_dict(), "use_layout": self.use_layout, "overlap": self.overlap,
                "dense_warmup_dtype": self.engine.warmup_dtype, "dense_fallback": settings}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        """Unpickle onto the default process group; set ``process_group`` after loading for another.
        The saved world is checked (locally) against the live one when the private group is made."""
        state = pickled["state"]
        self.overlap = pickled["overlap"]
        resources = _Resources(None)
        self._start(resources, GroupingEngine(MethodSpec(state["method"], state["options"]), resources.comm,
                                              granularity=state["granularity"],
                                              dense_warmup_steps=state["dense_warmup_steps"],
                                              dense_below=state["dense_below"], use_layout=pickled["use_layout"],
                                              nonfinite_default=state["nonfinite"],
                                              warmup_dtype=pickled["dense_warmup_dtype"],
                                              dense_fallback=None if pickled["dense_fallback"] is None
                                              else DenseFallback(**pickled["dense_fallback"])))
        self._load(state, collective=False)

    def __repr__(self) -> str:
        groups = 0 if self.plan is None else len(self.plan.groups)
        return (f"SparseHookState(method={self.spec.name!r}, options={self.method_options}, "
                f"nonfinite={self.nonfinite!r}, granularity={self.granularity!r}, overlap={self.overlap}, "
                f"iter={self.iter}, groups={groups})")


# No ``from __future__ import annotations`` in this module: DDP checks these annotations at runtime.
def hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average gradient over the ranks, by ``state``'s method.

    Register with ``ddp_model.register_comm_hook(state, sparsecomm.hook)``. Returns a future (pending
    while the state's thread works on it) of a tensor shaped like ``bucket.buffer()``.
    """
    if state.goes_native(bucket):
        return state.native_all_reduce(bucket)
    future: torch.futures.Future = torch.futures.Future()
    state.comm  # noqa: B018 - the private group is made here, on every rank, before any thread uses it
    item = _Bucket(bucket.index(), bucket.buffer(), list(bucket.parameters()), bucket.is_last(),
                   state.in_warmup, time.perf_counter(), future)
    state.maybe_increase_iter(bucket)
    state.submit(item)
    state.raise_if_failed(item)
    return future
