"""The node layout of a job: which ranks share a machine (a node) and which talk across nodes.

Shi et al.'s hierarchical methods (HiTopKComm, 2D-torus all-reduce; 003_2fa2388d6a23a217.txt,
section 3.2) treat P ranks as m nodes of L consecutive ranks: fast links inside a node, a slower
shared NIC between nodes. :func:`split_nodes` builds the node and cross-node communicators.
"""

from __future__ import annotations

import os

from ..core.validate import is_int
from .comm import Communicator

__all__ = ["LOCAL_SIZE_ENV", "resolve_local_size", "split_nodes"]

LOCAL_SIZE_ENV = "LOCAL_WORLD_SIZE"


def resolve_local_size(P: int, local_size: int | None = None) -> int:
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
    if not is_int(local_size) or local_size < 1 or P % local_size != 0:
        raise ValueError(f"{source} (ranks per node, got {local_size!r}) must be a positive integer "
                         f"dividing the number of ranks P={P}")
    return local_size


def split_nodes(comm: Communicator, local_size: int | None) -> tuple[int, Communicator, Communicator]:
    """``(L, node, cross)``: node = this rank's L consecutive ranks; cross = the ranks of every node
    with this rank's local rank (one per node)."""
    L = resolve_local_size(comm.size, local_size)
    node, cross = comm.split(teams=comm.size // L, mode="consecutive")
    return L, node, cross
