"""sparsecomm: sparse gradient communication for data-parallel PyTorch training on slow networks.

Inside a worker (``run_workers`` or torchrun)::

    method = sparsecomm.make_method("spardl", density=0.01)
    averaged = method(flat_grad)          # identical on every rank

See the README and ``docs/`` for the methods, the DDP hook and the CLI.
"""

from .comm import Communicator
from .hook import SparseHookState, hook
from .launcher import WorkerError, run_workers
from .meter import TrafficMeter
from .methods import Method, available_methods, make_method, register_method
from .synchronizer import SparseSynchronizer

__all__ = ["Communicator", "TrafficMeter", "run_workers", "WorkerError", "Method", "make_method",
           "available_methods", "register_method", "SparseHookState", "hook", "SparseSynchronizer"]
__version__ = "0.1.0"
