"""SparDL's Spar-All-Gather (SAG) between d teams: R-SAG, B-SAG and B-SAG's h adjustment.

SparDL (Zhao et al.), section III-D. After Spar-Reduce-Scatter inside each team of m = P/d ranks, the
rank at position j of every team holds block j of its team's sum, with at most L = dk/P entries (in
this library L_j = the block's share of k, so blocks of unequal length stay exact). SAG makes the d
ranks at one position (the *cross* communicator) hold the same block of the global sum:

* R-SAG (d a power of 2): recursive doubling; at each step two ranks exchange their block, add it
  (the lower team's block first, so both get the same bits) and keep the top-L. Both sides discard
  the same values; the discard is split among its identical holders: after the step at distance
  ``mask`` 2*mask ranks hold it, each keeps 1/(2*mask) (1/2 each at the first step, as in the paper;
  later steps halve again so that nothing is counted twice). Cost (eq. 5): log2 d rounds,
  2(dk/P) log2 d elements.
* B-SAG (any d): each rank first keeps its top-h entries (the rest returns to its residual), a Bruck
  all-gather between teams moves them, every rank adds the d blocks in team order, counts the
  non-zeros N and keeps the top-L; each of the d identical holders keeps 1/d of the discard.
  h follows Algorithm 2 (:class:`HAdjuster`). Cost (eq. 8): ceil(log2 d) rounds,
  2k(d-1)/P .. 2k(d^2-d)/P elements.
"""

from __future__ import annotations

import math

from ...transport.chunk import SparseChunk, add_chunks
from ...transport.comm import Communicator
from ...transport.sparse_collectives import allgather_chunks, bruck_traffic
from .srs import Accumulator, BlockSelector

__all__ = ["HAdjuster", "recursive_sag", "bruck_sag", "rsag_traffic", "bsag_traffic"]


class HAdjuster:
    """SparDL Algorithm 2: the pre-selection size h of B-SAG, adjusted like TCP's congestion window.

    Start: h = L/d (the paper's k/P), step = 0.01 L (d-1)/d (0.01 k (d-1)/P), flag = False. After each
    iteration with N entries after B-SAG: if (N > L) xor (step > 0), i.e. the current direction is
    still the right one, the step doubles on every second such iteration (flag); otherwise it turns
    and halves (step = -step/2, flag = False). Then h += step. h stays in the paper's range [L/d, L]
    (entirely disjoint to entirely overlapping indices); as our addition the step's magnitude is capped
    at the width of that range, so that a long stay at a bound cannot grow it without limit.
    """

    def __init__(self, L: int, d: int) -> None:
        if d < 2:
            raise ValueError(f"B-SAG needs at least 2 teams, got d={d}")
        self.L = int(L)
        self.low, self.high = self.L / d, float(self.L)
        self.h = self.low
        self.step = 0.01 * self.L * (d - 1) / d
        self.flag = False

    def count(self) -> int:
        """The number of entries to pre-select now: ceil(h), within [1, L] (0 when L = 0)."""
        return min(self.L, max(1, math.ceil(self.h - 1e-9))) if self.L else 0

    def update(self, count_after: int) -> None:
        """Algorithm 2 lines 3-16 with N_t = ``count_after``, the entries after this B-SAG."""
        if (count_after > self.L) != (self.step > 0):
            if self.flag:
                self.step *= 2
                self.flag = False
            else:
                self.flag = True
        else:
            self.step = -self.step / 2
            self.flag = False
        width = self.high - self.low
        self.step = max(-width, min(width, self.step))
        self.h = max(self.low, min(self.high, self.h + self.step))

    def state_dict(self) -> dict[str, float]:
        return {"L": self.L, "h": self.h, "step": self.step, "flag": self.flag}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if int(state["L"]) != self.L:
            raise ValueError(f"B-SAG state was saved for L={state['L']}, this bucket has L={self.L}")
        self.h, self.step, self.flag = float(state["h"]), float(state["step"]), bool(state["flag"])


def _keep_share(work: Accumulator, dropped: SparseChunk, holders: int) -> None:
    """Add 1/``holders`` of ``dropped`` into this rank's residual accumulator ``work``."""
    if dropped.nnz:
        work.index_add_(dropped.indices, dropped.values / holders if holders > 1 else dropped.values)


def recursive_sag(cross: Communicator, chunk: SparseChunk, L: int, blocks: BlockSelector,
                  work: Accumulator) -> SparseChunk:
    """R-SAG over ``cross`` (d ranks, d a power of 2): the top-L block of the global sum."""
    d, me = cross.size, cross.rank
    chunk = add_chunks([chunk])  # coalesced: index order, so partners see the same layout
    mask = 1
    while mask < d:
        partner = me ^ mask
        theirs = SparseChunk(*cross.exchange_many(partner, [chunk.indices, chunk.values], partner, count=2,
                                                  device=work.tensor.device))
        summed = add_chunks([chunk, theirs] if me < partner else [theirs, chunk])
        chunk, dropped = blocks.split(summed, L)
        _keep_share(work, dropped, 2 * mask)
        mask *= 2
    return chunk


def bruck_sag(cross: Communicator, chunk: SparseChunk, L: int, h: int, blocks: BlockSelector,
              work: Accumulator) -> tuple[SparseChunk, int]:
    """B-SAG over ``cross`` (any d): returns (the top-L block of the global sum, N = its entries
    before that top-L, the count Algorithm 2 needs)."""
    d = cross.size
    mine, local_discard = blocks.split(add_chunks([chunk]), h)
    _keep_share(work, local_discard, 1)
    summed = add_chunks(allgather_chunks(cross, mine, bruck=True))
    kept, dropped = blocks.split(summed, L)
    _keep_share(work, dropped, d)
    return kept, summed.nnz


# ---------------------------------------------------------------------- traffic
def rsag_traffic(d: int, L: int, pair_bytes: int) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) bound of R-SAG: log2 d exchanges of at most L pairs
    (eq. 5: log2(d) alpha + 2 (dk/P) log2(d) beta). Rounds are exact."""
    rounds = d.bit_length() - 1
    return rounds, rounds * L * pair_bytes, rounds * L * pair_bytes


def bsag_traffic(d: int, L: int, pair_bytes: int) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) bound of B-SAG: a Bruck all-gather of d blocks of at most
    h <= L pairs (eq. 8, upper end: ceil(log2 d) alpha + 2k (d^2 - d)/P beta). Rounds are exact."""
    return bruck_traffic([L * pair_bytes] * d, 0)
