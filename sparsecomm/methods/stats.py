"""What one method call did, as one typed record: :class:`Stats`, defined once and summed once; and
:class:`PhaseTimer`, which times a call's phases into it.

Every method fills one ``Stats`` per call (``method.stats``); the DDP hook, the synchronizer, the
training loop, the benchmarks and the reports read it and add records up with :meth:`Stats.total`.
Method-specific figures (ExDyna's padding overhead, SparDL's teams, per-rank counts, ...) travel in
``extra``. Read access works like a dict too (``stats["bytes_sent"]``, ``dict(stats)``), so records
are easy to log and to save as JSON.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Stats", "PHASES", "PhaseTimer"]

#: The timed phases of a call, each a ``time_<phase>`` field of :class:`Stats`.
PHASES = ("select", "comm", "decompress")


@dataclass
class Stats(Mapping[str, Any]):
    """One call's figures for this rank (or a sum of calls, see :meth:`total`).

    Attributes:
        n: gradient elements given to the method.
        selected: elements this rank selected to send (n for dense methods).
        nnz_out: non-zeros of the averaged output.
        bytes_sent, bytes_recv: payload bytes, metered (or modelled, see ``modelled_bytes``).
        header_bytes: size headers sent (metered apart from the payload).
        rounds: communication rounds (latency terms).
        time_select, time_comm, time_decompress, time_total: seconds.
        calls: method calls summed into this record (buckets of a step).
        dense_calls: calls synchronized densely (dense warm-up, small tensors).
        hidden_time: seconds of the call that ran behind backward (the overlapped hook sets it).
        inter_node_bytes_sent, inter_node_bytes_recv: the part of the payload bytes whose other end
            is on another node (crossing the node's NIC), by the meter's node map
            (``LOCAL_WORLD_SIZE``); the intra-node bytes are the rest.
        dense_fallback: the method's node hierarchy had a single node (all ranks on one machine),
            so it degenerated: hitopk's first stage is then a dense reduce-scatter over every rank,
            torus2d a flat ring all-reduce (the method also logs a warning when it is built).
        modelled_bytes: the bytes are the cost model's figure for a backend collective the meter
            cannot see (torch's native all-reduce), not metered.
        warmup: the call was a dense warm-up step.
        skipped: calls skipped on every rank because a rank's gradient held NaN/Inf (policy
            ``nonfinite="skip"``; ``extra["nonfinite_ranks"]`` names them).
        capped: calls whose selection the hard cap cut (0 or 1 for one call; summed over calls).
        cut: entries the hard cap removed from the selection (they stay in the residual).
        extra: method-specific figures of a single call (not summed).
    """

    n: int = 0
    selected: int = 0
    nnz_out: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    header_bytes: int = 0
    rounds: int = 0
    time_select: float = 0.0
    time_comm: float = 0.0
    time_decompress: float = 0.0
    time_total: float = 0.0
    calls: int = 1
    dense_calls: int = 0
    hidden_time: float = 0.0
    modelled_bytes: bool = False
    warmup: bool = False
    inter_node_bytes_sent: int = 0
    inter_node_bytes_recv: int = 0
    dense_fallback: bool = False
    skipped: int = 0
    capped: int = 0
    cut: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def density(self) -> float:
        """Output non-zeros over elements (0 for an empty call)."""
        return self.nnz_out / self.n if self.n else 0.0

    @property
    def density_sent(self) -> float:
        """Elements this rank selected to send over elements (0 for an empty call): the density reached."""
        return self.selected / self.n if self.n else 0.0

    @property
    def time_other(self) -> float:
        """Seconds of the call outside the timed phases (residual update, copies, bookkeeping)."""
        return max(0.0, self.time_total - self.time_select - self.time_comm - self.time_decompress)

    # ------------------------------------------------------------------ dict-style access
    def __getitem__(self, key: str) -> Any:
        if key in _FIELDS:
            return getattr(self, key)
        if key in _DERIVED:
            return getattr(self, key)
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _FIELDS:
            setattr(self, key, value)
        elif key in _DERIVED:
            raise KeyError(f"Stats.{key} is derived from the other fields and cannot be set")
        else:
            self.extra[key] = value

    def update(self, **figures: Any) -> None:
        """Set several fields or ``extra`` figures at once."""
        for key, value in figures.items():
            self[key] = value

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in _FIELDS if name != "extra")
        yield from _DERIVED
        yield from self.extra

    def __len__(self) -> int:
        return len(_FIELDS) - 1 + len(_DERIVED) + len(self.extra)

    # ------------------------------------------------------------------ adding up
    @classmethod
    def total(cls, records: Iterable[Stats]) -> Stats:
        """The sum of ``records`` (the buckets of a step, the steps of an epoch): counts, bytes and
        seconds add, flags are true when any record's is; ``extra`` is not summed."""
        out = cls(calls=0)
        for record in records:
            for name in _SUMMED:
                setattr(out, name, getattr(out, name) + getattr(record, name))
            out.modelled_bytes = out.modelled_bytes or record.modelled_bytes
            out.warmup = out.warmup or record.warmup
            out.dense_fallback = out.dense_fallback or record.dense_fallback
        return out


_FIELDS = tuple(f.name for f in fields(Stats))
_SUMMED = tuple(f.name for f in fields(Stats) if f.type in ("int", "float"))
_DERIVED = ("density", "density_sent", "time_other")


class PhaseTimer:
    """``with method.timer(phase):``: adds the block's wall time to ``times[phase]``. Nested blocks are
    exclusive: while an inner block runs (a selection inside the steps of a message timed as the comm),
    the outer one's clock stops, so every second is booked once. A plain class rather than a
    ``contextlib.contextmanager`` generator: a call enters a dozen of them, and a rank's CPU between
    messages delays its peers."""

    __slots__ = ("times", "phase", "start", "running")

    def __init__(self, times: dict[str, float], phase: str, running: list[PhaseTimer]) -> None:
        self.times, self.phase, self.running = times, phase, running

    def __enter__(self) -> None:
        now = time.perf_counter()
        if self.running:
            self.running[-1].stop(now)
        self.running.append(self)
        self.start = now

    def __exit__(self, *exc: object) -> None:
        now = time.perf_counter()
        self.running.pop()
        self.stop(now)
        if self.running:
            self.running[-1].start = now

    def stop(self, now: float) -> None:
        """Book the time since the block (re)started."""
        self.times[self.phase] = self.times.get(self.phase, 0.0) + now - self.start
