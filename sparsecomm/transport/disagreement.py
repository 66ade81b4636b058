"""Naming what differs when the ranks' method options (or layouts) disagree.

The per-call agreement carries a CRC-32 of the options (:mod:`.agreement`: a fixed-size int64
header), enough to detect a difference but not to name it. On the error path only, every rank then
sends the options themselves: :func:`gather_texts` all-gathers one short text per rank over the
communicator's own point-to-point messages (the element-wise-maximum all-gather of
:meth:`~.comm.Communicator.agree_max`, so team communicators work too), and :func:`describe_options`
names each differing option with its values: ``option 'teams' differs: rank 2 has 3, ranks 0, 1
have 2``.

Cost (error path only): two ``agree_max`` exchanges, the second of P * L int64 (L: the longest text
in bytes, at most :data:`MAX_TEXT`), ceil(log2 P) messages each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .comm import Communicator

__all__ = ["gather_texts", "describe_options", "MAX_TEXT"]

#: Longest text sent per rank (bytes); longer texts are cut.
MAX_TEXT = 1024


def gather_texts(comm: Communicator, text: str, device=None) -> list[str]:
    """Every rank's ``text``, in rank order (collective over ``comm``)."""
    data = list(text.encode()[:MAX_TEXT])
    length = comm.agree_max([len(data)], device=device)[0]
    table = [-1] * (comm.size * length)
    table[comm.rank * length:comm.rank * length + len(data)] = data
    merged = comm.agree_max(table, device=device) if length else []
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


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
