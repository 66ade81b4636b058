"""All-to-all of messages whose sizes the receivers do not know: the first half of every sparse
reduce-scatter by index regions (Ok-Topk's balanced sparse reduce-scatter, OmniReduce's shard
aggregators, SparCML's split all-gather).

:func:`alltoallv` takes one message (a list of 1-D tensors, the same number and dtypes on every rank)
per destination rank. Step t = 1 .. P-1 sends the message for rank r + t and receives the one from
rank r - t, in one packed payload (:meth:`Communicator.exchange_many`); this rank's own message never
travels. This is Ok-Topk's destination rotation (``dsts``/``srcs`` in its ``allreducer.py``) without
its throttling.

Cost (:func:`alltoallv_traffic`): P - 1 rounds; rank r sends the bytes of its messages to the other
ranks and receives the bytes of theirs to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .comm import Communicator

__all__ = ["alltoallv", "alltoallv_traffic"]


def alltoallv(comm: Communicator, messages: Sequence[Sequence[Tensor]], dtypes: Sequence[torch.dtype],
              device=None) -> list[list[Tensor]]:
    """``messages[q]`` goes to rank q; returns ``received[q]``, the message rank q sent here (this
    rank's own ``messages[r]`` as given)."""
    P, r = comm.size, comm.rank
    if len(messages) != P:
        raise ValueError(f"alltoallv needs one message per rank: got {len(messages)}, P={P}")
    width = len(dtypes)
    received: list[list[Tensor]] = [[] for _ in range(P)]
    received[r] = list(messages[r])
    for t in range(1, P):
        dst, src = (r + t) % P, (r - t) % P
        received[src] = comm.exchange_many(dst, list(messages[dst]), src, count=width, dtypes=list(dtypes),
                                           device=device)
    return received


def alltoallv_traffic(message_bytes: Sequence[Sequence[int]], rank: int) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) of ``rank`` in :func:`alltoallv` when rank s's message to
    rank d has ``message_bytes[s][d]`` payload bytes."""
    P = len(message_bytes)
    sent = sum(message_bytes[rank][d] for d in range(P) if d != rank)
    recv = sum(message_bytes[s][rank] for s in range(P) if s != rank)
    return P - 1, sent, recv
