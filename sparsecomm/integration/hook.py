"""A DDP communication hook that synchronizes each gradient bucket with a sparsecomm method.

One line in an existing DDP script::

    state = sparsecomm.SparseHookState(None, method="spardl", density=0.01)
    ddp_model.register_comm_hook(state, sparsecomm.hook)

The state follows the conventions of torch's ``PowerSGDState``
(``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``): the process group comes first,
per-bucket state is keyed by ``bucket.index()``, the iteration counter advances on the last bucket,
the state pickles without its process group, and the hook returns a ``torch.futures.Future`` of a
tensor shaped like the bucket. The hook's result is what plain DDP's is: the bucket's *average*
gradient over the ranks (the sum divided by the world size; sparsecomm methods return that average).

Each bucket gets its own method instance (so its own residual), built on first use, and is told the
layer layout of the bucket (the ``(offset, numel)`` of each parameter, from ``bucket.gradients()``),
which layer-wise methods use. For the first ``dense_warmup_steps`` iterations the buckets are
all-reduced densely (the dense warm-up of DGC and RedSync).

DDP rebuilds its buckets after the first iteration (by the order gradients became ready); the state
then moves each parameter's residual to its new bucket, so no residual is lost. After
:meth:`SparseHookState.load_state_dict` in a fresh process, the saved buckets' residuals are laid out
again, parameter by parameter in bucket order, on the buckets DDP hands the hook.

Bad options raise at construction (``ValueError`` / ``TypeError`` naming the option), before the
first backward: the state builds a probe instance of the method when the process group is up.
"""

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..core.validate import check_int
from ..methods import Method, Stats, make_method, method_class
from ..transport.comm import Communicator

__all__ = ["SparseHookState", "hook"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


def _layout(numels: list[int]) -> list[tuple[int, int]]:
    """``(offset, numel)`` of consecutive pieces of the given sizes."""
    layout, offset = [], 0
    for numel in numels:
        layout.append((offset, numel))
        offset += numel
    return layout


class SparseHookState:
    """State of :func:`hook`: the method, its per-bucket instances and the iteration counter.

    Args:
        process_group: the group to synchronize over (``None``: the default group), as for DDP.
        method: a name from :func:`sparsecomm.available_methods`.
        dense_warmup_steps: all-reduce densely for this many first iterations (>= 0).
        use_layout: pass each bucket's layer layout to the method (layer-wise methods need it).
        **method_options: passed to :func:`sparsecomm.make_method`, e.g. ``density=0.01``.

    Raises:
        ValueError / TypeError: unknown method, density outside (0, 1], unknown option, bad warm-up.
    """

    _comm: Communicator | None

    def __init__(self, process_group: dist.ProcessGroup | None = None, method: str = "spardl", *,
                 dense_warmup_steps: int = 0, use_layout: bool = True, **method_options: Any) -> None:
        method_class(method)  # unknown name: ValueError listing the available ones
        check_int("dense_warmup_steps", dense_warmup_steps, minimum=0)
        self.process_group = process_group
        self.method_name = method
        self.method_options = dict(method_options)
        self.dense_warmup_steps = dense_warmup_steps
        self.use_layout = bool(use_layout)
        self.iter = 0
        self._reset_runtime()
        if dist.is_available() and dist.is_initialized():
            self._comm = Communicator(process_group)
            make_method(method, self._comm, **self.method_options)  # probe: validates every option
        else:
            log.info("process group not initialized yet: %r options are checked on the first bucket", method)

    def _reset_runtime(self) -> None:
        self._comm = None
        self.methods: dict[int, Method] = {}
        self._param_ids: dict[int, int] = {}                         # data_ptr -> canonical id
        self._layouts: dict[int, tuple[tuple[int, int], ...]] = {}   # bucket -> ((param id, numel), ...)
        self._loose: dict[int, torch.Tensor] = {}                    # param id -> residual awaiting a bucket
        self._loose_step = 0
        self._whole: dict[tuple[tuple[int, int], ...], dict[str, Any]] = {}  # loaded bucket states
        self._whole_methods: dict[tuple[tuple[int, int], ...], Method] = {}  # instances between buckets
        self._unplaced: dict[int, Any] | None = None              # loaded, before the first bucket
        self._dense: Method | None = None
        self._stats: list[Stats] = []

    # ------------------------------------------------------------------ the methods per bucket
    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = Communicator(self.process_group)
        return self._comm

    @property
    def in_warmup(self) -> bool:
        return self.iter < self.dense_warmup_steps

    def _signature(self, bucket: dist.GradBucket) -> tuple[tuple[int, int], ...]:
        """The bucket's parameters as (canonical id, numel), in bucket order. Ids number the
        parameters in the order this state first sees them: on a fresh DDP that is its
        first-iteration bucketing, the same in the run that saved a checkpoint and the run that
        loads it."""
        signature = []
        for param in bucket.parameters():
            pid = self._param_ids.setdefault(param.data_ptr(), len(self._param_ids))
            signature.append((pid, param.numel()))
        return tuple(signature)

    def method_for(self, bucket: dist.GradBucket) -> tuple[Method, tuple[tuple[int, int], ...]]:
        """This bucket's method instance, built (and given its state) on first use, and the
        bucket's parameters (id, numel) in bucket order.

        The method sees the bucket's parameters in canonical (id) order, so when DDP rebuilds a
        bucket that holds the same parameters in another order (a small model's single bucket),
        the method keeps all its state; parameters that change buckets keep their residual.
        """
        index = bucket.index()
        signature = self._signature(bucket)
        canonical = tuple(sorted(signature))
        known = self._layouts.get(index)
        if known is not None and known != canonical:
            log.info("DDP rebuilt its buckets (bucket %d changed); moving residuals parameter by parameter",
                     index)
            self._loosen_all()
        if index not in self.methods:
            self._unplaced = None
            method = self._whole_methods.pop(canonical, None)
            if method is None:
                method = make_method(self.method_name, self.comm, **self.method_options)
                self._give_state(method, index, canonical, bucket.buffer())
            self.methods[index] = method
            self._layouts[index] = canonical
        return self.methods[index], signature

    def _loosen_all(self) -> None:
        """Drop the per-bucket assignment: keep each instance by its parameter set (reused whole if a
        new bucket holds exactly those parameters) and each parameter's residual slice."""
        for index, method in self.methods.items():
            self._loose_step = max(self._loose_step, method.step)
            self._whole_methods[self._layouts[index]] = method
            if method.residual is None:
                continue
            offset = 0
            for pid, numel in self._layouts[index]:
                self._loose[pid] = method.residual[offset:offset + numel].clone()
                offset += numel
        self.methods.clear()
        self._layouts.clear()

    def _give_state(self, method: Method, index: int, signature, buffer: torch.Tensor) -> None:
        if self._whole_methods:
            # A parameter set that no longer exists as a bucket: its instance is gone for good.
            for old in list(self._whole_methods):
                if any(pid in {p for p, _ in signature} for pid, _ in old):
                    del self._whole_methods[old]
        saved = self._whole.pop(signature, None)
        if saved is not None:  # the same bucket as when saved: method-specific state too
            method.load_state_dict(saved)
            for pid, _ in signature:
                self._loose.pop(pid, None)
            return
        if not self._loose:
            return
        method.step = self._loose_step
        pieces = [self._loose.pop(pid, None) for pid, _ in signature]
        if not method.has_residual or all(piece is None for piece in pieces):
            return
        if any(piece is None or piece.numel() != numel for piece, (_, numel) in zip(pieces, signature, strict=False)):
            log.warning("bucket %d: the saved residuals do not fit its parameters; its residual restarts "
                        "at zero", index)
            return
        method.residual = torch.cat([piece for piece in pieces if piece is not None]).to(buffer)

    # ------------------------------------------------------------------ statistics
    @property
    def dense_method(self) -> Method:
        """The ``dense`` method (the backend's all-reduce) used for the dense warm-up."""
        if self._dense is None:
            self._dense = make_method("dense", self.comm)
        return self._dense

    def record(self, stats: Stats) -> None:
        self._stats.append(stats)

    def take_stats(self) -> Stats:
        """Totals over the buckets synchronized since the last call: elements ``n``, output
        non-zeros, ``density``, bytes, rounds and seconds per phase; then start counting afresh."""
        total = Stats.total(self._stats)
        self._stats.clear()
        return total

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.dense_warmup_steps and self.dense_warmup_steps:
                log.info("dense warm-up over after %d iterations: %s starts", self.iter, self.method_name)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Iteration counter and, per bucket, the method's state (residual, step, extra) and the
        (canonical id, numel) of its parameters."""
        buckets = {index: {"params": [list(entry) for entry in self._layouts[index]],
                           "method": method.state_dict()} for index, method in sorted(self.methods.items())}
        if not buckets and self._unplaced is not None:  # loaded and not used yet: save it unchanged
            buckets = self._unplaced
        return {"version": _STATE_VERSION, "method": self.method_name, "options": dict(self.method_options),
                "dense_warmup_steps": self.dense_warmup_steps, "iter": self.iter, "buckets": buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Each bucket DDP hands the hook afterwards gets its saved
        state whole when its parameters are those of a saved bucket, else the saved residuals of its
        parameters, one by one (DDP's bucketing differs between its first and later iterations)."""
        if state.get("method") != self.method_name:
            raise ValueError(f"state_dict of method {state.get('method')!r} cannot load into a hook "
                             f"state of method {self.method_name!r}")
        self.iter = int(state["iter"])
        self.methods.clear()
        self._layouts.clear()
        self._loose, self._whole, self._whole_methods = {}, {}, {}
        self._unplaced = state["buckets"]
        self._loose_step = max((b["method"]["step"] for b in state["buckets"].values()), default=0)
        for saved in state["buckets"].values():
            signature = tuple((int(pid), int(numel)) for pid, numel in saved["params"])
            self._whole[signature] = saved["method"]
            residual, offset = saved["method"]["residual"], 0
            for pid, numel in signature:
                if residual is not None:
                    self._loose[pid] = residual[offset:offset + numel]
                offset += numel

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group and communicator (like ``PowerSGDState``)."""
        return {"state": self.state_dict(), "use_layout": self.use_layout}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        """Unpickle onto the default process group; set ``process_group`` after loading for another."""
        state = pickled["state"]
        self.process_group = None
        self.method_name = state["method"]
        self.method_options = dict(state["options"])
        self.dense_warmup_steps = state["dense_warmup_steps"]
        self.use_layout = pickled["use_layout"]
        self._reset_runtime()
        self.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"SparseHookState(method={self.method_name!r}, options={self.method_options}, "
                f"iter={self.iter}, buckets={sorted(self.methods)})")


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


# No ``from __future__ import annotations`` in this module: DDP checks these annotations at runtime.
def hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average gradient over the ranks, by ``state``'s method.

    Register with ``ddp_model.register_comm_hook(state, sparsecomm.hook)``. The returned future
    holds a tensor shaped like ``bucket.buffer()``.
    """
    buffer = bucket.buffer()
    if state.in_warmup:
        averaged = state.dense_method(buffer)
        state.dense_method.stats.update(warmup=True, dense_calls=1)
        state.record(state.dense_method.stats)
        state.maybe_increase_iter(bucket)
        return _completed(averaged)
    method, signature = state.method_for(bucket)
    grads = bucket.gradients()
    if sum(g.numel() for g in grads) != buffer.numel():
        raise RuntimeError(f"bucket {bucket.index()}: its gradients hold {sum(g.numel() for g in grads)} "
                           f"elements but its buffer {buffer.numel()}; cannot derive the layer layout")
    order = sorted(range(len(signature)), key=lambda i: signature[i][0])
    in_order = order == list(range(len(order)))
    flat = buffer if in_order else torch.cat([grads[i].reshape(-1) for i in order])
    layout = _layout([signature[i][1] for i in order]) if state.use_layout else None
    averaged = method(flat, layout)
    if not in_order:  # back to the bucket's order
        pieces = averaged.split([signature[i][1] for i in order])
        by_position = {i: piece for i, piece in zip(order, pieces, strict=False)}
        averaged = torch.cat([by_position[i] for i in range(len(order))])
    state.record(method.stats)
    state.maybe_increase_iter(bucket)
    return _completed(averaged.view_as(buffer))
