"""What a method with error feedback hands the runner before its call communicates, and gets back.

A method may split off the start of its call into :meth:`~.base.Method.accumulate` (``acc = residual +
grad``, in one pass with its selection) and :meth:`~.base.Method.first_message` (the message it sends
first, built from ``acc``). The runner (:mod:`.runner`) then decides where they run: on the CPU, before
the ranks agree on the call (so the agreement needs no pass of its own over the gradient, and the
first message may travel in the agreement's messages), elsewhere after it. Either way ``reduce`` gets
the same :class:`Accumulated`, and the same bits come out.

The first message is one of:

* :class:`AllGather`: every rank's message reaches every rank;
* :class:`Exchanges`: point-to-point messages, step i going to ``peers[i][0]`` and coming from
  ``peers[i][1]``, each made from what the previous step received;
* :class:`FirstMessage`: anything else, sent by the method's own ``send`` once the ranks agreed.

Each carries ``send``, how the method sends it itself; the first two also say how to read what the
agreement's messages brought (``unpack``), where the runner can send it there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..selection import NonFiniteInputError
from ..selection.scan import Scratch

__all__ = ["Accumulated", "FirstMessage", "AllGather", "Exchanges", "add_checked"]


class Accumulated(NamedTuple):
    """What :meth:`~.base.Method.reduce` gets of its accumulation (``out.accumulated``)."""

    #: residual + gradient, the residual of this call from now on (reduce takes the sent entries out)
    acc: torch.Tensor
    #: what :meth:`~.base.Method.accumulate` returned
    picked: Any
    #: what the first message brought (``unpack``'s or ``send``'s result), ``None`` without one
    replies: Any


@dataclass
class FirstMessage:
    """A first message the method sends itself, once the ranks agreed: ``send()`` returns the replies."""

    send: Callable[[], Any]


@dataclass
class AllGather(FirstMessage):
    """An all-gather of ``parts`` (CPU tensors, sent back to back as raw bytes). ``unpack(blocks)``
    reads every rank's message from its raw bytes (``uint8``, rank order) into what ``send`` returns."""

    parts: Sequence[torch.Tensor]
    unpack: Callable[[list[torch.Tensor]], Any]


@dataclass
class Exchanges(FirstMessage):
    """Point-to-point messages: step i sends to ``peers[i][0]`` and receives from ``peers[i][1]`` (local
    ranks of the method's communicator); ``parts`` is step 0's message, ``next_message(i, received)``
    makes step i's from the raw bytes step i - 1 received, and ``unpack(received)`` reads the last
    step's into what ``send`` returns."""

    parts: Sequence[torch.Tensor]
    peers: Sequence[tuple[int, int]]
    next_message: Callable[[int, list[torch.Tensor]], Sequence[torch.Tensor]]
    unpack: Callable[[list[torch.Tensor]], Any]


def add_checked(residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, scratch: Scratch, name: str) -> None:
    """``acc = residual + grad`` in one pass that raises
    :class:`~sparsecomm.selection.NonFiniteInputError` when ``grad`` holds NaN/Inf (the compiled scan;
    elsewhere an addition and one sum, which a count follows only when the sum is not finite): an
    accumulation without a selection. In place (``acc`` is ``residual``) the call's checks found the
    gradient finite already: an addition alone."""
    if acc.data_ptr() == residual.data_ptr():
        acc.add_(grad)
        return
    if scratch.uses_compiled(residual, grad, acc):
        scratch.scan(residual, math.inf, name=name, check_finite=True, addend=grad, dest=acc)
        return
    torch.add(residual, grad, out=acc)
    if grad.numel() and not math.isfinite(float(grad.sum())) and not bool(torch.isfinite(grad).all()):
        raise NonFiniteInputError(f"{name}: the gradient holds NaN or Inf")
