"""The node layout of a job: which ranks share a machine (a node) and which talk across nodes.

Shi et al.'s hierarchical methods (HiTopKComm, 2D-torus all-reduce; [ShiCloud],
section 3.2) treat P ranks as m nodes of L consecutive ranks: fast links inside a node, a slower
shared NIC between nodes. :func:`split_nodes` builds the node and cross-node communicators.
"""

from __future__ import annotations

from .comm import Communicator
from .nodemap import LOCAL_SIZE_ENV, resolve_local_size

__all__ = ["LOCAL_SIZE_ENV", "resolve_local_size", "split_nodes"]


def split_nodes(comm: Communicator, local_size: int | None) -> tuple[int, Communicator, Communicator]:
    """``(L, node, cross)``: node = this rank's L consecutive ranks; cross = the ranks of every node
    with this rank's local rank (one per node). ``local_size=None`` reads ``LOCAL_WORLD_SIZE``."""
    L = resolve_local_size(comm.size, local_size)
    node, cross = comm.split(teams=comm.size // L, mode="consecutive")
    return L, node, cross
