"""Sparse synchronization of the replica dimension of hybrid sharded training (FSDP2/HSDP).

Hybrid sharding (HSDP; Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", Proceedings of the VLDB Endowment 16(12), 2023) arranges the ranks as ``replicas x
shards``: within a replica (one node, fast links) the parameters, gradients and optimizer state are
sharded as in FSDP; across replicas (the slow link) each shard's gradient is all-reduced. That
all-reduce moves the whole model once per step over the slowest link, which is where a sparse
method pays. One call after ``fully_shard``::

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])          # FSDP2 within the replica: the 1-D shard mesh
    fully_shard(model, mesh=mesh["shard"])
    replicas = sparsecomm.sparse_replicas(model, mesh, method="topka", density=0.01)   # <- added

Then train as usual (AdamW, ``clip_grad_norm_`` on the DTensor parameters, mixed precision);
checkpoint ``replicas.state_dict()`` per rank beside the model and optimizer (docs/hsdp.md).

Design, from what FSDP2 does (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``,
``foreach_reduce``):

* **Where.** After backward, each FSDP parameter group reduce-scatters its gradients over the shard
  group into one new flat tensor (``reduce_output``: this rank's padded shard of every parameter of
  the group, in the group's parameter order, already averaged over the shard group), and calls the
  module's all-reduce hook (``FSDPModule.set_all_reduce_hook``) on it, in place, before it becomes the
  sharded ``.grad`` views. Under *native* HSDP (``fully_shard`` on a 2-D mesh) FSDP all-reduces that
  tensor over the replicate group first and calls the hook after it: a hook cannot replace the
  replica all-reduce. So each replica runs plain FSDP2 on its 1-D shard mesh (``mesh["shard"]``) and
  the hook does the replica reduction: the sparse method, over the replicate group of this rank's
  shard (``mesh``'s dimension 0). :func:`sparse_replicas` refuses a model sharded on a 2-D mesh.
* **What the hook gets.** A fresh tensor every step (FSDP allocates each reduce-scatter's output
  anew and the gradients view it), so it cannot be the method's reused ``out=`` tensor: the method
  writes into its group's own output tensor and the hook copies the result back. Its dtype is the
  mixed precision policy's ``reduce_dtype`` (else ``param_dtype``, else the parameters'). The method,
  its residual and its result are in the parameters' dtype promoted to at least float32: a bf16
  reduce-scatter output is upcast before the replica reduction, whose error feedback would lose the
  small entries it accumulates in bf16, and the average is rounded back once, as FSDP's own cast
  does. Set ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` to reduce-scatter in fp32 as well.
* **One group per FSDP parameter group** (:class:`~.engine.GroupingEngine`, the residual handling of
  the DDP hook and the synchronizer): each FSDP module's flat shard is one method call per step, its
  residual one flat tensor of the shard's size (the residual belongs to this rank's shard, and
  conservation holds over the replica group), its layer layout the parameters' padded shards. The
  groups are fixed when :func:`sparse_replicas` is called, so a checkpoint loads by lookup.
* **Steps.** The hooks of one backward run in the same order on every replica (the same model), so
  the ranks of a replicate group issue the same collectives in the same order; the step ends in an
  autograd callback queued by the hooks (after FSDP's own final callback), which advances the step
  counter (the dense warm-up) and closes the step's stats. Gradient accumulation uses FSDP's
  ``set_requires_gradient_sync(False)``: no reduce-scatter, no hook, nothing sent.
* **Synchronous.** FSDP views the hook's tensor as the sharded gradients as soon as the hook returns,
  so the reduction completes inside the hook, in backward's thread (as the DDP hook's
  ``overlap=False`` path), before backward goes on to the next FSDP module; on the CPU native HSDP's
  gloo all-reduce blocks there too.
* **Density 1** averages what native HSDP averages (the reduce-scatter's average within the replica,
  then the average over the replicas), to float tolerance: the method sums the replicas' values in
  its own order (with two replicas the sum is one addition either way, and the results are
  bit-identical). A ``gradient_divide_factor`` set on the modules applies within the replica; the
  replica dimension is always averaged.
* **Non-finite gradients** (:mod:`.nonfinite`): ``"propagate"`` by default, as FSDP's own all-reduce
  would (every replica of the shard gets NaN, nothing sent, no state moved).

Every parameter that requires a gradient must get one in every synchronizing backward (or set
``module.set_reduce_scatter_unused_params(True)``): FSDP leaves a parameter without gradient out of
the reduce-scatter, and the group's flat shard would change size (a clear error says so).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.validate import check_int
from ..methods import MethodSpec, Stats
from ..transport.comm import Communicator
from ..transport.control import max_all_reduce
from .engine import EngineView, GroupingEngine
from .nonfinite import HOOK_DEFAULT
from .world import live_world

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = ["SparseReplicaState", "sparse_replicas"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class _ShardGroup:
    """One FSDP parameter group as the replica synchronization sees it: the module's name, its
    trainable parameters' padded shard sizes (in the reduce-scatter's order), the dtype the method
    computes in and the device of the reduce-scatter output."""

    def __init__(self, name: str, module: FSDPModule, fsdp_params: list[Any], device: torch.device) -> None:
        self.name = name
        self.module = module
        # a parameter's padded shard is empty only when the parameter is: it adds nothing to the flat shard
        trainable = [p for p in fsdp_params
                     if p.sharded_param.requires_grad and torch.Size(p.padded_sharded_param_size).numel() > 0]
        self.numels = [int(torch.Size(p.padded_sharded_param_size).numel()) for p in trainable]
        dtypes = {p.sharded_param.dtype for p in trainable}
        if len(dtypes) > 1 or not all(dtype.is_floating_point for dtype in dtypes):
            raise ValueError(f"sparse_replicas: FSDP module {name!r} holds trainable parameters of dtypes "
                             f"{sorted(map(str, dtypes))}; it needs one floating-point dtype")
        self.dtype = torch.promote_types(dtypes.pop(), torch.float32) if dtypes else torch.float32
        self.device = device  # FSDP's compute device, where the reduce-scatter output lives

    @property
    def n(self) -> int:
        return sum(self.numels)


class SparseReplicaState(EngineView):
    """The sparse synchronization of an FSDP2 model's replicas, made by :func:`sparse_replicas`.

    It holds the grouping engine (:class:`~.engine.GroupingEngine`): one method instance and one
    residual per FSDP parameter group of this rank's shard, the step counter, the dense warm-up and
    the stats. Read-only views (``spec``, ``nonfinite``, ``in_warmup``, ...) come from
    :class:`~.engine.EngineView`.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, spec: MethodSpec, *, dense_warmup_steps: int,
                 use_layout: bool) -> None:
        self.model = model
        self.mesh = mesh
        self.replica_group: dist.ProcessGroup = mesh.get_group(0)
        self.shard_group: dist.ProcessGroup = mesh.get_group(1)
        self.replicas = dist.get_world_size(self.replica_group)
        self.shards = dist.get_world_size(self.shard_group)
        self.replica_rank = dist.get_rank(self.replica_group)
        self.shard_rank = dist.get_rank(self.shard_group)
        self.engine = GroupingEngine(spec, lambda: Communicator(self.replica_group), granularity="bucket",
                                     dense_warmup_steps=dense_warmup_steps, dense_below=0,
                                     use_layout=use_layout, nonfinite_default=HOOK_DEFAULT)
        self.shard_groups = _fsdp_groups(model, self.shard_group)
        self.engine.build(_numbering_units(self.shard_groups))
        assert len(self.engine.groups) == len(self.shard_groups)  # one engine group per FSDP group, in order
        #: the stats of the last synchronized step (totals over its groups)
        self.last_stats = Stats()
        self._step_open = False
        self._world_comm: Communicator | None = None
        for index, shard_group in enumerate(self.shard_groups):
            shard_group.module.set_all_reduce_hook(self._hook_of(index))

    # ------------------------------------------------------------------ the hook
    def _hook_of(self, index: int) -> Any:
        def all_reduce_hook(reduce_output: torch.Tensor) -> None:
            self._reduce(index, reduce_output)
        return all_reduce_hook

    def _reduce(self, index: int, reduce_output: torch.Tensor) -> None:
        """Average FSDP group ``index``'s reduce-scatter output over the replicas, in place."""
        shard_group, group = self.shard_groups[index], self.engine.groups[index]
        if reduce_output.numel() != group.n:
            raise RuntimeError(
                f"sparse_replicas: FSDP module {shard_group.name!r} reduce-scattered {reduce_output.numel()} "
                f"elements, but the padded shards of its trainable parameters hold {group.n}: a parameter got "
                "no gradient in this backward (call set_reduce_scatter_unused_params(True) on the module), or "
                "requires_grad changed after sparse_replicas()")
        self._step_open = True
        # queued by every hook of the step (an end after the first does nothing): the callbacks of a
        # backward that failed never run, and the next backward's hooks queue them again
        torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
        grad = reduce_output
        if grad.dtype != group.dtype or grad.device != group.device:
            grad = group.inbuf()
            grad.copy_(reduce_output)
        warmup = self.engine.in_warmup
        result = self.engine.reduce(group, grad, warmup=warmup, **({"dense_calls": 1} if warmup else {}))
        reduce_output.copy_(result)

    def _end_step(self) -> None:
        if not self._step_open:
            return
        self._step_open = False
        self.engine.iter += 1
        if self.engine.iter == self.dense_warmup_steps and self.dense_warmup_steps:
            log.info("dense warm-up over after %d steps: %s starts", self.engine.iter, self.spec.label())
        self.last_stats = self.engine.end_step()

    # ------------------------------------------------------------------ what it holds
    @property
    def iter(self) -> int:
        """Synchronized steps so far."""
        return self.engine.iter

    def residuals(self) -> dict[str, torch.Tensor]:
        """Each FSDP module's residual (its flat shard's, the live tensor), by module name
        (``""`` for the root); empty for a method without residual."""
        pairs = zip(self.shard_groups, self.engine.groups, strict=True)
        return {shard.name: group.residual for shard, group in pairs if group.residual is not None}

    def take_stats(self) -> Stats:
        """Totals over the method calls since the last call (bytes, rounds, seconds per phase, ...);
        then start counting afresh."""
        return self.engine.take_stats()

    def set_density(self, density: float) -> None:
        """Select this density from the next step on (every replica must set the same, between steps)."""
        self.engine.set_density(density)

    # ------------------------------------------------------------------ checkpoints
    def _world(self) -> dict[str, Any]:
        return {"world_size": dist.get_world_size(), "rank": dist.get_rank(), "replicas": self.replicas,
                "shards": self.shards, "replica_rank": self.replica_rank, "shard_rank": self.shard_rank,
                "layout": {g.name: list(g.numels) for g in self.shard_groups}}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the world it was saved in, the method and its options, the step counter,
        each group's method state and residual. Save one per rank (``torch.save``) beside the model and
        optimizer (``torch.distributed.checkpoint``); the tensors are copies."""
        return {"version": _STATE_VERSION, **self.engine.state_dict(live_world()), "replica_world": self._world()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by this rank of the same layout. Collective: every rank
        calls it (between steps), and every rank raises the same error when any rank's state was saved
        in another world (world size, rank, replicas x shards, the FSDP groups' shards), by another
        method, or at another step than the other ranks'."""
        problem = self._load_problem(state)
        loaded = None
        if problem is None:
            loaded, problem = self.engine.prepare_load(state, "sparse replica state", live_world())
        steps = int(state.get("iter", -1)) if problem is None else -1
        if self._world_comm is None:
            self._world_comm = Communicator(None)
        worst, latest, neg_earliest = max_all_reduce(self._world_comm, [int(problem is not None), steps, -steps],
                                                     device=self.shard_groups[0].device)
        if problem is not None:
            raise ValueError(f"sparse_replicas: cannot load this rank's state: {problem}")
        if worst:
            raise ValueError("sparse_replicas: another rank cannot load its state (it says why); nothing loaded")
        if latest != -neg_earliest:
            raise ValueError(f"sparse_replicas: the ranks' states were saved at different steps ({-neg_earliest} "
                             f"to {latest}); load states of one checkpoint")
        assert loaded is not None
        self.engine.load(loaded, "sparse replica state", live_world())

    def _load_problem(self, state: Any) -> str | None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            version = state.get("version") if isinstance(state, dict) else type(state).__name__
            return f"its version is {version!r}, not {_STATE_VERSION}"
        if state.get("method") != self.spec.name:
            return f"it was saved by method {state.get('method')!r}, this state runs {self.spec.name!r}"
        saved, mine = state.get("replica_world", {}), self._world()
        for key in mine:
            if saved.get(key) != mine[key]:
                return f"it was saved with {key}={saved.get(key)!r}, this rank has {key}={mine[key]!r}"
        return None

    def __repr__(self) -> str:
        return (f"SparseReplicaState(method={self.spec.name!r}, options={self.method_options}, "
                f"replicas={self.replicas}, shards={self.shards}, groups={len(self.shard_groups)}, "
                f"iter={self.iter})")


def sparse_replicas(model: nn.Module, mesh: DeviceMesh, method: MethodSpec | str = "spardl", *,
                    dense_warmup_steps: int = 0, use_layout: bool = True,
                    **method_options: Any) -> SparseReplicaState:
    """Synchronize the replicas of an FSDP2 model with a sparse method: HSDP with a sparse replica
    dimension. Call it once, after ``fully_shard``, on every rank.

    Args:
        model: the model after ``fully_shard``: every FSDP module sharded over the 1-D mesh
            ``mesh[1]`` (``mesh["shard"]``), i.e. plain FSDP2 within each replica.
        mesh: the 2-D ``DeviceMesh`` (replicate, shard), as for native HSDP: dimension 0 runs across
            replicas (the slow link), dimension 1 within a replica.
        method: a :class:`~sparsecomm.methods.MethodSpec`, or a name of
            :func:`sparsecomm.available_methods` with ``method_options`` (``density=0.01``, ...).
        dense_warmup_steps: average densely over the replicas for this many first steps.
        use_layout: pass each group's layer layout (its parameters' padded shards) to the method.
        **method_options: passed to the method, and ``nonfinite`` (``"propagate"``, the default:
            NaN on every replica of a shard whose gradient holds NaN/Inf, nothing sent; ``"skip"``;
            ``"error"``).

    Returns:
        The :class:`SparseReplicaState`: ``state_dict()`` / ``load_state_dict()``, ``take_stats()``,
        ``residuals()``.

    Raises:
        ValueError / TypeError: an unknown method or option, a mesh that is not 2-D, a model without
            FSDP modules, sharded over a 2-D mesh (native HSDP) or over other ranks than ``mesh[1]``,
            a module whose all-reduce hook is already set.
    """
    spec = MethodSpec.of(method, method_options)  # unknown name or option, bad density: raises here
    check_int("dense_warmup_steps", dense_warmup_steps, minimum=0)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sparse_replicas needs an initialized torch.distributed process group (the one "
                           "fully_shard runs on)")
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"sparse_replicas: mesh must be a 2-D DeviceMesh (replicate, shard), got "
                         f"{'ndim=' + str(mesh.ndim) if hasattr(mesh, 'ndim') else type(mesh).__name__}")
    spec.build(Communicator(mesh.get_group(0)))  # probe: checks the values of the options on the replica group
    return SparseReplicaState(model, mesh, spec, dense_warmup_steps=dense_warmup_steps, use_layout=use_layout)


def _fsdp_groups(model: nn.Module, shard_group: dist.ProcessGroup) -> list[_ShardGroup]:
    """The FSDP parameter groups of ``model`` with trainable parameters, in module order, checked."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_all_reduce_hook"):
        raise RuntimeError(f"sparse_replicas needs FSDP2's FSDPModule.set_all_reduce_hook, which torch "
                           f"{torch.__version__} lacks")
    shard_ranks = dist.get_process_group_ranks(shard_group)
    groups: list[_ShardGroup] = []
    modules: list[tuple[str, FSDPModule]] = [(name, module) for name, module in model.named_modules()
                                             if isinstance(module, FSDPModule)]
    if not modules:
        raise ValueError("sparse_replicas: the model has no FSDP module; call fully_shard(module, "
                         "mesh=mesh['shard']) on its blocks and on the model first")
    for name, module in modules:
        # FSDP2's parameter group of the module (private: the layout of the flat shard the hook receives)
        try:
            fsdp_group: Any = module._get_fsdp_state()._fsdp_param_group
        except AssertionError as exc:  # several groups: a per-parameter mesh (shard_placement_fn)
            raise ValueError(f"sparse_replicas: FSDP module {name!r} has several parameter groups (a "
                             "per-parameter mesh); the all-reduce hook needs one") from exc
        if fsdp_group is None:  # a module without parameters of its own
            continue
        if fsdp_group._is_hsdp:
            raise ValueError(f"sparse_replicas: FSDP module {name!r} was sharded on a 2-D mesh (native HSDP), "
                             "whose replica all-reduce runs before any hook; shard on the 1-D "
                             "mesh['shard'] and let sparse_replicas reduce across the replicas")
        ranks = dist.get_process_group_ranks(fsdp_group.mesh_info.shard_process_group)
        if ranks != shard_ranks:
            raise ValueError(f"sparse_replicas: FSDP module {name!r} is sharded over ranks {ranks}, but this "
                             f"rank's shard dimension of the mesh holds {shard_ranks}")
        if fsdp_group._all_reduce_hook is not None:
            raise ValueError(f"sparse_replicas: FSDP module {name!r} already has an all-reduce hook "
                             "(was sparse_replicas called twice?)")
        shard = _ShardGroup(name, module, fsdp_group.fsdp_params, fsdp_group.device)
        if shard.numels:
            groups.append(shard)
    if not groups:
        raise ValueError("sparse_replicas: the model's FSDP modules hold no trainable parameter")
    return groups


def _numbering_units(groups: list[_ShardGroup]) -> list[list[torch.Tensor]]:
    """Tensors that stand for each group's parameter shards when the engine numbers them (it keys
    parameters by storage address and reads their size, dtype and device): views of one transient
    buffer per group, which nothing writes."""
    units = []
    for group in groups:
        buffer = torch.empty(group.n, dtype=group.dtype, device=group.device)
        views, offset = [], 0
        for numel in group.numels:
            views.append(buffer[offset:offset + numel])
            offset += numel
        units.append(views)
    return units
