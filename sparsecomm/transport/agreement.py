"""Agreement before communication: every rank learns, in one small collective, whether all ranks
are about to do the same thing, before any payload moves.

A method call fills a fixed-size int64 *header* (its gradient length, dtype, density, step, number
of non-finite elements, ...; the fields are the caller's). :func:`agree` reduces ``[h, -h]`` with an
element-wise maximum over the communicator (:meth:`Communicator.agree_max`, a dissemination
all-reduce of ceil(log2 P) steps), so every rank holds the maximum and the minimum of each field and
reaches the same verdict:

* every field equal on every rank and every *must-be-zero* field zero: :func:`agree` returns
  ``None`` and the call goes on;
* otherwise every rank takes part in a second collective that gathers the whole P x H table
  (rows of the other ranks start at the int64 minimum, so the same maximum-reduction is an
  all-gather), and every rank returns the same :class:`Agreement` table, from which
  :meth:`Agreement.describe` builds the same message naming the offending rank(s).

This is the check that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` makes for torch's own collectives (it
compares the collective's shapes and dtypes across ranks) and that NCCL's error checking makes
before launching a kernel, reduced to what a sparse method needs.

A method whose first message is an all-gather can send it *in* the agreement
(:func:`agree_gathering`, on gloo and MPI): the dissemination's messages carry the payload blocks
too, so the call needs no messages of its own for the agreement. Every rank still reads every
message, whatever method it called, because every agreement message on those backends has the same
self-describing frame (:meth:`Communicator.agree_max_gathering`). A method whose messages follow the
agreement's schedule, step D = P/2, ..., 1 sending to rank r + D (SparDL's Spar-Reduce-Scatter at P a
power of two), sends each of them in the agreement's step (:func:`agree_riding`).

Cost per call, per rank: ceil(log2 P) messages of 2 H int64 (16 H bytes each; on gloo and MPI 16 more
bytes of frame), booked as header bytes in the meter, with no round; only after a disagreement a
second exchange of ceil(log2 P) messages of 8 P H bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from .comm import BlockStep, Communicator

__all__ = ["AgreementError", "Agreement", "agree", "agree_gathering", "agree_riding", "INT64_MIN"]

INT64_MIN = -(2 ** 63)


class AgreementError(ValueError):
    """Raised on every rank when the ranks disagree on a call (or one rank's input is unusable).

    Attributes:
        ranks: the offending ranks (local ranks of the communicator), sorted.
        cause: short name of the cause, e.g. ``"n"``, ``"dtype"``, ``"nonfinite"``.
    """

    def __init__(self, message: str, ranks: Sequence[int] = (), cause: str = "") -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.cause = cause


@dataclass(frozen=True)
class Agreement:
    """The header of every rank, after a disagreement (identical on every rank)."""

    names: tuple[str, ...]
    rows: tuple[tuple[int, ...], ...]  # rows[rank][field]

    def column(self, name: str) -> list[int]:
        """The value of field ``name`` on each rank, in rank order."""
        j = self.names.index(name)
        return [row[j] for row in self.rows]

    def nonzero_ranks(self, name: str) -> list[int]:
        """Ranks whose field ``name`` is not zero."""
        return [rank for rank, value in enumerate(self.column(name)) if value != 0]

    def outliers(self, name: str) -> tuple[int, list[int]]:
        """(the value most ranks hold, the ranks holding another value) for field ``name``.

        A tie between values goes to the one rank 0 holds, so every rank picks the same reference.
        """
        column = self.column(name)
        counts = Counter(column)
        top = max(counts.values())
        reference = column[0] if counts[column[0]] == top else min(v for v, c in counts.items() if c == top)
        return reference, [rank for rank, value in enumerate(column) if value != reference]

    def mismatched(self) -> list[str]:
        """Fields whose value is not the same on every rank, in header order."""
        return [name for name in self.names if len(set(self.column(name))) > 1]

    def describe(self, name: str, show=str) -> str:
        """``"rank 2 has n=999, ranks 0, 1, 3 have n=1000"`` (``show`` formats a value)."""
        reference, odd = self.outliers(name)
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(self.column(name)):
            groups.setdefault(value, []).append(rank)
        parts = [f"{_ranks(groups[v])} {'has' if len(groups[v]) == 1 else 'have'} {name}={show(v)}"
                 for v in sorted(groups, key=lambda v: (v == reference, groups[v][0]))]
        return ", ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def agree(comm: Communicator, header: Mapping[str, int], *, zero: Sequence[str] = (),
          device=None) -> Agreement | None:
    """``None`` when every rank passed the same ``header`` and the fields in ``zero`` are 0 on every
    rank; else every rank's header (the same :class:`Agreement` on every rank).

    Collective: every rank of ``comm`` must call it (or :func:`agree_gathering`) with the same field
    names, in the same order.
    """
    return agree_gathering(comm, header, None, zero=zero, device=device)[0]


def agree_gathering(comm: Communicator, header: Mapping[str, int], block: Sequence[Tensor] | None, *,
                    zero: Sequence[str] = (), device=None
                    ) -> tuple[Agreement | None, list[Tensor] | None, list[BlockStep]]:
    """:func:`agree` whose messages also all-gather ``block``, this rank's payload (a method's first
    message; :meth:`Communicator.agree_max_gathering`, on backends where
    :attr:`Communicator.gathers_in_agreement`). Returns (the verdict, every rank's block in rank order
    as ``uint8`` tensors, the payload moved per step). The blocks are ``None`` when a rank passed
    none; that rank's header then differs (the caller puts whether it sends one in the header), so
    the verdict is never ``None`` without them."""
    names = tuple(header)
    values = [int(header[name]) for name in names]
    both_ways = values + [-v for v in values]
    gathered: list[Tensor] | None = None
    steps: list[BlockStep] = []
    if block is None:
        both = comm.agree_max(both_ways, device=device)
    else:
        both, gathered, steps = comm.agree_max_gathering(both_ways, block)
    return _verdict(comm, names, values, both, zero, device), gathered, steps


def agree_riding(comm: Communicator, header: Mapping[str, int], payload: Sequence[Tensor] | None,
                 produce: Callable[[int, list[Tensor]], Sequence[Tensor]], *, zero: Sequence[str] = ()
                 ) -> tuple[Agreement | None, list[Tensor] | None, list[BlockStep]]:
    """:func:`agree` whose every message also carries one of a method's point-to-point messages
    (:meth:`Communicator.agree_max_riding`, where :meth:`Communicator.rides_in_agreement`): the
    first step's ``payload``, then ``produce(step, received)``'s. ``produce`` sees a message only while
    every header that shaped it and this rank's agree and no ``zero`` field is set (the verdict on the
    ranks seen so far), so it never reads a message of another collective. Returns (the verdict, the
    last step's received tensors as ``uint8``, the payload moved per step). The tensors are ``None``
    when a rank passed none (its header then differs: the caller puts whether it sends one in the
    header), so the verdict is never ``None`` without them."""
    names = tuple(header)
    values = [int(header[name]) for name in names]

    def settled(both: list[int]) -> bool:
        return _settled(names, len(values), both, zero)

    both, received, moved = comm.agree_max_riding(values + [-v for v in values], payload, produce, settled)
    return _verdict(comm, names, values, both, zero, None), received, moved


def _settled(names: tuple[str, ...], width: int, both: list[int], zero: Sequence[str]) -> bool:
    """Whether the maxima and minima ``both`` of ``width`` fields are equal and the ``zero`` fields 0."""
    for j in range(width):
        if both[j] != -both[width + j]:
            return False
    return all(both[names.index(name)] == 0 == both[width + names.index(name)] for name in zero)


def _verdict(comm: Communicator, names: tuple[str, ...], values: list[int], both: list[int],
             zero: Sequence[str], device) -> Agreement | None:
    """``None`` when the maxima and minima ``both`` of ``values`` are equal and the ``zero`` fields are
    0; else every rank's header, gathered in a second exchange (the same :class:`Agreement` on every rank)."""
    if _settled(names, len(values), both, zero):
        return None
    width = len(values)
    table = [INT64_MIN] * (comm.size * width)
    table[comm.rank * width:(comm.rank + 1) * width] = values
    rows_flat = comm.agree_max(table, device=device)
    rows = tuple(tuple(rows_flat[r * width:(r + 1) * width]) for r in range(comm.size))
    return Agreement(names, rows)
