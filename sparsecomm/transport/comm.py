"""Metered point-to-point transport over a ``torch.distributed`` process group.

Every collective of this library, dense or sparse, is built from :meth:`Communicator.sendrecv` and
:meth:`Communicator.exchange`, so the :class:`~sparsecomm.transport.meter.TrafficMeter` sees every byte and
every round. Tensors keep their device: the same code runs on gloo (CPU) and NCCL (CUDA).

Any dtype travels: payloads are sent as their raw bytes (a ``uint8`` view), so bf16, fp16 and int32
tensors move unchanged even where a backend lacks the dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .chunk import as_bytes, bytes_as
from .meter import TrafficMeter
from .nodemap import node_of, resolve_local_size

__all__ = ["Communicator", "AllgatherStep", "allgather_steps", "EAGER_LIMIT_BYTES"]

log = logging.getLogger(__name__)

_HEADER_DTYPE = torch.int64

#: Backends whose receive accepts a message shorter than the posted buffer (gloo checks only that the
#: message fits; MPI_Recv takes at most its count). NCCL needs equal counts on both sides.
_SHORT_RECEIVE_BACKENDS = ("gloo", "mpi")

#: An :meth:`Communicator.exchange_many` message of at most this many bytes (header included) travels
#: with its size header in one message on those backends; a larger one sends the header first.
EAGER_LIMIT_BYTES = 4 << 20


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class AllgatherStep(NamedTuple):
    """One step of an all-gather for one rank: send the blocks of ranks ``sends`` (in that order) to
    ``dst``, receive those of ranks ``receives`` from ``src``."""

    dst: int
    src: int
    sends: list[int]
    receives: list[int]


def allgather_steps(P: int, rank: int, bruck: bool = False) -> list[AllgatherStep]:
    """The schedule of the all-gathers of :mod:`.sparse_collectives` and of the control messages on gloo
    and MPI (:func:`.control.max_all_reduce_gathering`), ceil(log2 P) steps. For P a power of two (unless
    ``bruck``), halving distances: step D = P/2, P/4, ..., 1 sends everything held to rank r + D and
    receives everything rank r - D holds (SparDL's Spar-Reduce-Scatter follows the same partners).
    Otherwise Bruck's: step d = 1, 2, 4, ... sends the blocks of ranks r .. r + min(d, P - d) - 1 to
    rank r - d and receives as many from rank r + d."""
    steps = []
    if P & (P - 1) == 0 and not bruck:
        held, distance = [rank], P // 2
        while distance >= 1:
            theirs = [(q - distance) % P for q in held]
            steps.append(AllgatherStep((rank + distance) % P, (rank - distance) % P, held, theirs))
            held, distance = held + theirs, distance // 2
        return steps
    distance = 1
    while distance < P:
        count, src = min(distance, P - distance), (rank + distance) % P
        steps.append(AllgatherStep((rank - distance) % P, src, [(rank + j) % P for j in range(count)],
                                   [(src + j) % P for j in range(count)]))
        distance *= 2
    return steps


def _split_payload(payload: torch.Tensor, sizes: Sequence[int], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The tensors packed back to back in a received ``uint8`` payload, as views where aligned."""
    out: list[torch.Tensor] = []
    offset = 0
    for nbytes, dt in zip(sizes, dtypes, strict=False):
        out.append(bytes_as(payload[offset:offset + nbytes], dt))
        offset += nbytes
    return out


class Communicator:
    """The ranks of a process group (or a subset of them) and metered messages between them.

    Args:
        group: a ``torch.distributed`` process group; ``None`` is the default group.
        ranks: for sub-communicators made by :meth:`split`: the global ranks, in local-rank order.
            Point-to-point messages of a sub-communicator travel over ``group``.
        meter: shared with the parent on :meth:`split`, so one meter sees all of a rank's traffic.
        node_size: ranks per physical node, to tell inter-node bytes from intra-node bytes in the
            meter (global rank r is on node r // node_size). Default: ``LOCAL_WORLD_SIZE`` from the
            environment (torchrun and ``run_workers`` set it), else 1 (every message inter-node).
            Sub-communicators inherit it.
    """

    def __init__(self, group=None, *, ranks: Sequence[int] | None = None,
                 meter: TrafficMeter | None = None, node_size: int | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Communicator needs an initialized torch.distributed process group: call it inside "
                "sparsecomm.run_workers(...) or after torch.distributed.init_process_group(...)")
        self.group = group
        group_ranks = list(range(dist.get_world_size())) if group is None \
            else list(dist.get_process_group_ranks(group))
        self._ranks: list[int] = list(ranks) if ranks is not None else group_ranks
        me = dist.get_rank()
        if me not in self._ranks:
            raise ValueError(f"global rank {me} is not a member of ranks={self._ranks}")
        self.rank: int = self._ranks.index(me)
        self.size: int = len(self._ranks)
        self.is_whole_group = self._ranks == group_ranks
        self.meter = meter if meter is not None else TrafficMeter()
        self.node_size: int = resolve_local_size(dist.get_world_size(), node_size)
        self._my_node = node_of(me, self.node_size)
        # gloo reads and writes host memory only (a CUDA tensor aborts it): stage CUDA tensors through
        # host copies there; NCCL and other backends take device tensors as they are
        backend = dist.get_backend(group)
        self._host_staging = backend == "gloo"
        # one message per round for payloads of unknown size: the header rides in front of the payload
        self._eager_headers = backend in _SHORT_RECEIVE_BACKENDS
        #: source -> the receive posted ahead for its next exchange_many message (buffer, work): see post_receives
        self._ahead: dict[int, tuple[torch.Tensor, dist.Work | None]] = {}
        # point-to-point messages go to the process group itself (what dist.isend and dist.irecv call after
        # their checks, which cost a few tens of microseconds of a call's CPU per message): the group and
        # each local rank's rank in it
        pg = dist.group.WORLD if group is None else group
        assert pg is not None  # the default group exists: checked above
        self._pg: dist.ProcessGroup = pg
        self._pg_ranks = list(self._ranks) if group is None else \
            [dist.get_group_rank(group, r) for r in self._ranks]

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, ranks={self._ranks})"

    def global_rank(self, local_rank: int) -> int:
        """The ``torch.distributed`` rank of this communicator's ``local_rank``."""
        return self._ranks[local_rank % self.size]

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    def is_inter_node(self, local_rank: int) -> bool:
        """Whether a message to or from ``local_rank`` crosses this rank's node NIC."""
        return node_of(self.global_rank(local_rank), self.node_size) != self._my_node

    # ------------------------------------------------------------------ point to point
    def _post(self, send: torch.Tensor | None, dst: int | None,
              recv: torch.Tensor | None, src: int | None, header: bool, book: bool = True,
              posted: dist.Work | None = None) -> None:
        """Send and receive concurrently; book the bytes (unless ``book=False``: the caller books what
        the messages held); wait for both. ``posted``: the receive into ``recv`` (a CPU tensor) from
        ``src``, already posted (:func:`.control.post_receives_ahead`)."""
        works: list[dist.Work | None] = []
        landing = None  # (device tensor, host copy) of a staged receive
        if posted is not None:
            works.append(posted)
        elif recv is not None and recv.numel() > 0:
            assert src is not None, "a receive needs its source rank"
            target = recv
            if self._host_staging and recv.is_cuda:
                target = torch.empty(recv.shape, dtype=recv.dtype)
                landing = (recv, target)
            works.append(self._irecv(as_bytes(target) if target.dtype != torch.uint8 else target, src))
            if book:
                self.meter.record_recv(_nbytes(recv), header=header, inter_node=self.is_inter_node(src))
        if send is not None and send.numel() > 0:
            assert dst is not None, "a send needs its destination rank"
            payload = send.cpu() if self._host_staging and send.is_cuda else send
            works.append(self._isend(as_bytes(payload), dst))
            if book:
                self.meter.record_send(_nbytes(send), header=header, inter_node=self.is_inter_node(dst))
        for work in works:
            if work is not None:  # None only for a rank outside the group, which never gets here
                work.wait()
        if landing is not None:
            landing[0].copy_(landing[1])

    def _isend(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        """``dist.isend`` of a plain 1-D tensor to local rank ``dst``, straight to the process group."""
        return self._pg.send([tensor], self._pg_ranks[dst], 0)

    def _irecv(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """``dist.irecv`` into a plain 1-D tensor from local rank ``src``, straight to the process group."""
        return self._pg.recv([tensor], self._pg_ranks[src], 0)

    def sendrecv(self, send: torch.Tensor | None, dst: int | None,
                 recv: torch.Tensor | None, src: int | None) -> None:
        """One round: send ``send`` to local rank ``dst`` while receiving ``recv`` from ``src``.

        Sizes must be known on both sides. Either half may be ``None`` (send only / receive only).
        ``recv`` must be contiguous; it is filled in place. A rank exchanging with itself copies.
        """
        if recv is not None and not recv.is_contiguous():
            raise ValueError("sendrecv: the receive buffer must be contiguous")
        if send is not None and recv is not None and dst == self.rank and src == self.rank:
            recv.copy_(send.reshape(recv.shape))
            return
        self.meter.record_round()
        self._post(send, dst, recv, src, header=False)

    def exchange(self, dst: int | None, tensor: torch.Tensor | None, src: int | None,
                 *, dtype: torch.dtype | None = None, device=None) -> torch.Tensor | None:
        """One round for payloads whose size the receiver does not know.

        Sends ``tensor`` (1-D) to local rank ``dst`` and returns the 1-D tensor that ``src`` sent
        (same dtype as ``tensor`` unless ``dtype`` is given). A size header (one int64) travels with
        it (see :meth:`exchange_many`); it is booked as header bytes. ``dst=None`` receives only
        (``dtype`` then required); ``src=None`` sends only and returns ``None``.
        """
        if src is not None and dtype is None:
            if tensor is None:
                raise ValueError("exchange: receiving without sending needs dtype=")
            dtype = tensor.dtype
        dtypes = [] if src is None or dtype is None else [dtype]
        out = self.exchange_many(dst, [] if tensor is None else [tensor], src,
                                 count=len(dtypes), dtypes=dtypes, device=device)
        return out[0] if src is not None else None

    def exchange_many(self, dst: int | None, tensors: Sequence[torch.Tensor], src: int | None,
                      count: int, *, dtypes: Sequence[torch.dtype] | None = None,
                      device=None, recv_numels: Sequence[int] | None = None) -> list[torch.Tensor]:
        """One round moving a list of 1-D tensors as ONE packed payload message.

        The header carries the element count of each tensor, so the receiver, who must know how many
        tensors (``count``) and their dtypes (default: those of ``tensors``), can split the payload.
        Used for packed sparse messages (indices + values) of unknown length. On gloo and MPI the
        header travels in front of the payload, in the same message (:meth:`_exchange_eager`); on
        NCCL, whose receives need the exact size, it travels first, as a message of its own.

        ``recv_numels``: the element counts of the ``count`` incoming tensors, when the receiver knows
        them (e.g. every rank sends exactly k entries, a length the ranks agreed on). Then no header
        travels, in either direction: the round is one message. Every rank of the exchange must pass
        it, or none (the sender then sends no header either).
        """
        if dtypes is None:
            if len(tensors) < count:
                raise ValueError("exchange_many: pass dtypes= when receiving more tensors than sending")
            dtypes = [t.dtype for t in tensors[:count]]
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        if dst == self.rank and src == self.rank:
            return [t.clone() for t in tensors]
        self.meter.record_round()
        if recv_numels is None and self._eager_headers:
            return self._exchange_eager(dst, tensors, src, count, dtypes, device)
        if recv_numels is None:
            send_header = recv_header = None
            if dst is not None:
                send_header = torch.tensor([t.numel() for t in tensors], dtype=_HEADER_DTYPE, device=device)
            if src is not None:
                recv_header = torch.empty(count, dtype=_HEADER_DTYPE, device=device)
            self._post(send_header, dst, recv_header, src, header=True)
            numels = recv_header.tolist() if recv_header is not None else []
        else:
            if src is not None and len(recv_numels) != count:
                raise ValueError(f"exchange_many: recv_numels has {len(recv_numels)} entries, count={count}")
            numels = list(recv_numels) if src is not None else []

        send_payload = None
        if dst is not None and tensors:
            send_payload = torch.cat([as_bytes(t) for t in tensors]) if len(tensors) > 1 \
                else as_bytes(tensors[0])
        sizes = [int(m) * d.itemsize for m, d in zip(numels, dtypes, strict=False)]
        recv_payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device) if src is not None else None
        self._post(send_payload, dst, recv_payload, src, header=False)
        return _split_payload(recv_payload, sizes, dtypes) if recv_payload is not None else []

    def post_receives(self, sources: Sequence[int]) -> None:
        """Post now the receive of this rank's next :meth:`exchange_many` message from each of
        ``sources`` (a source named twice gets one: see below), into a buffer of
        :data:`EAGER_LIMIT_BYTES`, so that the peer's message moves as soon as it is sent instead of
        when this rank reaches that step (on gloo a message moves once both sides have posted, and a
        receive posted late costs a notification's round trip on the call's path). Only on gloo and
        MPI (:attr:`short_receives`), where a receive may be longer than its message;
        elsewhere it does nothing.

        The next message from each source must be an :meth:`exchange_many` of unknown size (the
        eager frame), which takes the receive. One per source: a frame past the limit sends its
        payload as a second message, which must find no other receive from that source posted before
        its own. For a method's messages after its agreement only (the ranks then follow one schedule
        to its end): a receive posted for a message that never comes (a call that fails after it,
        which leaves the method unusable, :class:`~sparsecomm.transport.deadline.ProtocolBroken`) would
        take the next message from that peer on the process group."""
        if not self._eager_headers:
            return
        for src in dict.fromkeys(sources):
            if src == self.rank or src in self._ahead:
                continue
            landing = torch.empty(EAGER_LIMIT_BYTES, dtype=torch.uint8)
            self._ahead[src] = (landing, self._irecv(landing, src))

    def _exchange_eager(self, dst: int | None, tensors: Sequence[torch.Tensor], src: int | None,
                        count: int, dtypes: Sequence[torch.dtype], device) -> list[torch.Tensor]:
        """:meth:`exchange_many` without a separate header message (gloo, MPI).

        Eager protocol: a message of at most :data:`EAGER_LIMIT_BYTES`, header included, travels as
        one message ``[header | payload]``; the receiver posts a buffer of that limit, reads the sizes
        from the header, and finds the payload behind it. A larger message sends the header alone
        first, then the payload, as before. Sender and receiver each decide from the sizes alone, so
        they agree without asking. The meter books the same header and payload bytes as the two-message
        protocol, and one message."""
        header_bytes = count * _HEADER_DTYPE.itemsize
        buffer_device = torch.device("cpu") if self._host_staging else torch.device(device)
        send_first = send_rest = None
        if dst is not None:
            header = torch.tensor([t.numel() for t in tensors], dtype=_HEADER_DTYPE)
            payload_bytes = sum(_nbytes(t) for t in tensors)
            pieces = [as_bytes(t.cpu() if t.device != buffer_device else t) for t in tensors]
            if header.numel() * _HEADER_DTYPE.itemsize + payload_bytes <= EAGER_LIMIT_BYTES:
                send_first = torch.cat([header.view(torch.uint8), *pieces])
            else:
                send_first = header.view(torch.uint8)
                send_rest = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            inter = self.is_inter_node(dst)
            self.meter.record_send(header.numel() * _HEADER_DTYPE.itemsize, header=True, inter_node=inter)
            if payload_bytes:
                self.meter.record_send(payload_bytes, inter_node=inter)
        receiving = src is not None and count > 0
        ahead = self._ahead.pop(src, None) if receiving and src is not None else None
        posted = None
        landing: torch.Tensor | None
        if ahead is not None:  # posted early (post_receives)
            landing, posted = ahead
        else:
            landing = torch.empty(EAGER_LIMIT_BYTES, dtype=torch.uint8, device=buffer_device) \
                if receiving else None
        self._post(send_first, dst, landing, src, header=False, book=False, posted=posted)

        sizes: list[int] = []
        payload = None
        if receiving:
            assert landing is not None
            numels = landing[:header_bytes].view(_HEADER_DTYPE).tolist()
            sizes = [int(m) * d.itemsize for m, d in zip(numels, dtypes, strict=False)]
            total = sum(sizes)
            if header_bytes + total <= EAGER_LIMIT_BYTES:
                payload = landing[header_bytes:header_bytes + total]
                landing = None  # arrived with the header
            else:
                landing = torch.empty(total, dtype=torch.uint8, device=buffer_device)
                payload = landing
            inter = src is not None and self.is_inter_node(src)
            self.meter.record_recv(header_bytes, header=True, inter_node=inter)
            if total:
                self.meter.record_recv(total, inter_node=inter)
        if send_rest is not None or landing is not None:
            self._post(send_rest, dst if send_rest is not None else None,
                       landing, src if landing is not None else None, header=False, book=False)
        if src is None:
            return []
        if payload is None:  # nothing to receive: count == 0
            return []
        if payload.device != torch.device(device):  # a staged receive, or one posted early (on the CPU)
            payload = payload.to(device)
        return _split_payload(payload, sizes, dtypes)

    # ------------------------------------------------------------------ groups
    def split(self, teams: int, mode: str = "consecutive") -> tuple[Communicator, Communicator]:
        """Divide the ranks into ``teams`` equal teams.

        Returns ``(team, cross)``: ``team`` holds this rank's team; ``cross`` links the ranks at the
        same position in every team. ``mode="consecutive"``: team t is local ranks
        ``t*m .. t*m+m-1`` (m = size/teams); ``mode="strided"``: team t is ranks ``t, t+teams, ...``.
        Both share this communicator's meter. No collective call is needed: messages still travel
        point to point over the parent's group.
        """
        if not isinstance(teams, int) or teams < 1 or self.size % teams != 0:
            raise ValueError(f"teams={teams!r} must be a positive integer dividing the size {self.size}")
        if mode not in ("consecutive", "strided"):
            raise ValueError(f"mode={mode!r} must be 'consecutive' or 'strided'")
        m = self.size // teams
        if mode == "consecutive":
            team_id, position = divmod(self.rank, m)
            team_local = [team_id * m + j for j in range(m)]
            cross_local = [t * m + position for t in range(teams)]
        else:
            position, team_id = divmod(self.rank, teams)
            team_local = [team_id + j * teams for j in range(m)]
            cross_local = [position * teams + t for t in range(teams)]
        team = Communicator(self.group, ranks=[self._ranks[r] for r in team_local], meter=self.meter,
                            node_size=self.node_size)
        cross = Communicator(self.group, ranks=[self._ranks[r] for r in cross_local], meter=self.meter,
                             node_size=self.node_size)
        return team, cross

    # ------------------------------------------------------------------ native collectives
    def _require_whole_group(self, what: str) -> None:
        if not self.is_whole_group:
            raise RuntimeError(f"{what} needs a communicator spanning its whole process group; "
                               f"this one holds ranks {self._ranks}")

    def takes_as_is(self, tensor: torch.Tensor) -> bool:
        """Whether the backend's collectives take ``tensor`` where it lives (gloo: host memory only;
        a CUDA tensor is staged through a host copy by this communicator's own calls)."""
        return not (self._host_staging and tensor.is_cuda)

    def native_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """torch.distributed's own all_reduce (sum), in place. Its bytes are the backend's business:
        the meter books one round and no bytes (see ``costmodel`` for the model's figure)."""
        self._require_whole_group("native_all_reduce")
        self.meter.record_round()
        if self._host_staging and tensor.is_cuda:
            staged = tensor.cpu()
            dist.all_reduce(staged, group=self.group)
            tensor.copy_(staged)
        else:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    @property
    def short_receives(self) -> bool:
        """Whether a receive takes a message shorter than its buffer (gloo and MPI; NCCL needs equal
        counts on both sides): a message can then carry its own size (:meth:`exchange_many`), and the
        agreement's control messages a payload (:mod:`.control`)."""
        return self._eager_headers

    def barrier(self) -> None:
        self._require_whole_group("barrier")
        dist.barrier(group=self.group)
