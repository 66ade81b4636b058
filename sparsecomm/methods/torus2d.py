"""2D-torus all-reduce (Mikami et al. 2018; Cho et al. 2019), the dense hierarchical baseline "2DTAR"
of Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud Clusters"
([ShiCloud], section 5.3, Fig. 7).

The P ranks form m nodes of L consecutive ranks (``local_size`` = L, see :func:`resolve_local_size`).
Per call, on rank (node i, local rank j):

1. intra-node ring reduce-scatter of the gradient: rank j holds shard j (``chunk_offsets(n, L)[j]``)
   summed over its node;
2. inter-node ring all-reduce of that shard among the m ranks with local rank j;
3. intra-node ring all-gather of the shards; divide by P.

Every shard is reduced by ring algorithms whose results are copies of one computation, so every
rank holds the same bits. Cost per rank (``c`` = chunk sizes of n over L, ``ring(p, x, r)`` the ring
all-reduce cost, :func:`~sparsecomm.transport.collectives.ring_cost`)::

    ring(L, n, j) + ring(m, c_j, i)
    = 2(L-1) + 2(m-1) rounds,  (2n - c_j - c_(j+1)) + (2c_j - c'_i - c'_(i+1)) elements sent,

where ``c'`` are the chunk sizes of c_j over m. Exact: the traffic does not depend on the data.

Only one node (m = 1, e.g. ``torchrun`` or ``run_workers`` on one machine): the method is a flat ring
all-reduce over every rank; it logs a warning when built and sets ``stats.dense_fallback``.
"""

from __future__ import annotations

import logging

import torch

from ..core.cost import Cost, chunk_offsets, chunk_sizes, register_cost
from ..transport.collectives import ring_allgather_into, ring_allreduce, ring_cost, ring_reduce_scatter
from ..transport.comm import Communicator
from ..transport.topology import resolve_local_size, split_nodes
from .base import Method, Output, register_method

__all__ = ["TorusAllReduce"]

log = logging.getLogger(__name__)

@register_method("torus2d")
class TorusAllReduce(Method):
    """2D-torus all-reduce: intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather.

    Args:
        local_size: ranks per node L (consecutive ranks share a node); must divide P. Default:
            ``LOCAL_WORLD_SIZE`` from the environment, else 1 (then this is a ring all-reduce over P).
    """

    def __init__(self, comm: Communicator | None = None, *, local_size: int | None = None) -> None:
        super().__init__(comm)
        self.local_size, self.node, self.cross = split_nodes(self.comm, local_size)
        self.one_node = self.comm.size > 1 and self.cross.size == 1
        if self.one_node:
            log.warning("torus2d: all P=%d ranks form one node (local_size=%d, from %s): no inter-node "
                        "stage, this is a flat ring all-reduce (stats.dense_fallback). Pass "
                        "local_size= or run on several nodes for the hierarchy.", self.comm.size,
                        self.local_size, "the argument" if local_size is not None else "LOCAL_WORLD_SIZE")

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        with self.timer("comm"):
            shard = ring_reduce_scatter(self.node, grad) if self.node.size > 1 else grad.clone()
            shard = ring_allreduce(self.cross, shard)
            total = torch.empty_like(grad)
            start, size = chunk_offsets(grad.numel(), self.node.size)[self.node.rank]
            total[start:start + size] = shard
            ring_allgather_into(self.node, total)
        with self.timer("decompress"):
            total.div_(self.comm.size)
        self.stats.dense_fallback = self.one_node
        return total

    def __repr__(self) -> str:
        return f"TorusAllReduce(P={self.comm.size}, local_size={self.local_size})"


@register_cost("torus2d")
def _torus2d_cost(P: int, n: int, rank: int, itemsize: int = 4, local_size: int | None = None,
                  **_) -> Cost:
    """Exact: ring all-reduce of n over the node + ring all-reduce of the shard over the nodes."""
    L = resolve_local_size(P, local_size)
    node_id, j = divmod(rank, L)
    shard = chunk_sizes(n, L)[j]
    return ring_cost(P=L, n=n, rank=j, itemsize=itemsize) + \
        ring_cost(P=P // L, n=shard, rank=node_id, itemsize=itemsize)
