"""Dense collectives built from metered point-to-point messages, each for any number of workers P.

Every function takes a :class:`~sparsecomm.transport.comm.Communicator` and a 1-D tensor, and leaves the
input untouched. Each reduction is computed by exactly one rank and then copied, so every rank holds
the same result bit for bit. The cost formula of each algorithm sits beside it; ``tests`` check the
meter against it to the byte.

Notation: P ranks, n elements of ``s`` bytes, chunks ``c_i`` = :func:`~sparsecomm.core.cost.chunk_sizes`,
p' = the largest power of two <= P, ``rem`` = P - p'.
"""

from __future__ import annotations

import torch

from ..core.cost import ZERO, Cost, chunk_offsets, chunk_sizes, register_collective_cost
from .comm import Communicator

__all__ = ["ring_reduce_scatter", "ring_allgather_into", "ring_allreduce", "ring_cost",
           "rabenseifner_allreduce", "rabenseifner_cost", "recursive_doubling_allgather",
           "recursive_doubling_cost", "ALLREDUCE_ALGORITHMS", "check_allreduce", "allreduce", "allreduce_cost",
           "fold_roles"]


# ---------------------------------------------------------------------- ring
def ring_reduce_scatter(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """Ring reduce-scatter: rank r returns chunk r of the sum over ranks.

    Step t = 0..P-2: send chunk (r-t-1) mod P to r+1, receive chunk (r-t-2) mod P from r-1, add.
    Cost: P-1 rounds; rank r sends n - c_r and receives n - c_(r-1) elements.
    """
    P, r = comm.size, comm.rank
    work = x.clone()
    bounds = chunk_offsets(x.numel(), P)
    scratch = torch.empty(max(size for _, size in bounds), dtype=x.dtype, device=x.device)
    for t in range(P - 1):
        s_start, s_size = bounds[(r - t - 1) % P]
        r_start, r_size = bounds[(r - t - 2) % P]
        incoming = scratch[:r_size]
        comm.sendrecv(work[s_start:s_start + s_size], (r + 1) % P, incoming, (r - 1) % P)
        work[r_start:r_start + r_size] += incoming
    start, size = bounds[r]
    return work[start:start + size].clone()


def ring_allgather_into(comm: Communicator, out: torch.Tensor) -> None:
    """Ring all-gather in place: rank r holds chunk r of ``out``; afterwards all chunks.

    Step t: send chunk (r-t) mod P to r+1, receive chunk (r-t-1) mod P from r-1.
    """
    P, r = comm.size, comm.rank
    bounds = chunk_offsets(out.numel(), P)
    for t in range(P - 1):
        s_start, s_size = bounds[(r - t) % P]
        r_start, r_size = bounds[(r - t - 1) % P]
        comm.sendrecv(out[s_start:s_start + s_size], (r + 1) % P, out[r_start:r_start + r_size], (r - 1) % P)


def ring_allreduce(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """Ring all-reduce (sum) = ring reduce-scatter + ring all-gather (Patarasuk and Yuan).

    Cost: 2(P-1) rounds; rank r sends 2n - c_r - c_(r+1) elements, receives 2n - c_(r-1) - c_r.
    """
    P, r = comm.size, comm.rank
    if P == 1:
        return x.clone()
    out = torch.empty_like(x)
    start, size = chunk_offsets(x.numel(), P)[r]
    out[start:start + size] = ring_reduce_scatter(comm, x)
    ring_allgather_into(comm, out)
    return out


@register_collective_cost("ring_allreduce")
def ring_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    if P == 1:
        return ZERO
    c = chunk_sizes(n, P)
    sent = 2 * n - c[rank] - c[(rank + 1) % P]
    recv = 2 * n - c[(rank - 1) % P] - c[rank]
    return Cost(2 * (P - 1), sent * itemsize, recv * itemsize)


# ---------------------------------------------------------------------- Rabenseifner
def fold_roles(P: int, r: int) -> tuple[int, int, int]:
    """For algorithms on the largest power of two p' <= P: (p', rem, new rank or -1 if folded out).

    Ranks below 2*rem pair up (2i, 2i+1): the even one hands its data to the odd one and sits out.
    """
    p2 = 1 << (P.bit_length() - 1)
    rem = P - p2
    if r < 2 * rem:
        return p2, rem, (r // 2 if r % 2 else -1)
    return p2, rem, r - rem


def _old_rank(new_rank: int, rem: int) -> int:
    return 2 * new_rank + 1 if new_rank < rem else new_rank + rem


def _halving_segments(n: int, p2: int, new_rank: int) -> list[tuple[int, int, int, int, int]]:
    """The recursive-halving schedule of one rank: per step (mask, keep_lo, keep_hi, send_lo, send_hi).

    The current segment [lo, hi) splits at lo + ceil((hi - lo) / 2); the rank whose ``mask`` bit is
    0 keeps the lower part.
    """
    steps, lo, hi, mask = [], 0, n, p2 // 2
    while mask >= 1:
        mid = lo + (hi - lo + 1) // 2
        if new_rank & mask:
            steps.append((mask, mid, hi, lo, mid))
            lo = mid
        else:
            steps.append((mask, lo, mid, mid, hi))
            hi = mid
        mask //= 2
    return steps


def rabenseifner_allreduce(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """Rabenseifner all-reduce: recursive-halving reduce-scatter + recursive-doubling all-gather
    (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
    IJHPCA 2005).

    The halving's last step and the doubling's first are with the same partner over the same segment:
    they are one exchange of the whole segment, which both partners add (the bytes of the two rounds,
    one round fewer; ``a + b`` and ``b + a`` are the same floats, so every rank holds the same sums).
    Any P: ranks beyond the largest power of two p' are folded in first (one round: the even rank of
    each of the first ``rem`` pairs sends its vector to the odd one) and served last (one round back).
    Cost: 2 log2 p' - 1 rounds (+2 when P is not a power of two); bytes per rank
    ``2 n (p' - 1) / p'`` (+ n each way for a folded pair) from :func:`rabenseifner_cost`, which
    replays the same halving schedule.
    """
    P, r = comm.size, comm.rank
    out = x.clone()
    if P == 1:
        return out
    p2, rem, me = fold_roles(P, r)
    if rem:
        if me < 0:
            comm.sendrecv(out, r + 1, None, None)
        elif r < 2 * rem:
            incoming = torch.empty_like(out)
            comm.sendrecv(None, None, incoming, r - 1)
            out += incoming
    if me >= 0:
        *halving, (middle_mask, keep_lo, keep_hi, send_lo, send_hi) = _halving_segments(x.numel(), p2, me)
        for mask, k_lo, k_hi, s_lo, s_hi in halving:
            partner = _old_rank(me ^ mask, rem)
            incoming = torch.empty(k_hi - k_lo, dtype=x.dtype, device=x.device)
            comm.sendrecv(out[s_lo:s_hi], partner, incoming, partner)
            out[k_lo:k_hi] += incoming
        # the middle: the last halving step and the first doubling step as one exchange of the segment
        lo, hi = min(keep_lo, send_lo), max(keep_hi, send_hi)
        partner = _old_rank(me ^ middle_mask, rem)
        incoming = torch.empty(hi - lo, dtype=x.dtype, device=x.device)
        comm.sendrecv(out[lo:hi], partner, incoming, partner)
        out[lo:hi] += incoming
        for mask, k_lo, k_hi, s_lo, s_hi in reversed(halving):
            partner = _old_rank(me ^ mask, rem)
            comm.sendrecv(out[k_lo:k_hi], partner, out[s_lo:s_hi], partner)
    if rem and r < 2 * rem:
        if me < 0:
            comm.sendrecv(None, None, out, r + 1)
        else:
            comm.sendrecv(out, r - 1, None, None)
    return out


@register_collective_cost("rabenseifner_allreduce")
def rabenseifner_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    if P == 1:
        return ZERO
    p2, rem, me = fold_roles(P, rank)
    rounds = sent = recv = 0
    if rem and rank < 2 * rem:  # the fold: one full vector each way
        rounds, sent, recv = 2, n, n
    if me >= 0:
        for _mask, k_lo, k_hi, s_lo, s_hi in _halving_segments(n, p2, me):
            rounds += 2
            sent += (s_hi - s_lo) + (k_hi - k_lo)
            recv += (k_hi - k_lo) + (s_hi - s_lo)
        rounds -= 1  # the middle two rounds are one exchange of the same bytes
    return Cost(rounds, sent * itemsize, recv * itemsize)


# ---------------------------------------------------------------------- all-gathers
def recursive_doubling_allgather(comm: Communicator, x: torch.Tensor) -> list[torch.Tensor]:
    """Recursive-doubling all-gather of equal-size tensors; returns ``[x of rank 0, ..., rank P-1]``.

    Any P: the first ``rem`` odd ranks first receive their even neighbour's block, the p' active
    ranks exchange everything they hold with partner ``rank ^ mask`` for mask = 1, 2, ..., p'/2,
    and the odd ranks finally hand the whole result to their even neighbour.
    Cost: log2 p' rounds (+2 when P is not a power of two); an active rank sends
    (m - blocks held at start) ... see :func:`recursive_doubling_cost`.
    """
    P, r = comm.size, comm.rank
    m = x.numel()
    out = torch.empty(P * m, dtype=x.dtype, device=x.device)
    out[r * m:(r + 1) * m] = x
    if P == 1:
        return [out.clone()]
    p2, rem, me = fold_roles(P, r)
    if rem and r < 2 * rem:
        if me < 0:
            comm.sendrecv(x, r + 1, None, None)
        else:
            comm.sendrecv(None, None, out[(r - 1) * m:r * m], r - 1)
    if me >= 0:
        mask = 1
        while mask < p2:
            partner_new = me ^ mask
            mine = _held_ranks(me, mask, rem)
            theirs = _held_ranks(partner_new, mask, rem)
            send_lo, send_hi = mine[0] * m, (mine[-1] + 1) * m
            recv_lo, recv_hi = theirs[0] * m, (theirs[-1] + 1) * m
            comm.sendrecv(out[send_lo:send_hi], _old_rank(partner_new, rem), out[recv_lo:recv_hi],
                          _old_rank(partner_new, rem))
            mask *= 2
    if rem and r < 2 * rem:
        if me < 0:
            comm.sendrecv(None, None, out, r + 1)
        else:
            comm.sendrecv(out, r - 1, None, None)
    return list(out.split(m)) if m else [out[:0].clone() for _ in range(P)]


def _held_ranks(new_rank: int, mask: int, rem: int) -> list[int]:
    """Original ranks whose blocks ``new_rank`` holds before the doubling step ``mask``.

    They form a contiguous run: new ranks ``[base, base + mask)`` with base = new_rank & ~(mask-1),
    each standing for its own rank plus, for new ranks < rem, the folded even partner.
    """
    base = new_rank & ~(mask - 1)
    lo = 2 * base if base < rem else base + rem
    top = base + mask - 1
    hi = 2 * top + 1 if top < rem else top + rem
    return list(range(lo, hi + 1))


@register_collective_cost("recursive_doubling_allgather")
def recursive_doubling_cost(P: int, n: int, rank: int, itemsize: int = 4, **_) -> Cost:
    """n here is the per-rank block size m."""
    if P == 1:
        return ZERO
    m = n
    p2, rem, me = fold_roles(P, rank)
    rounds = sent = recv = 0
    if rem and rank < 2 * rem:
        rounds += 2
        if me < 0:
            sent, recv = m, P * m
        else:
            sent, recv = P * m, m
    if me >= 0:
        mask = 1
        while mask < p2:
            rounds += 1
            sent += len(_held_ranks(me, mask, rem)) * m
            recv += len(_held_ranks(me ^ mask, rem=rem, mask=mask)) * m
            mask *= 2
    return Cost(rounds, sent * itemsize, recv * itemsize)


# ---------------------------------------------------------------------- choosing an all-reduce
#: The metered dense all-reduce algorithms a method may name (``allreduce="rabenseifner"``).
ALLREDUCE_ALGORITHMS = ("rabenseifner", "ring")
_ALLREDUCES = {"rabenseifner": rabenseifner_allreduce, "ring": ring_allreduce}
_ALLREDUCE_COSTS = {"rabenseifner": rabenseifner_cost, "ring": ring_cost}


def check_allreduce(algorithm: str, owner: str) -> str:
    """``algorithm`` is one of :data:`ALLREDUCE_ALGORITHMS`; the error names ``owner`` (a method)."""
    if algorithm not in _ALLREDUCES:
        raise ValueError(f"{owner}: allreduce={algorithm!r} must be one of {ALLREDUCE_ALGORITHMS}")
    return algorithm


def allreduce(comm: Communicator, x: torch.Tensor, algorithm: str = "rabenseifner") -> torch.Tensor:
    """The sum over ranks of ``x`` by the named metered algorithm (a new tensor; ``x`` untouched)."""
    return _ALLREDUCES[check_allreduce(algorithm, "allreduce")](comm, x)


def allreduce_cost(algorithm: str, P: int, n: int, rank: int, itemsize: int = 4) -> Cost:
    """The cost of :func:`allreduce` of n elements of ``itemsize`` bytes (nothing when n = 0)."""
    if n == 0:
        return ZERO
    return _ALLREDUCE_COSTS[check_allreduce(algorithm, "allreduce")](P=P, n=n, rank=rank, itemsize=itemsize)
