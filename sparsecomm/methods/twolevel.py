"""Two-level dense all-reduce for m nodes of L ranks: reduce inside each node, all-reduce across the
nodes, broadcast inside each node. The hierarchical dense baseline beside the 2D-torus all-reduce in
Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud Clusters"
([ShiCloud], sections 3.2 and 5: the node-aware dense schemes HiTopKComm is measured
against; the reduce / inter-node all-reduce / broadcast scheme of Horovod's hierarchical all-reduce).

Per call, on rank (node i, local rank j), with ``local_size`` = L (see
:func:`~sparsecomm.transport.topology.split_nodes`):

1. binary-tree reduce of the gradient inside the node to its leader, local rank 0
   (:func:`~sparsecomm.transport.tree.tree_reduce`);
2. the m leaders all-reduce the node sums (``allreduce``: ``"ring"`` or ``"rabenseifner"``);
3. binary-tree broadcast of the result inside the node from the leader; divide by P.

Only the leaders talk across nodes, each sending the whole vector's all-reduce share: a node's NIC
carries one rank's inter-node traffic. Every result is computed once and copied (the leaders' ring
or Rabenseifner results are bitwise equal), so all ranks hold the same bits. Cost per rank (exact)::

    tree_reduce(L, n, j) + [j = 0] allreduce(m, n, i) + tree_broadcast(L, n, j)

Only one node (m = 1): a tree reduce and broadcast over every rank (``stats.dense_fallback``, and a
warning when built).
"""

from __future__ import annotations

import logging

import torch

from ..core.cost import Cost, register_cost
from ..transport.collectives import allreduce, allreduce_cost, check_allreduce
from ..transport.comm import Communicator
from ..transport.topology import resolve_local_size, split_nodes
from ..transport.tree import tree_broadcast, tree_broadcast_cost, tree_reduce, tree_reduce_cost
from .base import Method, Output, register_method

__all__ = ["TwoLevelAllReduce"]

log = logging.getLogger(__name__)


@register_method("twolevel")
class TwoLevelAllReduce(Method):
    """Reduce inside the node, all-reduce across nodes among the leaders, broadcast inside the node.

    Args:
        local_size: ranks per node L (consecutive ranks share a node); must divide P. Default:
            ``LOCAL_WORLD_SIZE`` from the environment (torchrun and ``run_workers`` set it), else 1.
        allreduce: the leaders' algorithm, ``"ring"`` (default) or ``"rabenseifner"``.
    """

    def __init__(self, comm: Communicator | None = None, *, local_size: int | None = None,
                 allreduce: str = "ring") -> None:
        super().__init__(comm)
        self.allreduce = check_allreduce(allreduce, "twolevel")
        self.local_size, self.node, self.cross = split_nodes(self.comm, local_size)
        self.one_node = self.comm.size > 1 and self.cross.size == 1
        if self.one_node:
            log.warning("twolevel: all P=%d ranks form one node (local_size=%d): no inter-node stage, "
                        "this is a tree reduce and broadcast (stats.dense_fallback)", self.comm.size,
                        self.local_size)

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        with self.timer("comm"):
            total = tree_reduce(self.node, grad)
            if self.node.rank == 0:
                total = allreduce(self.cross, total, self.allreduce)
            tree_broadcast(self.node, total)
        with self.timer("decompress"):
            total.div_(self.comm.size)
        self.stats.dense_fallback = self.one_node
        return total

    def __repr__(self) -> str:
        return f"TwoLevelAllReduce(P={self.comm.size}, local_size={self.local_size}, allreduce={self.allreduce!r})"


@register_cost("twolevel")
def _twolevel_cost(P: int, n: int, rank: int, itemsize: int = 4, local_size: int | None = None,
                   allreduce: str = "ring", **_) -> Cost:
    """Exact: tree reduce and broadcast over the node, plus the leaders' all-reduce over the nodes."""
    L = resolve_local_size(P, local_size)
    node_id, j = divmod(rank, L)
    total = tree_reduce_cost(L, n, j, itemsize) + tree_broadcast_cost(L, n, j, itemsize)
    if j == 0:
        total = total + allreduce_cost(allreduce, P // L, n, node_id, itemsize)
    return total
