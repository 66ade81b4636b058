"""SparDL's Spar-Reduce-Scatter (SRS) and the block selection it repeats.

SparDL (Zhao et al.), section III-B. A team of m ranks splits the gradient into m blocks lined up in a
circle. Rank w keeps block w in its *preservation bag* B_0 and puts the following blocks into
l = ceil(log2 m) *sending bags*: B_1 = {w+1}, B_2 = {w+2, w+3}, ..., B_i = {w+2^(i-1) .. w+2^i-1},
the last one B_l holding the E = m - 2^(l-1) blocks that remain. At step i = 1..l rank w sends bag
B_(l-i+1) to rank w + 2^(l-i) and receives the same bag of rank w - 2^(l-i), whose blocks it still
holds (the paper's Theorem 1); it adds them into its own copies. Before each send, and only for the
blocks about to leave (the paper's "optimization for SRS"), it keeps the top-(k/m) entries of each
block; after the last step it selects the top-(k/m) of the one block it reduced.

The blocks live in one dense accumulator (the rank's gradient plus residual, :class:`Accumulator`,
which journals every change): a selection copies the chosen entries out and zeroes them there, so
what stays in the accumulator is exactly what this rank discarded (its local and in-procedure
residuals, Algorithm 1 line 7), and a received bag is added with one ``index_add_``. Messages carry
global int32/int64 indices and values in one packed payload.

Cost (Table I, eq. 2, per rank): ceil(log2 m) rounds; the rank sends every block but its own once,
so with equal blocks of k/m entries 2k(m-1)/m elements (indices and values). Blocks may hold fewer
non-zeros than k/m, so the bytes are an upper bound and the rounds exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ...core.cost import ceil_log2
from ...selection.scan import take_and_clear
from ...transport.chunk import SparseChunk, index_dtype
from ...transport.comm import Communicator
from ...transport.merge import ascending

__all__ = ["SrsStep", "srs_schedule", "Accumulator", "BlockSelector", "SparReduceScatter", "srs_traffic"]

SelectFn = Callable[[torch.Tensor, int], torch.Tensor]
Timer = Callable[[str], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class SrsStep:
    """One SRS transmission step of one rank: send ``send_blocks`` to ``dst`` while receiving
    ``recv_blocks`` (blocks this rank still holds) from ``src``."""

    dst: int
    src: int
    send_blocks: tuple[int, ...]
    recv_blocks: tuple[int, ...]


def _bag(m: int, w: int, bag: int) -> tuple[int, ...]:
    """Blocks of sending bag ``bag`` (1..l) of rank ``w`` in a team of ``m``."""
    first = w + (1 << (bag - 1))
    last = w + (1 << bag) - 1 if bag < ceil_log2(m) else w + m - 1  # the last bag holds E blocks
    return tuple(j % m for j in range(first, last + 1))


def srs_schedule(m: int, w: int) -> list[SrsStep]:
    """The l = ceil(log2 m) steps of rank ``w`` (bags sent from the largest, B_l, to B_1)."""
    levels = ceil_log2(m)
    steps = []
    for i in range(1, levels + 1):
        distance = 1 << (levels - i)
        bag = levels - i + 1
        src = (w - distance) % m
        steps.append(SrsStep((w + distance) % m, src, _bag(m, w, bag), _bag(m, src, bag)))
    return steps


class Accumulator:
    """SparDL's dense accumulator G, changed in place, with a journal of what changed.

    Algorithm 1 keeps a copy of G (line 3) to restore every entry outside the final gradient's
    indices (lines 13-15). Here G lives in the residual's buffer itself and every change records the
    entries' values before it (the selections' zeroing, the received bags' additions, the shares of
    SAG's discards), so :meth:`restore` brings back G in O(entries changed) instead of a copy and a
    zeroing of all n elements. One change needs no record: the last selection of the rank's own
    block when nothing changes G after it (one team, no SAG; :func:`spar_reduce_scatter`'s
    ``journal_own``). Of the entries it zeroes, those in the final gradient keep what this rank
    discarded there (zero) anyway, and the others held zero before it or are brought back to G by
    an earlier record. With no record at all (P = 1) G is the new residual as it stands.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._journal: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self, indices: torch.Tensor, before: torch.Tensor) -> None:
        """Note that the entries at int64 ``indices`` held ``before`` until the change about to happen."""
        self._journal.append((indices, before))

    def index_add_(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """``tensor[indices] += values`` (distinct indices), journaled."""
        idx = indices.long()
        self.record(idx, self.tensor.index_select(0, idx))
        self.tensor.index_add_(0, idx, values)

    @property
    def changed(self) -> bool:
        """Whether a change was recorded since the last :meth:`restore`."""
        return bool(self._journal)

    def restore(self) -> None:
        """Every journaled entry back to its value before the first change (latest change undone first)."""
        for indices, before in reversed(self._journal):
            self.tensor.index_copy_(0, indices, before)
        self._journal.clear()


class BlockSelector:
    """Top-c of a slice of the dense accumulator, taken out of it.

    ``selector=None`` is exact top-k by magnitude (``torch.topk``) through a reused scratch buffer;
    otherwise a callable ``selector(x, c) -> indices`` (the ``sparsecomm.selection`` contract). The
    selection must be deterministic: in Spar-All-Gather several ranks select from identical sums and
    must keep identical entries.
    """

    def __init__(self, selector: SelectFn | None = None) -> None:
        self.selector = selector
        self._scratch: torch.Tensor | None = None

    def indices(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """Local int64 indices of (at most) ``count`` entries of ``x`` largest in magnitude."""
        if count <= 0 or x.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=x.device)
        if count >= x.numel():
            return torch.arange(x.numel(), device=x.device)
        if self.selector is not None:
            return self.selector(x, count).long()
        scratch = self._scratch
        if scratch is None or scratch.numel() < x.numel() or scratch.dtype != x.dtype \
                or scratch.device != x.device:
            scratch = self._scratch = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        magnitude = torch.abs(x, out=scratch[:x.numel()])
        return torch.topk(magnitude, count, sorted=False).indices

    def take(self, work: Accumulator, start: int, size: int, count: int, *, journal: bool = True,
             picked: torch.Tensor | None = None) -> SparseChunk:
        """Move the top-``count`` entries of ``work[start:start+size]`` out of ``work``, in index order.

        Returns them as a chunk with global indices (zeros dropped: they carry nothing); ``work``
        keeps the rest, i.e. what this selection discarded. ``journal=False``: the change is not
        recorded (see :class:`Accumulator`). ``picked``: the block's local indices when they were
        selected already (in the scan that wrote the block, ``SparDL.accumulate``).
        """
        block = work.tensor[start:start + size]
        local = ascending(self.indices(block, count) if picked is None else picked.long())  # sorted: receivers merge
        values = take_and_clear(block, local)
        if journal:
            work.record(local + start, values)
        nonzero = values != 0
        if not bool(nonzero.all()):
            local, values = local[nonzero], values[nonzero]
        return SparseChunk((local + start).to(index_dtype(work.tensor.numel())), values)

    def split(self, chunk: SparseChunk, count: int) -> tuple[SparseChunk, SparseChunk]:
        """(the top-``count`` entries of ``chunk`` without zeros, the rest); both in index order."""
        if count >= chunk.nnz:
            kept, dropped = chunk, SparseChunk(chunk.indices[:0], chunk.values[:0])
        else:
            keep = torch.zeros(chunk.nnz, dtype=torch.bool, device=chunk.values.device)
            keep[self.indices(chunk.values, count)] = True
            kept, dropped = chunk.select(keep), chunk.select(~keep)
        nonzero = kept.values != 0
        if not bool(nonzero.all()):
            kept = kept.select(nonzero)
        return kept, dropped


def _no_timer(_: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class SparReduceScatter:
    """One call's SRS over ``comm`` (a team of m ranks), step by step.

    ``work`` is the dense accumulator (gradient + residual), modified in place: afterwards it holds
    every value this rank discarded. ``bounds[j]`` = (start, size) of block j, ``counts[j]`` = k/m,
    the entries block j may carry. ``picks``: {block: local indices} of blocks selected before any
    change to ``work`` (the first step's bag, or the own block of a team of one), taken as they are.
    ``journal_own=False`` leaves the selection of the own block out of ``work``'s journal, for a
    caller that changes ``work`` no more before it restores it (:class:`Accumulator`).

    The steps' messages are :meth:`message` (step i's, made from ``work``) and the received ones go
    into ``work`` by :meth:`add`; :meth:`exchange` sends them all over ``comm``, or a caller whose
    own messages go to the same ranks sends them (:meth:`next_message`, :meth:`add_last`: raw bytes).
    :meth:`own_block` ends the call: this rank's reduced block, top-(k/m).
    """

    def __init__(self, comm: Communicator, work: Accumulator, bounds: Sequence[tuple[int, int]],
                 counts: Sequence[int], blocks: BlockSelector, timer: Timer = _no_timer, *, journal_own: bool = True,
                 picks: Mapping[int, torch.Tensor] | None = None) -> None:
        self.comm, self.work, self.bounds, self.counts = comm, work, bounds, counts
        self.blocks, self.timer = blocks, timer
        self.journal_own = journal_own
        self.picks = dict(picks or {})
        self.schedule = srs_schedule(comm.size, comm.rank)
        self.index_type = index_dtype(work.tensor.numel())
        self.selected = 0  # entries this rank selected so far

    def message(self, number: int) -> list[torch.Tensor]:
        """Step ``number``'s message: the top entries of the blocks of its bag, taken out of ``work``."""
        with self.timer("select"):
            chunks = [self.blocks.take(self.work, *self.bounds[j], self.counts[j],
                                       picked=self.picks.get(j) if number == 0 else None)
                      for j in self.schedule[number].send_blocks]
            indices = torch.cat([c.indices for c in chunks])
            values = torch.cat([c.values for c in chunks])
            self.selected += indices.numel()
        return [indices, values]

    def add(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """A received bag, added into ``work``."""
        with self.timer("decompress"):
            self.work.index_add_(indices, values)

    def next_message(self, number: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        """Step ``number``'s message, once step ``number - 1``'s (raw bytes) is added."""
        self.add_last(received)
        return self.message(number)

    def add_last(self, received: list[torch.Tensor]) -> None:
        """A received message as raw bytes (``uint8`` indices, values), added into ``work``."""
        self.add(received[0].view(self.index_type), received[1].view(self.work.tensor.dtype))

    def exchange(self, first: list[torch.Tensor]) -> None:
        """Every step over ``comm`` (``comm.exchange_many``), step 0 sending ``first``."""
        dense = self.work.tensor
        for number, step in enumerate(self.schedule):
            message = first if number == 0 else self.message(number)
            with self.timer("comm"):
                got_indices, got_values = self.comm.exchange_many(step.dst, message, step.src, count=2,
                                                                  dtypes=[self.index_type, dense.dtype],
                                                                  device=dense.device)
            self.add(got_indices, got_values)

    def own_block(self) -> tuple[SparseChunk, int]:
        """(this rank's reduced block, entries selected in all), after the last step."""
        m, w = self.comm.size, self.comm.rank
        with self.timer("select"):
            own = self.blocks.take(self.work, *self.bounds[w], self.counts[w], journal=self.journal_own,
                                   picked=self.picks.get(w) if m == 1 else None)
            self.selected += own.nnz
        return own, self.selected


# ---------------------------------------------------------------------- traffic of the schedules
def srs_traffic(m: int, w: int, counts: Sequence[int], pair_bytes: int) -> tuple[int, int, int]:
    """Upper bound of (rounds, bytes sent, bytes received) of SRS for rank ``w``: every block sent
    carries at most ``counts[j]`` (index, value) pairs of ``pair_bytes`` bytes. Rounds are exact."""
    sent = recv = 0
    schedule = srs_schedule(m, w)
    for step in schedule:
        sent += sum(counts[j] for j in step.send_blocks)
        recv += sum(counts[j] for j in step.recv_blocks)
    return len(schedule), sent * pair_bytes, recv * pair_bytes
