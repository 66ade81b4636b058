"""2D-torus all-reduce (Mikami et al. 2018; Cho et al. 2019), the dense hierarchical baseline "2DTAR"
of Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud Clusters"
(003_2fa2388d6a23a217.txt, section 5.3, Fig. 7).

The P ranks form m nodes of L consecutive ranks (``local_size`` = L, see :func:`resolve_local_size`).
Per call, on rank (node i, local rank j):

1. intra-node ring reduce-scatter of the gradient: rank j holds shard j (``chunk_offsets(n, L)[j]``)
   summed over its node;
2. inter-node ring all-reduce of that shard among the m ranks with local rank j;
3. intra-node ring all-gather of the shards; divide by P.

Every shard is reduced by ring algorithms whose results are copies of one computation, so every
rank holds the same bits. Cost per rank (``c`` = chunk sizes of n over L, ``ring(p, x, r)`` the ring
all-reduce cost, ``cost("ring", ...)``)::

    ring(L, n, j) + ring(m, c_j, i)
    = 2(L-1) + 2(m-1) rounds,  (2n - c_j - c_(j+1)) + (2c_j - c'_i - c'_(i+1)) elements sent,

where ``c'`` are the chunk sizes of c_j over m. Exact: the traffic does not depend on the data.

This module also holds the node layout shared with HiTopKComm (:mod:`.hitopk`).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ..collectives import ring_allgather_into, chunk_offsets, ring_allreduce, ring_reduce_scatter
from ..comm import Communicator
from ..costmodel import Cost, chunk_sizes, cost, register_cost
from . import Layout, Method, register_method

__all__ = ["TorusAllReduce", "resolve_local_size", "split_nodes"]

LOCAL_SIZE_ENV = "LOCAL_WORLD_SIZE"


def resolve_local_size(P: int, local_size: Optional[int] = None) -> int:
    """The number of consecutive ranks per node, L.

    ``local_size`` when given; else the environment variable ``LOCAL_WORLD_SIZE`` (set by ``torchrun``
    to the number of processes per machine); else 1, i.e. every rank is its own node, the one
    assumption that never credits the ranks with a fast link they may not share. L must divide P.
    """
    source = "local_size"
    if local_size is None:
        env = os.environ.get(LOCAL_SIZE_ENV)
        if env is None:
            return 1
        source = f"{LOCAL_SIZE_ENV}={env!r}"
        try:
            local_size = int(env)
        except ValueError:
            raise ValueError(f"{source} must be an integer number of ranks per node") from None
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
            or P % local_size != 0:
        raise ValueError(f"{source} (ranks per node, got {local_size!r}) must be a positive integer "
                         f"dividing the number of ranks P={P}")
    return local_size


def split_nodes(comm: Communicator, local_size: Optional[int]) -> Tuple[int, Communicator, Communicator]:
    """``(L, node, cross)``: node = this rank's L consecutive ranks; cross = the ranks of every node
    with this rank's local rank (one per node)."""
    L = resolve_local_size(comm.size, local_size)
    node, cross = comm.split(teams=comm.size // L, mode="consecutive")
    return L, node, cross


@register_method("torus2d")
class TorusAllReduce(Method):
    """2D-torus all-reduce: intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather.

    Args:
        local_size: ranks per node L (consecutive ranks share a node); must divide P. Default:
            ``LOCAL_WORLD_SIZE`` from the environment, else 1 (then this is a ring all-reduce over P).
    """

    def __init__(self, comm: Optional[Communicator] = None, *, local_size: Optional[int] = None) -> None:
        super().__init__(comm)
        self.local_size, self.node, self.cross = split_nodes(self.comm, local_size)

    def reduce(self, grad: torch.Tensor, layout: Layout) -> torch.Tensor:
        with self.timer("comm"):
            shard = ring_reduce_scatter(self.node, grad) if self.node.size > 1 else grad.clone()
            shard = ring_allreduce(self.cross, shard)
            out = torch.empty_like(grad)
            start, size = chunk_offsets(grad.numel(), self.node.size)[self.node.rank]
            out[start:start + size] = shard
            ring_allgather_into(self.node, out)
        with self.timer("decompress"):
            out.div_(self.comm.size)
        return out

    def __repr__(self) -> str:
        return f"TorusAllReduce(P={self.comm.size}, local_size={self.local_size})"


@register_cost("torus2d")
def _torus2d_cost(P: int, n: int, rank: int, itemsize: int = 4, local_size: Optional[int] = None,
                  **_) -> Cost:
    """Exact: ring all-reduce of n over the node + ring all-reduce of the shard over the nodes."""
    L = resolve_local_size(P, local_size)
    node_id, j = divmod(rank, L)
    shard = chunk_sizes(n, L)[j]
    return cost("ring", P=L, n=n, rank=j, itemsize=itemsize) + \
        cost("ring", P=P // L, n=shard, rank=node_id, itemsize=itemsize)
