"""sparsecomm: sparse gradient communication for data-parallel PyTorch training on slow networks.

Inside a worker (``run_workers`` or torchrun)::

    method = sparsecomm.make_method("spardl", density=0.01)
    averaged = method(flat_grad)          # identical on every rank; a new tensor
    method(flat_grad, out=averaged)       # the same into a tensor of yours, no allocation

See the README and ``docs/`` for the methods, the DDP hook and the CLI. The library is layered
(``docs/architecture.md``): ``core`` < ``transport`` < ``selection`` < ``methods`` < ``integration``
< ``launch`` < ``simulator`` < ``cli``; this module re-exports the public names, and
``sparsecomm.selectors`` is the selector namespace. The experiments behind the measurements (the lab,
``sparsecomm_lab`` in the repository's ``lab/``) are never imported by the library. Papers are cited
by the keys of ``docs/references.md`` ([SparDL], [ShiCloud], ...).
"""

from . import selectors
from .integration.checkpoint import CheckpointError, CheckpointManager
from .integration.consistency import ConfigMismatchError, check_same_config, replica_checksums
from .integration.datacache import DataCache
from .integration.hook import SparseHookState, hook
from .integration.hsdp import SparseReplicaState, sparse_replicas
from .integration.lars import LARS
from .integration.local_steps import LocalSteps
from .integration.pto import parallel_apply
from .integration.synchronizer import SparseSynchronizer
from .integration.world import StateLoadError
from .launch.launcher import WorkerError, run_workers
from .methods import Method, MethodSpec, Stats, available_methods, cost, make_method, register_method
from .transport import Communicator, SparseChunk, TrafficMeter

__all__ = ["Communicator", "TrafficMeter", "SparseChunk", "run_workers", "WorkerError", "Method", "Stats",
           "make_method", "available_methods", "register_method", "cost", "SparseHookState", "hook",
           "SparseSynchronizer", "selectors", "MethodSpec", "parallel_apply", "LARS", "DataCache",
           "sparse_replicas", "SparseReplicaState", "LocalSteps", "CheckpointManager", "CheckpointError",
           "StateLoadError", "ConfigMismatchError", "check_same_config", "replica_checksums"]
__version__ = "0.1.0"
