"""Traffic meter: bytes, messages and rounds of every communication, booked per named phase.

Every point-to-point call of :class:`sparsecomm.transport.comm.Communicator` reports to the meter, so what a
method really sends can be compared with its cost formula (``sparsecomm.core.cost``).

Vocabulary
----------
payload bytes
    The bytes of the tensors a method asked to move.
header bytes
    The small int64 size headers that :meth:`Communicator.exchange` sends with (gloo, MPI) or before
    (NCCL) a payload whose size the receiver does not know. Booked apart so payloads compare exactly
    with cost formulas; a header is never counted as a message of its own.
inter-node bytes
    The payload bytes whose other end is a rank on another node (the node map is the environment's,
    ``LOCAL_WORLD_SIZE``, see :mod:`~sparsecomm.transport.nodemap`): what crosses the node's NIC.
    They are part of the payload bytes; intra-node bytes are the rest.
round
    One latency term (alpha) of the alpha-beta model: one ``sendrecv``/``exchange`` call, in which a
    rank sends at most one message and receives at most one message, concurrently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

__all__ = ["PhaseTraffic", "TrafficMeter"]


@dataclass
class PhaseTraffic:
    """Traffic of one rank in one phase."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    header_bytes_sent: int = 0
    header_bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    rounds: int = 0
    inter_node_bytes_sent: int = 0
    inter_node_bytes_recv: int = 0

    @property
    def intra_node_bytes_sent(self) -> int:
        return self.bytes_sent - self.inter_node_bytes_sent

    @property
    def intra_node_bytes_recv(self) -> int:
        return self.bytes_recv - self.inter_node_bytes_recv

    def add(self, other: PhaseTraffic) -> None:
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def minus(self, other: PhaseTraffic) -> PhaseTraffic:
        return PhaseTraffic(**{name: getattr(self, name) - getattr(other, name) for name in _FIELDS})

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _FIELDS}


#: the fields a sent and a received message add to (header bytes, bytes, messages, inter-node bytes)
_SENT = ("header_bytes_sent", "bytes_sent", "messages_sent", "inter_node_bytes_sent")
_RECEIVED = ("header_bytes_recv", "bytes_recv", "messages_recv", "inter_node_bytes_recv")

#: PhaseTraffic's counters (``dataclasses.fields`` once, not at every call: the meter is read several
#: times in every method call)
_FIELDS = tuple(f.name for f in fields(PhaseTraffic))


class TrafficMeter:
    """Counts this rank's traffic per phase. Phases nest: the innermost name is booked."""

    DEFAULT_PHASE = "other"

    def __init__(self) -> None:
        self._phases: dict[str, PhaseTraffic] = {}
        self._stack: list[str] = []
        self._total = PhaseTraffic()  # every phase's, kept as booked: a method call reads it several times

    @property
    def current_phase(self) -> str:
        return self._stack[-1] if self._stack else self.DEFAULT_PHASE

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book all traffic inside the ``with`` block to phase ``name``."""
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def _entry(self) -> PhaseTraffic:
        name = self.current_phase
        entry = self._phases.get(name)
        if entry is None:
            entry = self._phases[name] = PhaseTraffic()
        return entry

    def record_round(self) -> None:
        self._entry().rounds += 1
        self._total.rounds += 1

    def record_send(self, nbytes: int, header: bool = False, inter_node: bool = False) -> None:
        """Book one sent message; ``inter_node``: its receiver is on another node."""
        self._book(_SENT, nbytes, header, inter_node)

    def record_recv(self, nbytes: int, header: bool = False, inter_node: bool = False) -> None:
        """Book one received message; ``inter_node``: its sender is on another node."""
        self._book(_RECEIVED, nbytes, header, inter_node)

    def _book(self, names: tuple[str, str, str, str], nbytes: int, header: bool, inter_node: bool) -> None:
        """Add one message to this phase's entry and to the total; ``names``: its direction's header
        bytes, bytes, messages and inter-node bytes fields (every message of every method books here)."""
        header_bytes, payload_bytes, messages, inter_node_bytes = names
        for entry in (self._entry(), self._total):
            if header:
                setattr(entry, header_bytes, getattr(entry, header_bytes) + nbytes)
                continue
            setattr(entry, payload_bytes, getattr(entry, payload_bytes) + nbytes)
            setattr(entry, messages, getattr(entry, messages) + 1)
            if inter_node:
                setattr(entry, inter_node_bytes, getattr(entry, inter_node_bytes) + nbytes)

    def phases(self) -> dict[str, PhaseTraffic]:
        """A copy of the per-phase traffic."""
        out = {}
        for name, traffic in self._phases.items():
            copy = PhaseTraffic()
            copy.add(traffic)
            out[name] = copy
        return out

    def totals(self) -> PhaseTraffic:
        """The traffic of all phases added up (a copy)."""
        total = PhaseTraffic()
        total.add(self._total)
        return total

    def snapshot(self) -> PhaseTraffic:
        """A mark to measure from: ``meter.since(mark)`` is the traffic after it."""
        return self.totals()

    def since(self, mark: PhaseTraffic) -> PhaseTraffic:
        return self.totals().minus(mark)

    def reset(self) -> None:
        self._phases.clear()
        self._total = PhaseTraffic()
