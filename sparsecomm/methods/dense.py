"""Dense baselines: torch's native all-reduce and this library's ring and Rabenseifner all-reduce.

Each returns sum / P of the local gradients. The ring and Rabenseifner variants are built from the
metered point-to-point transport (:mod:`sparsecomm.collectives`), so their bytes and rounds are
measured; ``dense`` calls the backend's own all_reduce (gloo or NCCL), whose internal messages the
meter cannot see: its stats carry one round and no bytes, and its model figure is the ring formula.
"""

from __future__ import annotations

import torch

from ..collectives import rabenseifner_allreduce, ring_allreduce
from ..costmodel import Cost, register_cost
from . import Layout, Method, register_method


@register_method("dense")
class DenseAllReduce(Method):
    """``torch.distributed.all_reduce`` of the whole bucket, divided by P (what plain DDP does)."""

    def reduce(self, grad: torch.Tensor, layout: Layout) -> torch.Tensor:
        with self.timer("comm"):
            out = self.comm.native_all_reduce(grad.clone())
        with self.timer("decompress"):
            out.div_(self.comm.size)
        return out


@register_cost("dense")
def _dense_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    from ..collectives import _ring_cost

    # The backend's algorithm is its own: the ring figures are an estimate, not a bound to check.
    ring = _ring_cost(P=P, n=n, rank=rank, itemsize=itemsize)
    return Cost(ring.rounds, ring.bytes_sent, ring.bytes_recv, exact=False, rounds_exact=False)


@register_method("ring")
class RingAllReduce(Method):
    """Ring all-reduce (reduce-scatter + all-gather), 2(P-1) rounds, ~2n(P-1)/P elements per rank."""

    def reduce(self, grad: torch.Tensor, layout: Layout) -> torch.Tensor:
        with self.timer("comm"):
            out = ring_allreduce(self.comm, grad)
        with self.timer("decompress"):
            out.div_(self.comm.size)
        return out


@register_method("rabenseifner")
class RabenseifnerAllReduce(Method):
    """Rabenseifner all-reduce (recursive halving + doubling), 2 log2 P rounds, any P."""

    def reduce(self, grad: torch.Tensor, layout: Layout) -> torch.Tensor:
        with self.timer("comm"):
            out = rabenseifner_allreduce(self.comm, grad)
        with self.timer("decompress"):
            out.div_(self.comm.size)
        return out
