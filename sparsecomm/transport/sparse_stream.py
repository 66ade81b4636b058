"""SparCML's sparse streams and their dynamic sparse all-reduce (Renggli et al., SC'19, section 4:
"sparse streams" with a switch to a dense representation, and Algorithm SSAR_Recursive_double).

A :class:`Stream` is a vector of ``N`` rows of ``width`` values (``width`` = 1 for a flat gradient,
the embedding dimension for row-sparse embedding gradients), held either *sparse* (sorted unique row
indices and their rows) or *dense* (all N rows). Adding two streams adds by index; the sum switches
to dense as soon as its sparse form would take more bytes than the dense one (the break-even point,
:func:`dense_switch_count`), and stays dense from then on.

:func:`dsa_allreduce` is the recursive-doubling all-reduce of one stream per rank: at step mask =
1, 2, ..., p'/2 each rank exchanges its current stream with rank ``r ^ mask`` and adds. For P not a
power of two, the usual fold: the even rank of each of the first ``rem`` = P - p' pairs hands its
stream to the odd one first and receives the result last. Every addition is of two operands, a + b
on one rank and b + a on its partner, so every rank ends with the same bits.

On the wire a message is ``(indices, values)`` in one packed payload; a dense stream travels as an
empty index tensor and all N*width values, so the receiver tells the two apart without extra bytes.

:func:`split_allreduce` is SparCML's large-message variant (SSAR_Split_allgather): the index space is
cut into P near-equal partitions, each rank sends its part of partition q to rank q (an all-to-all,
:func:`~.alltoallv.alltoallv`), rank q adds the P parts, and the P partial sums, sparse or dense each,
are all-gathered (:func:`~.sparse_collectives.allgatherv`). Cost: P - 1 + ceil(log2 P) rounds;
:func:`split_cost` bounds the bytes.

Cost (:func:`dsa_traffic`): log2 p' rounds (+2 when P is not a power of two); the bytes of a message
of m rows are ``min(m (s_idx + width s_val), N width s_val)``. The replay assumes the supports of the
ranks are disjoint (a union has as many rows as its parts together, capped at N), which makes it an
upper bound in general and exact for disjoint supports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.cost import Cost, chunk_offsets
from .alltoallv import alltoallv, alltoallv_traffic
from .chunk import index_dtype
from .collectives import fold_roles
from .comm import Communicator
from .merge import merge_sum
from .sparse_collectives import allgatherv, allgatherv_traffic

__all__ = ["Stream", "dense_switch_count", "stream_bytes", "add_streams", "dsa_allreduce", "dsa_traffic",
           "dsa_cost", "dense_switch_step", "split_allreduce", "split_cost"]


def dense_switch_count(N: int, width: int = 1, value_size: int = 4) -> int:
    """The fewest rows m whose sparse form (m indices + m*width values) takes more bytes than the
    dense form (N*width values): streams of this many rows or more are held dense."""
    pair = index_dtype(N).itemsize + width * value_size
    return (N * width * value_size) // pair + 1


def stream_bytes(m: int, N: int, width: int = 1, value_size: int = 4) -> int:
    """Payload bytes of a stream of m rows (out of N) under the break-even rule."""
    if m >= dense_switch_count(N, width, value_size):
        return N * width * value_size
    return m * (index_dtype(N).itemsize + width * value_size)


@dataclass
class Stream:
    """N rows of ``width`` values: sparse (``indices`` sorted unique, ``values`` (m, width)) or dense
    (``indices`` None, ``values`` (N, width))."""

    N: int
    values: Tensor
    indices: Tensor | None = None

    @property
    def dense(self) -> bool:
        return self.indices is None

    @property
    def width(self) -> int:
        return self.values.shape[1]

    @property
    def rows(self) -> int:
        """Rows held: m for a sparse stream, N for a dense one."""
        return self.N if self.indices is None else self.indices.numel()

    @classmethod
    def sparse(cls, N: int, indices: Tensor, values: Tensor, width: int = 1) -> Stream:
        """A sparse stream of ``indices`` (unique, any order) and their rows (``values`` of m*width
        elements), switched to dense right away when past the break-even point. Indices already in
        increasing order (as most selectors return them) are taken as they are, after one compare."""
        rows = values.reshape(indices.numel(), width)
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            order = torch.argsort(indices)
            rows, indices = rows[order], indices[order]
        else:
            rows = rows.clone()  # the stream owns its rows either way
        return cls(N, rows, indices.to(index_dtype(N))).settle()

    def settle(self) -> Stream:
        """Switch to dense when the sparse form is past the break-even point."""
        if self.indices is not None and self.indices.numel() >= dense_switch_count(N=self.N, width=self.width,
                                                                                  value_size=self.values.element_size()):
            return Stream(self.N, self.to_dense())
        return self

    def to_dense(self) -> Tensor:
        """The (N, width) dense rows."""
        if self.indices is None:
            return self.values
        out = torch.zeros(self.N, self.width, dtype=self.values.dtype, device=self.values.device)
        out.index_add_(0, self.indices.long(), self.values)
        return out

    def nbytes(self) -> int:
        own = self.values.numel() * self.values.element_size()
        return own + (0 if self.indices is None else self.indices.numel() * self.indices.element_size())

    def parts(self) -> list[Tensor]:
        """What travels: (indices, flat values); a dense stream sends an empty index tensor."""
        idx = self.indices if self.indices is not None \
            else torch.empty(0, dtype=index_dtype(self.N), device=self.values.device)
        return [idx, self.values.reshape(-1)]

    @classmethod
    def from_parts(cls, N: int, width: int, indices: Tensor, values: Tensor) -> Stream:
        if indices.numel() == 0 and values.numel() == N * width and values.numel() > 0:
            return cls(N, values.reshape(N, width))
        return cls(N, values.reshape(indices.numel(), width), indices)


def add_streams(a: Stream, b: Stream) -> Stream:
    """a + b by index; ``add_streams(a, b)`` and ``add_streams(b, a)`` have the same bits."""
    if a.dense or b.dense:
        dense, other = (a, b) if a.dense else (b, a)
        if other.dense:
            return Stream(a.N, a.values + b.values)
        out = dense.values.clone()
        assert other.indices is not None
        out.index_add_(0, other.indices.long(), other.values)
        return Stream(a.N, out)
    assert a.indices is not None and b.indices is not None
    if a.width == 1:  # both sorted: a merge, no sort (the same bits as below)
        merged = merge_sum([a.indices, b.indices], [a.values.reshape(-1), b.values.reshape(-1)])
        if merged is not None:
            return Stream(a.N, merged[1].reshape(-1, 1), merged[0]).settle()
    indices = torch.cat([a.indices, b.indices])
    if indices.numel() == 0:
        return a
    unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), a.width, dtype=a.values.dtype, device=a.values.device)
    summed.index_add_(0, inverse[:a.indices.numel()], a.values)
    summed.index_add_(0, inverse[a.indices.numel():], b.values)
    return Stream(a.N, summed, unique).settle()


def _swap(comm: Communicator, dst: int | None, stream: Stream | None, src: int | None, N: int, width: int,
          dtype: torch.dtype, device) -> Stream | None:
    """One round: send ``stream`` to ``dst`` (if any) while receiving a stream from ``src`` (if any)."""
    got = comm.exchange_many(dst, [] if stream is None else stream.parts(), src,
                             count=0 if src is None else 2,
                             dtypes=[] if src is None else [index_dtype(N), dtype], device=device)
    return None if src is None else Stream.from_parts(N, width, got[0], got[1])


def dsa_allreduce(comm: Communicator, stream: Stream) -> tuple[Stream, list[str]]:
    """The sum over ranks of ``stream`` (every rank passes N, width and dtype alike), by recursive
    doubling with the fold for non-powers of two. Returns the sum and, per round in which this rank
    sends, the representation it sent (``"sparse"`` / ``"dense"``)."""
    P, r = comm.size, comm.rank
    sent: list[str] = []
    if P == 1:
        return stream, sent
    args = (stream.N, stream.width, stream.values.dtype, stream.values.device)
    p2, rem, me = fold_roles(P, r)
    current = stream
    folded = bool(rem) and r < 2 * rem
    if folded and me < 0:
        sent.append("dense" if current.dense else "sparse")
        _swap(comm, r + 1, current, None, *args)
    elif folded:
        received = _swap(comm, None, None, r - 1, *args)
        assert received is not None
        current = add_streams(current, received)
    if me >= 0:
        mask = 1
        while mask < p2:
            partner_new = me ^ mask
            partner = 2 * partner_new + 1 if partner_new < rem else partner_new + rem
            sent.append("dense" if current.dense else "sparse")
            received = _swap(comm, partner, current, partner, *args)
            assert received is not None
            current = add_streams(current, received)
            mask *= 2
    if folded and me < 0:
        received = _swap(comm, None, None, r + 1, *args)
        assert received is not None
        current = received
    elif folded:
        sent.append("dense" if current.dense else "sparse")
        _swap(comm, r - 1, current, None, *args)
    return current, sent


def _group_counts(counts: Sequence[int], P: int, N: int) -> list[int]:
    """Rows held by each rank of the doubling phase (after the fold), assuming disjoint supports."""
    p2, rem, _ = fold_roles(P, 0)
    held = []
    for new in range(p2):
        held.append(counts[2 * new] + counts[2 * new + 1] if new < rem else counts[new + rem])
    return [min(c, N) for c in held]


def dsa_traffic(counts: Sequence[int], N: int, rank: int, width: int = 1,
                value_size: int = 4) -> tuple[int, int, int, list[str]]:
    """(rounds, bytes sent, bytes received, representation sent per step) of ``rank`` in
    :func:`dsa_allreduce` when rank q's stream has ``counts[q]`` rows and the supports are disjoint."""
    P = len(counts)
    if P == 1:
        return 0, 0, 0, []
    p2, rem, me = fold_roles(P, rank)

    def nbytes(m: int) -> int:
        return stream_bytes(min(m, N), N, width, value_size)

    def kind(m: int) -> str:
        return "dense" if min(m, N) >= dense_switch_count(N, width, value_size) else "sparse"

    held = _group_counts(counts, P, N)
    rounds = sent = recv = 0
    kinds: list[str] = []
    folded = bool(rem) and rank < 2 * rem
    if folded:
        rounds += 1
        if me < 0:
            sent += nbytes(counts[rank])
            kinds.append(kind(counts[rank]))
        else:
            recv += nbytes(counts[rank - 1])
    if me >= 0:
        # disjoint supports: a group's stream holds the sum of its members' rows (a stream that went
        # dense had at least the break-even count, so its unions are dense too)
        mask = 1
        while mask < p2:
            base_mine, base_theirs = me & ~(mask - 1), (me ^ mask) & ~(mask - 1)
            mine = sum(held[base_mine:base_mine + mask])
            theirs = sum(held[base_theirs:base_theirs + mask])
            sent += nbytes(mine)
            recv += nbytes(theirs)
            kinds.append(kind(mine))
            rounds += 1
            mask *= 2
    if folded:
        rounds += 1
        total = sum(counts)
        if me < 0:
            recv += nbytes(total)
        else:
            sent += nbytes(total)
            kinds.append(kind(total))
    return rounds, sent, recv, kinds


def dsa_cost(counts: Sequence[int], N: int, rank: int, width: int = 1, value_size: int = 4,
             disjoint: bool = False) -> Cost:
    """Cost of :func:`dsa_allreduce`: exact for disjoint supports, an upper bound otherwise."""
    rounds, sent, recv, _ = dsa_traffic(counts, N, rank, width, value_size)
    return Cost(rounds, sent, recv, exact=disjoint)


def dense_switch_step(counts: Sequence[int], N: int, rank: int, width: int = 1, value_size: int = 4) -> int | None:
    """The first step (0-based, counting every round this rank sends in) at which ``rank`` sends a
    dense stream, for disjoint supports; None when it never does."""
    kinds = dsa_traffic(counts, N, rank, width, value_size)[3]
    return next((i for i, k in enumerate(kinds) if k == "dense"), None)


# ---------------------------------------------------------------------- split all-gather
def _partition(stream: Stream, lo: int, size: int) -> Stream:
    """Rows [lo, lo + size) of ``stream`` as a stream of ``size`` rows (local indices)."""
    if stream.indices is None:
        return Stream(size, stream.values[lo:lo + size]).settle() if size else Stream(0, stream.values[:0])
    idx = stream.indices.long()
    a, b = (int(v) for v in torch.searchsorted(idx, torch.tensor([lo, lo + size], device=idx.device)))
    return Stream(size, stream.values[a:b], (idx[a:b] - lo).to(index_dtype(max(size, 1)))).settle()


def split_allreduce(comm: Communicator, stream: Stream) -> Stream:
    """The sum over ranks of ``stream`` by SparCML's split all-gather (see the module docstring)."""
    P, r = comm.size, comm.rank
    if P == 1:
        return stream
    N, width, dtype, device = stream.N, stream.width, stream.values.dtype, stream.values.device
    bounds = chunk_offsets(N, P)
    pieces = [_partition(stream, lo, size) for lo, size in bounds]
    lo, size = bounds[r]
    received = alltoallv(comm, [piece.parts() for piece in pieces], [index_dtype(max(size, 1)), dtype], device)
    mine = Stream.from_parts(size, width, *received[0]) if size else Stream(0, stream.values[:0])
    for q in range(1, P):
        if size:
            mine = add_streams(mine, Stream.from_parts(size, width, *received[q]))
    gathered = allgatherv(comm, mine.parts())
    partials = [Stream.from_parts(c, width, *parts) if c else None
                for (_, c), parts in zip(bounds, gathered, strict=True)]
    rows = sum(p.rows for p in partials if p is not None)
    if any(p is not None and p.dense for p in partials) or rows >= dense_switch_count(N, width, dtype.itemsize):
        out = torch.zeros(N, width, dtype=dtype, device=device)
        for (start, c), part in zip(bounds, partials, strict=True):
            if part is not None:
                out[start:start + c] = part.to_dense()
        return Stream(N, out)
    held = [(start, part) for (start, _), part in zip(bounds, partials, strict=True) if part is not None]
    indices = torch.cat([part.indices.to(index_dtype(N)) + start for start, part in held
                         if part.indices is not None])
    values = torch.cat([part.values for _, part in held])
    return Stream(N, values, indices)


def split_cost(counts: Sequence[int], N: int, rank: int, width: int = 1, value_size: int = 4) -> Cost:
    """Upper bound on the traffic of :func:`split_allreduce` when rank q's stream has ``counts[q]``
    rows: each part of partition q holds at most min(count, size of q) rows, each partial sum at most
    min(sum of counts, size of q)."""
    P = len(counts)
    if P == 1:
        return Cost(0, 0, 0)
    sizes = [c for _, c in chunk_offsets(N, P)]
    parts = [[stream_bytes(min(counts[s], c), c, width, value_size) if c else 0 for c in sizes] for s in range(P)]
    r1, s1, v1 = alltoallv_traffic(parts, rank)
    partials = [stream_bytes(min(sum(counts), c), c, width, value_size) if c else 0 for c in sizes]
    r2, s2, v2 = allgatherv_traffic(partials, rank)
    return Cost(r1 + r2, s1 + s2, v1 + v2, exact=False)
