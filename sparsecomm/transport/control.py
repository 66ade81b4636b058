"""Control messages: the small element-wise maximum over all ranks that every agreement is made of,
in self-describing frames that can also carry a method's payload.

:func:`max_all_reduce` reduces a few int64 values over a communicator in ceil(log2 P) steps, booked as
header bytes and no round, so it never disturbs a method's traffic figures. On gloo and MPI, whose
receives accept a message shorter than the posted buffer (:attr:`Communicator.short_receives`), every
step sends one frame ``[V, m, sizes of the m blocks, the V running maxima | the blocks, each padded to
8 bytes]`` (int64 prefix) into a reused receive buffer of :data:`~.comm.EAGER_LIMIT_BYTES` per step; a
frame past that limit sends its blocks as a second message, which both sides decide from the sizes
alone. Because every frame describes itself, a rank that only reduces and a rank whose frames carry
blocks still read each other, which is what lets a method's first message travel in them:

* :func:`max_all_reduce_gathering`: the frames all-gather one block per rank, in the steps of
  :func:`~.sparse_collectives.allgatherv` (:func:`~.comm.allgather_steps`): a call's all-gather and its
  agreement in ceil(log2 P) messages instead of twice as many;
* :func:`max_all_reduce_carrying`: each step's frame carries one of the caller's point-to-point
  messages, when the caller's steps go to the same ranks (P a power of two: step D = P/2, ..., 1 sends
  to rank r + D and receives from r - D, SparDL's Spar-Reduce-Scatter).

:func:`post_receives_ahead` posts the receives of a communicator's next reduction early, so that a
peer's frame finds its receive waiting (on gloo a message moves once both sides have posted).
Elsewhere (NCCL) the reduction is a plain dissemination of the values (step d sends to rank r + d and
receives from r - d) and carries nothing.

Cost per rank: ceil(log2 P) messages of 8 (2 + m + V) bytes of header (8 V bytes without frames) plus
the blocks, which the caller books as its own messages (:class:`BlockStep`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .chunk import as_bytes
from .comm import EAGER_LIMIT_BYTES, AllgatherStep, Communicator, allgather_steps

__all__ = ["BlockStep", "max_all_reduce", "max_all_reduce_gathering", "max_all_reduce_carrying",
           "carries_blocks", "carries_messages", "post_receives_ahead", "posted_ahead", "steps"]

_INT64 = torch.int64


class BlockStep(NamedTuple):
    """The payload one step of :func:`max_all_reduce_gathering` (or :func:`max_all_reduce_carrying`)
    moved (bytes, unpadded): the caller books it as its own message."""

    dst: int
    sent: int
    src: int
    recv: int


class _Channel:
    """A communicator's frames: the steps (fixed by rank and size), one receive buffer per step (kept:
    a fresh one per message costs page faults), and the receives posted ahead, by step."""

    def __init__(self, comm: Communicator) -> None:
        self.steps = allgather_steps(comm.size, comm.rank)
        self.buffers: list[torch.Tensor] = []
        self.posted: dict[int, tuple[int, dist.Work | None]] = {}  # step -> (source, its receive)

    def buffer(self, step: int) -> torch.Tensor:
        """The receive buffer of ``step``, allocated once."""
        while len(self.buffers) <= step:
            self.buffers.append(torch.empty(EAGER_LIMIT_BYTES, dtype=torch.uint8))
        return self.buffers[step]


_CHANNELS: weakref.WeakKeyDictionary[Communicator, _Channel] = weakref.WeakKeyDictionary()


def _channel(comm: Communicator) -> _Channel:
    channel = _CHANNELS.get(comm)
    if channel is None:
        channel = _CHANNELS[comm] = _Channel(comm)
    return channel


def steps(comm: Communicator) -> list[AllgatherStep]:
    """The steps of ``comm``'s framed reduction (those of :func:`~.comm.allgather_steps`)."""
    return _channel(comm).steps


def carries_blocks(comm: Communicator) -> bool:
    """Whether :func:`max_all_reduce_gathering` can carry a payload on ``comm`` (gloo, MPI)."""
    return comm.short_receives


def carries_messages(comm: Communicator, peers: Sequence[tuple[int, int]]) -> bool:
    """Whether :func:`max_all_reduce_carrying` can carry messages whose step i goes to ``peers[i][0]``
    and comes from ``peers[i][1]``: frames, P a power of two, and the reduction's own steps."""
    P = comm.size
    return carries_blocks(comm) and P >= 2 and P & (P - 1) == 0 \
        and list(peers) == [(s.dst, s.src) for s in steps(comm)]


def max_all_reduce(comm: Communicator, values: Sequence[int], device=None) -> list[int]:
    """Element-wise maximum of a small integer list over every rank of ``comm`` (collective)."""
    if comm.short_receives:
        return max_all_reduce_gathering(comm, values, None)[0]
    mine = torch.tensor(list(values), dtype=_INT64, device=device)
    theirs = torch.empty_like(mine)
    distance = 1
    while distance < comm.size:
        comm._post(mine, (comm.rank + distance) % comm.size, theirs, (comm.rank - distance) % comm.size, header=True)
        torch.maximum(mine, theirs, out=mine)
        distance *= 2
    return [int(v) for v in mine.tolist()]


def max_all_reduce_gathering(comm: Communicator, values: Sequence[int], block: Sequence[torch.Tensor] | None
                             ) -> tuple[list[int], list[torch.Tensor] | None, list[BlockStep]]:
    """:func:`max_all_reduce` whose frames also all-gather one *block* of bytes per rank.

    ``block``: this rank's payload, CPU tensors sent back to back as raw bytes, or ``None``. Returns (the
    maxima, every rank's block as a ``uint8`` tensor in rank order, the payload moved per step). The
    blocks come back only when every rank passed one (a rank that passed none differs in what the
    caller's header says, so no verdict lets them be used). The other ranks' blocks are views into the
    receive buffers: they hold until ``comm``'s next reduction or :func:`post_receives_ahead`.

    Cost per rank: ceil(log2 P) messages of 8 (2 + m + V) bytes of header plus the blocks, which are
    those of :func:`~.sparse_collectives.allgatherv_traffic`."""
    mine = torch.tensor(list(values), dtype=_INT64)
    held: dict[int, torch.Tensor] | None = None  # rank -> its block
    if block is not None:
        held = {comm.rank: torch.cat([as_bytes(t) for t in block]) if len(block) != 1 else as_bytes(block[0])}
    moved: list[BlockStep] = []
    for number, step in enumerate(steps(comm)):
        outgoing = [] if held is None else [held[q] for q in step.sends]
        theirs, incoming = _step(comm, mine, outgoing, step.dst, step.src, number)
        torch.maximum(mine, theirs, out=mine)
        if held is not None:
            if len(incoming) == len(step.receives):
                held.update(zip(step.receives, incoming, strict=True))
            else:  # a rank on the way passed no block
                held = None
        moved.append(BlockStep(step.dst, sum(_nbytes(b) for b in outgoing), step.src,
                               sum(_nbytes(b) for b in incoming)))
    gathered = None if held is None else [held[q] for q in range(comm.size)]
    return [int(v) for v in mine.tolist()], gathered, moved


def max_all_reduce_carrying(comm: Communicator, values: Sequence[int], payload: Sequence[torch.Tensor] | None,
                            next_message: Callable[[int, list[torch.Tensor]], Sequence[torch.Tensor]],
                            settled: Callable[[list[int]], bool]
                            ) -> tuple[list[int], list[torch.Tensor] | None, list[BlockStep]]:
    """:func:`max_all_reduce` whose every frame also carries one of the caller's messages (CPU tensors,
    each one block of raw bytes), where :func:`carries_messages` says the caller's steps are these.

    ``payload``: the first step's message (``None``: this rank sends none). ``next_message(step,
    received)`` makes the message of step 1, 2, ... from what the previous step received (``uint8``
    views into the receive buffers). It is called only while the received message is usable: the
    sender passed as many tensors as this rank, and ``settled(maxima so far)`` holds for the running
    maxima of the ranks that shaped it and this rank's (the caller's verdict on the ranks seen so
    far). Once a step is not usable this rank sends no more tensors, and the caller's final verdict
    stops every rank: a message from a rank in another collective is never handed on.

    Returns (the maxima, the last step's received tensors or ``None`` when not usable, the payload
    moved per step). Cost per rank: log2 P messages of 8 (2 + m + V) bytes of header plus the caller's
    messages (which the caller books as its own)."""
    mine = torch.tensor(list(values), dtype=_INT64)
    outgoing = None if payload is None else [as_bytes(t) for t in payload]
    received: list[torch.Tensor] | None = None
    moved: list[BlockStep] = []
    for number, step in enumerate(steps(comm)):
        if number:
            outgoing = None if received is None else [as_bytes(t) for t in next_message(number, received)]
        blocks = outgoing or []
        theirs, incoming = _step(comm, mine, blocks, step.dst, step.src, number)
        torch.maximum(mine, theirs, out=mine)
        usable = outgoing is not None and len(incoming) == len(outgoing) and settled(mine.tolist())
        received = incoming if usable else None
        moved.append(BlockStep(step.dst, sum(_nbytes(b) for b in blocks), step.src, sum(_nbytes(b) for b in incoming)))
    return [int(v) for v in mine.tolist()], received, moved


def post_receives_ahead(comm: Communicator) -> None:
    """Post the receives of ``comm``'s next framed reduction now, each into its step's buffer, so that a
    peer's frame finds its receive waiting: on gloo a message moves once both sides have posted, and a
    receive posted only when the step begins costs the sender a wait for the receiver's notice. A
    call that works on its gradient before it agrees (:mod:`sparsecomm.methods.runner`) posts them as
    it begins; it receives nothing else before its agreement, so no other receive from those ranks can
    take a peer's frame first. The next reduction's steps consume them; one left over by a call that
    failed inside its agreement stays posted (torch cannot cancel a receive) and is the next
    reduction's. Only with frames (:attr:`Communicator.short_receives`); elsewhere it does nothing."""
    if not comm.short_receives or comm.size == 1:
        return
    channel = _channel(comm)
    for number, step in enumerate(channel.steps):
        if number not in channel.posted:
            channel.posted[number] = (step.src, comm._irecv(channel.buffer(number), step.src))


def posted_ahead(comm: Communicator) -> int:
    """How many receives of ``comm``'s next reduction are posted already."""
    return len(_channel(comm).posted)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 8 (the blocks of a frame stay aligned)."""
    return -(-nbytes // 8) * 8


def _frame(mine: torch.Tensor, outgoing: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int, list[int]]:
    """(the frame, its header bytes, the padded block sizes) of ``mine`` and the ``outgoing`` blocks."""
    padded = [_padded(_nbytes(b)) for b in outgoing]
    prefix = torch.tensor([mine.numel(), len(outgoing), *(_nbytes(b) for b in outgoing)], dtype=_INT64)
    head = prefix.numel() * _INT64.itemsize + _nbytes(mine)
    message = torch.empty(head + sum(padded), dtype=torch.uint8)
    message[:prefix.numel() * 8] = prefix.view(torch.uint8)
    message[prefix.numel() * 8:head] = mine.view(torch.uint8)
    offset = head
    for b, size in zip(outgoing, padded, strict=True):
        message[offset:offset + _nbytes(b)] = b
        message[offset + _nbytes(b):offset + size] = 0
        offset += size
    return message, head, padded


def _step(comm: Communicator, mine: torch.Tensor, outgoing: Sequence[torch.Tensor], dst: int, src: int,
          number: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step of a framed reduction: send ``mine`` and the ``outgoing`` blocks to ``dst``; return what
    ``src`` sent (its maxima, its blocks as ``uint8`` views)."""
    channel = _channel(comm)
    message, head, padded = _frame(mine, outgoing)
    send_first, send_rest = (message, None) if message.numel() <= EAGER_LIMIT_BYTES \
        else (message[:head], message[head:])
    buffer = channel.buffer(number)
    posted = channel.posted.pop(number, None)
    if posted is not None and posted[0] != src:  # the steps are fixed by (rank, size): a bug
        raise RuntimeError(f"control step {number}: a receive from rank {posted[0]} was posted, the step "
                           f"receives from rank {src}")
    comm._post(send_first, dst, buffer, src, header=False, book=False, posted=None if posted is None else posted[1])
    counts = buffer[:16].view(_INT64).tolist()
    if counts[0] != mine.numel():
        raise RuntimeError(f"agreement: rank {src} sent {counts[0]} values where this rank has {mine.numel()} "
                           "(the ranks are in different collectives)")
    sizes = buffer[16:16 + 8 * counts[1]].view(_INT64).tolist()
    their_head = 8 * (2 + counts[1]) + _nbytes(mine)
    theirs = buffer[16 + 8 * counts[1]:their_head].view(_INT64).clone()
    body_bytes = sum(_padded(s) for s in sizes)
    second = their_head + body_bytes > EAGER_LIMIT_BYTES  # the blocks follow in a message of their own
    body = torch.empty(body_bytes, dtype=torch.uint8) if second else buffer[their_head:their_head + body_bytes]
    if send_rest is not None or second:
        comm._post(send_rest, dst if send_rest is not None else None, body if second else None,
                   src if second else None, header=False, book=False)
    comm.meter.record_send(head + sum(padded) - sum(_nbytes(b) for b in outgoing), header=True,
                           inter_node=comm.is_inter_node(dst))
    comm.meter.record_recv(their_head + body_bytes - sum(sizes), header=True, inter_node=comm.is_inter_node(src))
    blocks, offset = [], 0
    for size in sizes:
        blocks.append(body[offset:offset + size])
        offset += _padded(size)
    return theirs, blocks
