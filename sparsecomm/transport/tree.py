"""Tree collectives from metered point-to-point messages: binary-tree reduce and broadcast, and the
double-binary-tree all-reduce of NCCL (Sanders, Speck and Traeff 2009; NCCL 2.4's "tree" algorithm),
for any number of ranks P.

Trees are heap-ordered over *positions* 0..P-1: position p has parent (p-1)//2 and children 2p+1,
2p+2. A tree maps positions to ranks; the *first* tree is the identity (root rank 0), the *mirror*
tree maps position p to rank P-1-p (root rank P-1). The heap tree's interior positions are the lower
half, so the mirror's interior ranks are the upper half: a rank that is a leaf in one tree is
(nearly always) interior in the other, which is what makes the pair of trees balance the bandwidth.

* :func:`tree_reduce`: children first, bottom up; a rank receives each child's partial sum in turn
  (one round per child), adds them to its own, and sends the sum to its parent (one round). The
  root holds the sum; the order of additions is fixed (own, first child, second child).
* :func:`tree_broadcast`: top down; a rank receives from its parent (one round) and sends to each
  child (one round each).
* :func:`double_tree_allreduce`: the vector is cut in two halves (``chunk_offsets(n, 2)``); the
  first half is reduced and broadcast along the first tree, the second half along the mirror.
  Every result element is computed once, on a root, and copied: all ranks hold the same bits.
  (NCCL also pipelines each half in small chunks and runs both trees at once; here the halves run
  one after the other and unpipelined, which leaves bytes and messages per rank unchanged.)

Cost per rank, for a segment of e elements of ``s`` bytes, with ``c`` children and ``u`` = 1 if the
rank has a parent (0 at the root)::

    reduce:     c + u rounds,   sent u e s,   received c e s
    broadcast:  u + c rounds,   sent c e s,   received u e s
    all-reduce: reduce + broadcast of the first half along the first tree,
                then of the second half along the mirror tree (a half of 0 elements costs nothing)
"""

from __future__ import annotations

import torch

from ..core.cost import ZERO, Cost, chunk_offsets, register_collective_cost
from .comm import Communicator

__all__ = ["tree_children", "tree_parent", "tree_reduce", "tree_broadcast", "double_tree_allreduce",
           "tree_reduce_cost", "tree_broadcast_cost", "double_tree_cost"]


def tree_parent(position: int) -> int | None:
    """The heap parent of ``position`` (``None`` at the root, position 0)."""
    return (position - 1) // 2 if position > 0 else None


def tree_children(position: int, P: int) -> list[int]:
    """The heap children of ``position`` among P positions (0, 1 or 2 of them)."""
    return [c for c in (2 * position + 1, 2 * position + 2) if c < P]


def _rank_of(position: int, P: int, mirror: bool) -> int:
    return P - 1 - position if mirror else position


def _position_of(rank: int, P: int, mirror: bool) -> int:
    return P - 1 - rank if mirror else rank   # the mirror map is its own inverse


def tree_reduce(comm: Communicator, x: torch.Tensor, mirror: bool = False) -> torch.Tensor:
    """Sum of ``x`` over the ranks, up a binary tree; the root (rank 0, or P-1 with ``mirror``)
    returns the sum, the other ranks their partial sums (not meaningful). ``x`` is left untouched."""
    P = comm.size
    acc = x.clone()
    if P == 1 or x.numel() == 0:
        return acc
    me = _position_of(comm.rank, P, mirror)
    incoming = torch.empty_like(acc)
    for child in tree_children(me, P):
        comm.sendrecv(None, None, incoming, _rank_of(child, P, mirror))
        acc += incoming
    parent = tree_parent(me)
    if parent is not None:
        comm.sendrecv(acc, _rank_of(parent, P, mirror), None, None)
    return acc


def tree_broadcast(comm: Communicator, x: torch.Tensor, mirror: bool = False) -> None:
    """Broadcast the root's ``x`` (rank 0, or P-1 with ``mirror``) down a binary tree, in place.

    ``x`` must be contiguous (it is the receive buffer on the other ranks)."""
    P = comm.size
    if P == 1 or x.numel() == 0:
        return
    me = _position_of(comm.rank, P, mirror)
    parent = tree_parent(me)
    if parent is not None:
        comm.sendrecv(None, None, x, _rank_of(parent, P, mirror))
    for child in tree_children(me, P):
        comm.sendrecv(x, _rank_of(child, P, mirror), None, None)


def double_tree_allreduce(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks of ``x`` (a new tensor): each half of the vector reduced to the root of
    its tree and broadcast back along it (see the module docstring)."""
    out = torch.empty_like(x)
    for (start, size), mirror in zip(chunk_offsets(x.numel(), 2), (False, True), strict=True):
        half = out[start:start + size]
        half.copy_(tree_reduce(comm, x[start:start + size], mirror))
        tree_broadcast(comm, half, mirror)
    return out


def _counts(P: int, rank: int, mirror: bool) -> tuple[int, int]:
    """(children, has a parent) of ``rank`` in the tree."""
    me = _position_of(rank, P, mirror)
    return len(tree_children(me, P)), int(tree_parent(me) is not None)


@register_collective_cost("tree_reduce")
def tree_reduce_cost(P: int, n: int, rank: int, itemsize: int = 4, mirror: bool = False, **_) -> Cost:
    if P == 1 or n == 0:
        return ZERO
    children, up = _counts(P, rank, mirror)
    return Cost(children + up, up * n * itemsize, children * n * itemsize)


@register_collective_cost("tree_broadcast")
def tree_broadcast_cost(P: int, n: int, rank: int, itemsize: int = 4, mirror: bool = False, **_) -> Cost:
    if P == 1 or n == 0:
        return ZERO
    children, up = _counts(P, rank, mirror)
    return Cost(children + up, children * n * itemsize, up * n * itemsize)


@register_collective_cost("double_tree")
def double_tree_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    total = ZERO
    for (_start, size), mirror in zip(chunk_offsets(n, 2), (False, True), strict=True):
        total = total + tree_reduce_cost(P, size, rank, itemsize, mirror=mirror) + \
            tree_broadcast_cost(P, size, rank, itemsize, mirror=mirror)
    return total
