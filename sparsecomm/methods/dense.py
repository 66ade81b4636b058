"""Dense baselines: torch's native all-reduce and this library's ring and Rabenseifner all-reduce.

Each returns sum / P of the local gradients. The ring and Rabenseifner variants are built from the
metered point-to-point transport (:mod:`sparsecomm.transport.collectives`), so their bytes and rounds are
measured; ``dense`` calls the backend's own all_reduce (gloo or NCCL), whose internal messages the
meter cannot see: its stats carry one round and, marked ``modelled_bytes``, the ring formula's bytes
(the figure a ring all-reduce would send; gloo and NCCL use ring-like algorithms for large messages).
"""

from __future__ import annotations

import torch

from ..core.cost import Cost, register_cost
from ..transport.collectives import rabenseifner_allreduce, rabenseifner_cost, ring_allreduce, ring_cost
from .base import Method, Output, register_method


@register_method("dense")
class DenseAllReduce(Method):
    """``torch.distributed.all_reduce`` of the whole bucket, divided by P (what plain DDP does)."""

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        with self.timer("comm"):
            total = self.comm.native_all_reduce(out.copy_of(grad))
        with self.timer("decompress"):
            total.div_(self.comm.size)
        modelled = ring_cost(P=self.comm.size, n=grad.numel(), rank=self.comm.rank, itemsize=grad.element_size())
        self.stats.update(bytes_sent=modelled.bytes_sent, bytes_recv=modelled.bytes_recv, modelled_bytes=True)
        return total


@register_cost("dense")
def _dense_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    # The backend's algorithm is its own: the ring figures are an estimate, not a bound to check.
    return ring_cost(P=P, n=n, rank=rank, itemsize=itemsize).estimate()


@register_method("ring")
class RingAllReduce(Method):
    """Ring all-reduce (reduce-scatter + all-gather), 2(P-1) rounds, ~2n(P-1)/P elements per rank."""

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        with self.timer("comm"):
            total = ring_allreduce(self.comm, grad)
        with self.timer("decompress"):
            total.div_(self.comm.size)
        return total


@register_method("rabenseifner")
class RabenseifnerAllReduce(Method):
    """Rabenseifner all-reduce (recursive halving + doubling, the middle two rounds as one), 2 log2 p' - 1
    rounds (+2 when P is not a power of two), any P."""

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        with self.timer("comm"):
            total = rabenseifner_allreduce(self.comm, grad)
        with self.timer("decompress"):
            total.div_(self.comm.size)
        return total


# ring and rabenseifner send what the transport's collectives send: their formulas are the collectives'
register_cost("ring")(ring_cost)
register_cost("rabenseifner")(rabenseifner_cost)
