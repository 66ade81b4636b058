"""All-gathers of messages whose sizes the receivers do not know: the sparse collectives.

Every sparse method that all-gathers (TopkA, RedSync, ExDyna's index blocks, HiTopKComm, SparDL's
final Bruck stage and its B-SAG) uses these functions and replays their traffic with
:func:`allgatherv_traffic` / :func:`allgatherv_cost`, so a schedule and its formula live together.

A *message* is a tuple of 1-D tensors (``parts``), the same number and dtypes on every rank, any
lengths: one :class:`~.chunk.SparseChunk` ``(indices, values)``, or a packed message such as
RedSync's ``(counts, indices, values)``. Each step moves ONE packed payload per rank with a size
header of one int64 per tensor (booked as header bytes by the meter; on gloo and MPI it travels in
front of the payload, in the same message, on NCCL as a message of its own: see
:meth:`~.comm.Communicator.exchange_many`), unless every rank knows every message's lengths in advance
(``numels=``: a method whose ranks all send exactly k entries), when the step is the payload alone.

* :func:`halving_allgatherv`: P a power of two; step D = P/2, P/4, ..., 1 sends everything held to
  rank r + D and receives everything rank r - D holds (a dissemination with halving distances: the
  schedule of the per-call agreement and of SparDL's Spar-Reduce-Scatter, so that both can ride on
  it; log2 P rounds and, with equal messages, the bytes of recursive doubling, RedSync's equation (1)).
* :func:`bruck_allgatherv`: any P; step i sends the first min(2^i, P - 2^i) blocks held to
  rank r - 2^i (SparDL's Bruck all-gather, section III-C).
* :func:`allgatherv`: the first for powers of two, the second otherwise.

Cost: ceil(log2 P) rounds for all three; with equal messages of b bytes, (P-1) b bytes sent and
received per rank. :func:`allgatherv_traffic` replays a schedule for unequal messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..core.cost import Cost, is_power_of_two, register_collective_cost
from .chunk import SparseChunk
from .comm import AllgatherStep, Communicator, allgather_steps

__all__ = ["halving_allgatherv", "bruck_allgatherv", "allgatherv", "allgather_chunks",
           "allgatherv_traffic", "allgatherv_cost", "bruck_traffic", "bruck_sources"]

Message = Sequence[Tensor]
Numels = Sequence[Sequence[int]]  # numels[q]: the length of each part of rank q's message


def halving_allgatherv(comm: Communicator, parts: Message, numels: Numels | None = None) -> list[list[Tensor]]:
    """All-gather by dissemination with halving distances; P must be a power of two. Returns
    ``result[q]`` = rank q's parts.

    Step D = P/2, P/4, ..., 1: send everything held to rank r + D in one packed message, and receive
    everything rank r - D holds (:func:`~.comm.allgather_steps`). The control messages' steps on gloo
    and MPI (:func:`~.control.max_all_reduce_gathering`), so an all-gather they carry moves what this
    one does. ``numels``: see :func:`allgatherv`.
    """
    if not is_power_of_two(comm.size):
        raise ValueError(f"halving_allgatherv needs a power-of-two size, got P={comm.size}")
    return _scheduled_allgatherv(comm, parts, numels, allgather_steps(comm.size, comm.rank))


def bruck_allgatherv(comm: Communicator, parts: Message, numels: Numels | None = None) -> list[list[Tensor]]:
    """Bruck all-gather, any P. Returns ``result[q]`` = rank q's parts.

    Step i = 0 .. ceil(log2 P)-1: send the first min(2^i, P - 2^i) blocks held (blocks r, r+1, ...)
    to rank r - 2^i and receive as many from rank r + 2^i, in one packed message. ``numels``: see
    :func:`allgatherv`.
    """
    return _scheduled_allgatherv(comm, parts, numels, allgather_steps(comm.size, comm.rank, bruck=True))


def _scheduled_allgatherv(comm: Communicator, parts: Message, numels: Numels | None,
                          steps: Sequence[AllgatherStep]) -> list[list[Tensor]]:
    """Every rank's parts, in rank order, moved by ``steps``: one packed message each way per step."""
    width = len(parts)
    dtypes = [t.dtype for t in parts]
    device = parts[0].device if parts else None
    held: dict[int, list[Tensor]] = {comm.rank: list(parts)}
    for step in steps:
        count = len(step.receives)
        incoming = comm.exchange_many(step.dst, [t for q in step.sends for t in held[q]], step.src,
                                      count=count * width, dtypes=dtypes * count, device=device,
                                      recv_numels=_known(numels, step.receives))
        for j, q in enumerate(step.receives):
            held[q] = incoming[j * width:(j + 1) * width]
    return [held[q] for q in range(comm.size)]


def allgatherv(comm: Communicator, parts: Message, numels: Numels | None = None) -> list[list[Tensor]]:
    """All-gather of one packed message per rank: halving distances for powers of two, Bruck
    otherwise; ceil(log2 P) rounds either way. ``result[q]`` = rank q's parts (this rank's included).

    ``numels``: when every rank knows every message's lengths in advance, ``numels[q]`` = the length
    of each part of rank q's message (the same on every rank; rank r's own entry must match
    ``parts``). Then no size header travels: each round is the payload alone, received straight into
    buffers of the known sizes (on NCCL one message instead of two). Without it, the sizes travel as
    headers."""
    if numels is not None:
        if len(numels) != comm.size:
            raise ValueError(f"allgatherv: numels has {len(numels)} entries, need one per rank (P={comm.size})")
        mine = tuple(int(t.numel()) for t in parts)
        if tuple(numels[comm.rank]) != mine:
            raise ValueError(f"allgatherv: rank {comm.rank} sends parts of lengths {mine}, but numels says "
                             f"{tuple(numels[comm.rank])}")
    if comm.size == 1:
        return [list(parts)]
    if is_power_of_two(comm.size):
        return halving_allgatherv(comm, parts, numels)
    return bruck_allgatherv(comm, parts, numels)


def _known(numels: Numels | None, ranks) -> list[int] | None:
    """The lengths of the blocks of ``ranks`` (in that order, flattened), or ``None`` when unknown."""
    return None if numels is None else [int(m) for q in ranks for m in numels[q]]


def allgather_chunks(comm: Communicator, chunk: SparseChunk, *, bruck: bool = False,
                     counts: Sequence[int] | None = None) -> list[SparseChunk]:
    """Every rank's chunk, in rank order, by :func:`allgatherv` (or :func:`bruck_allgatherv`).
    ``counts``: every rank's number of entries, when all ranks know them (no size headers then)."""
    numels = None if counts is None else [(int(c), int(c)) for c in counts]
    gathered = (bruck_allgatherv if bruck else allgatherv)(comm, chunk.parts(), numels)
    return [SparseChunk(indices, values) for indices, values in gathered]


def bruck_sources(P: int, rank: int) -> list[int]:
    """The rank each step of :func:`bruck_allgatherv` receives from, in step order: ``rank + 2^i``."""
    return [step.src for step in allgather_steps(P, rank, bruck=True)]


# ---------------------------------------------------------------------- traffic of the schedules
def _replay(steps: Sequence[AllgatherStep], message_bytes: Sequence[int]) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) of one rank's ``steps`` when rank q's message has
    ``message_bytes[q]`` payload bytes (size headers excluded)."""
    return (len(steps), sum(message_bytes[q] for step in steps for q in step.sends),
            sum(message_bytes[q] for step in steps for q in step.receives))


def bruck_traffic(message_bytes: Sequence[int], rank: int) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) of ``rank`` in :func:`bruck_allgatherv` when rank q's
    message has ``message_bytes[q]`` payload bytes (size headers excluded)."""
    return _replay(allgather_steps(len(message_bytes), rank, bruck=True), message_bytes)


def allgatherv_traffic(message_bytes: Sequence[int], rank: int) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) of ``rank`` in :func:`allgatherv` when rank q's message
    has ``message_bytes[q]`` payload bytes (size headers excluded). Replays the schedule."""
    return _replay(allgather_steps(len(message_bytes), rank), message_bytes)


def allgatherv_cost(message_bytes: Sequence[int], P: int, rank: int, exact: bool = True) -> Cost:
    """Cost of :func:`allgatherv` for one packed message of ``message_bytes[q]`` bytes per rank q."""
    if len(message_bytes) != P:
        raise ValueError(f"message_bytes has {len(message_bytes)} entries, need one per rank (P={P})")
    return Cost(*allgatherv_traffic(list(message_bytes), rank), exact=exact)


@register_collective_cost("bruck_allgather")
def _bruck_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    """n here is the per-rank block size (equal on all ranks)."""
    return Cost(*bruck_traffic([n * itemsize] * P, rank))
