"""Which ranks share a node, from the environment ``torchrun`` (and ``run_workers``) set.

``torchrun`` gives every worker ``LOCAL_RANK`` (its index on its machine), ``LOCAL_WORLD_SIZE`` (the
workers per machine, L) and ``GROUP_RANK`` (the machine's index). Ranks are numbered node by node,
so global rank r sits on node ``r // L``. This module is a leaf of the transport layer: the
:class:`~sparsecomm.transport.comm.Communicator` reads it to tell inter-node bytes from intra-node
bytes, and :mod:`~sparsecomm.transport.topology` to build node communicators.
"""

from __future__ import annotations

import os

from ..core.validate import is_int

__all__ = ["LOCAL_SIZE_ENV", "LOCAL_RANK_ENV", "NODE_RANK_ENV", "NODE_COUNT_ENV", "resolve_local_size",
           "node_of"]

LOCAL_SIZE_ENV = "LOCAL_WORLD_SIZE"
LOCAL_RANK_ENV = "LOCAL_RANK"
NODE_RANK_ENV = "GROUP_RANK"
NODE_COUNT_ENV = "GROUP_WORLD_SIZE"


def resolve_local_size(P: int, local_size: int | None = None) -> int:
    """The number of consecutive ranks per node, L.

    ``local_size`` when given; else the environment variable ``LOCAL_WORLD_SIZE`` (set by ``torchrun``
    and by :func:`~sparsecomm.run_workers` to the number of processes per machine); else 1, i.e. every
    rank is its own node, the one assumption that never credits the ranks with a fast link they may
    not share. L must divide P.
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


def node_of(global_rank: int, local_size: int) -> int:
    """The node of ``global_rank`` when every node holds ``local_size`` consecutive ranks."""
    return global_rank // local_size
