"""Agreement before communication: every rank learns, in one small collective, whether all ranks
are about to do the same thing, before any payload moves.

A method call fills a fixed-size int64 *header* (its gradient length, dtype, density, step, number
of non-finite elements, ...; the fields are the caller's). :func:`agree` reduces ``[h, -h]`` with an
element-wise maximum over the communicator (:func:`.control.max_all_reduce`, ceil(log2 P) steps), so
every rank holds the maximum and the minimum of each field and reaches the same verdict:

* every field equal on every rank and every *must-be-zero* field zero: :func:`agree` returns
  ``None`` and the call goes on;
* otherwise every rank takes part in a second collective that gathers the whole P x H table
  (rows of the other ranks start at the int64 minimum, so the same maximum-reduction is an
  all-gather), and every rank returns the same :class:`Agreement` table, from which
  :meth:`Agreement.describe` builds the same message naming the offending rank(s). Fields sent as a
  CRC (a method's options, a layout) are named by :func:`gather_texts` and :func:`describe_options`,
  which all-gather each rank's text on the error path only.

This is the check that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` makes for torch's own collectives (it
compares the collective's shapes and dtypes across ranks) and that NCCL's error checking makes
before launching a kernel, reduced to what a sparse method needs.

The agreement's control messages can carry a method's first message (:mod:`.control`):
:func:`agree_gathering` all-gathers one block per rank in them, :func:`agree_carrying` sends one of
the caller's point-to-point messages in each of their steps.

Cost per call, per rank: ceil(log2 P) messages of 2 H int64 (16 H bytes each; on gloo and MPI 16 more
bytes of frame), booked as header bytes in the meter, with no round; only after a disagreement a
second exchange of ceil(log2 P) messages of 8 P H bytes (and, to name differing options, two more
of at most 8 P :data:`MAX_TEXT` bytes).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .comm import Communicator
from .control import BlockStep, max_all_reduce, max_all_reduce_carrying, max_all_reduce_gathering

__all__ = ["AgreementError", "Agreement", "agree", "agree_gathering", "agree_carrying", "INT64_MIN",
           "gather_texts", "options_text", "describe_options", "MAX_TEXT"]

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

    Collective: every rank of ``comm`` must call it (or :func:`agree_gathering`, :func:`agree_carrying`)
    with the same field names, in the same order.
    """
    return agree_gathering(comm, header, None, zero=zero, device=device)[0]


def agree_gathering(comm: Communicator, header: Mapping[str, int], block: Sequence[Tensor] | None, *,
                    zero: Sequence[str] = (), device=None
                    ) -> tuple[Agreement | None, list[Tensor] | None, list[BlockStep]]:
    """:func:`agree` whose messages also all-gather ``block``, this rank's payload (a method's first
    message; :func:`.control.max_all_reduce_gathering`, where :func:`.control.carries_blocks`).
    Returns (the verdict, every rank's block in rank order as ``uint8`` tensors, the payload moved per
    step). The blocks are ``None`` when a rank passed
    none; that rank's header then differs (the caller puts whether it sends one in the header), so
    the verdict is never ``None`` without them."""
    names = tuple(header)
    values = [int(header[name]) for name in names]
    both_ways = values + [-v for v in values]
    gathered: list[Tensor] | None = None
    steps: list[BlockStep] = []
    if block is None:
        both = max_all_reduce(comm, both_ways, device=device)
    else:
        both, gathered, steps = max_all_reduce_gathering(comm, both_ways, block)
    return _verdict(comm, names, values, both, zero, device), gathered, steps


def agree_carrying(comm: Communicator, header: Mapping[str, int], payload: Sequence[Tensor] | None,
                   next_message: Callable[[int, list[Tensor]], Sequence[Tensor]], *, zero: Sequence[str] = ()
                   ) -> tuple[Agreement | None, list[Tensor] | None, list[BlockStep]]:
    """:func:`agree` whose every message also carries one of a method's point-to-point messages
    (:func:`.control.max_all_reduce_carrying`, where :func:`.control.carries_messages`): the first
    step's ``payload``, then ``next_message(step, received)``'s. ``next_message`` sees a message only
    while every header that shaped it and this rank's agree and no ``zero`` field is set (the verdict on
    the ranks seen so far), so it never reads a message of another collective. Returns (the verdict, the
    last step's received tensors as ``uint8``, the payload moved per step). The tensors are ``None``
    when a rank passed none (its header then differs: the caller puts whether it sends one in the
    header), so the verdict is never ``None`` without them."""
    names = tuple(header)
    values = [int(header[name]) for name in names]

    def settled(both: list[int]) -> bool:
        return _settled(names, len(values), both, zero)

    both, received, moved = max_all_reduce_carrying(comm, values + [-v for v in values], payload, next_message,
                                                    settled)
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
    rows_flat = max_all_reduce(comm, table, device=device)
    rows = tuple(tuple(rows_flat[r * width:(r + 1) * width]) for r in range(comm.size))
    return Agreement(names, rows)


# ---------------------------------------------------------------------- naming what differs
#: Longest text sent per rank (bytes); longer texts are cut.
MAX_TEXT = 1024


def gather_texts(comm: Communicator, text: str, device=None) -> list[str]:
    """Every rank's ``text``, in rank order (collective over ``comm``)."""
    data = list(text.encode()[:MAX_TEXT])
    length = max_all_reduce(comm, [len(data)], device=device)[0]
    table = [-1] * (comm.size * length)
    table[comm.rank * length:comm.rank * length + len(data)] = data
    merged = max_all_reduce(comm, table, device=device) if length else []
    rows = [merged[r * length:(r + 1) * length] for r in range(comm.size)]
    return [bytes(b for b in row if b >= 0).decode(errors="replace") for row in rows]


def options_text(options: dict[str, Any]) -> str:
    """The JSON text :func:`describe_options` reads (plain values; others by their repr)."""
    return json.dumps(options, sort_keys=True, default=repr)


def describe_options(texts: Sequence[str]) -> str:
    """``option 'teams' differs: rank 2 has 3, ranks 0, 1 have 2; ...`` from every rank's
    :func:`options_text`."""
    decoded = []
    for text in texts:
        try:
            decoded.append(json.loads(text))
        except ValueError:
            decoded.append({"<options>": text})
    parts = []
    for key in sorted({k for d in decoded for k in d}):
        groups: dict[str, list[int]] = {}
        for rank, options in enumerate(decoded):
            groups.setdefault(repr(options.get(key, "<not given>")), []).append(rank)
        if len(groups) > 1:
            # the odd ranks first, then the value most ranks hold (a tie goes to rank 0's), as the agreement
            reference = max(groups, key=lambda value: (len(groups[value]), -groups[value][0]))
            ordered = sorted(groups.items(), key=lambda item: (item[0] == reference, item[1][0]))
            parts.append(f"option {key!r} differs: " + ", ".join(
                f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}" for value, ranks in ordered))
    return "; ".join(parts) or "the options differ"
