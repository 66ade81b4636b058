"""Tree all-reduce (NCCL's double binary tree), the dense baseline "TreeAR" that Shi et al., "Towards
Scalable Distributed Training of Deep Learning on Public Cloud Clusters" ([ShiCloud],
section 5) train with and compare against.

The collective is :func:`~sparsecomm.transport.tree.double_tree_allreduce`: the gradient's first half
is summed up a binary tree rooted at rank 0 and broadcast back down it, the second half along the
mirrored tree rooted at rank P-1; then every rank divides by P. Any P. Cost per rank (exact, the
traffic does not depend on the data; c = children, u = 1 unless the rank is its tree's root,
e = the half's elements, s its item size)::

    sum over the two trees of  2 (c + u) rounds,  (u + c) e s bytes sent,  (c + u) e s received
"""

from __future__ import annotations

import torch

from ..core.cost import Cost, register_cost
from ..transport.tree import double_tree_allreduce, double_tree_cost
from .base import Method, Output, register_method

__all__ = ["TreeAllReduce"]


@register_method("tree")
class TreeAllReduce(Method):
    """Double-binary-tree all-reduce of the whole gradient, divided by P (dense)."""

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        with self.timer("comm"):
            total = double_tree_allreduce(self.comm, grad)
        with self.timer("decompress"):
            total.div_(self.comm.size)
        return total


@register_cost("tree")
def _tree_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    return double_tree_cost(P=P, n=n, rank=rank, itemsize=itemsize)
