"""A call's output tensor, and what the method's previous call left in it.

``method(grad, out=buf)`` writes the result into ``buf`` (the zero-allocation path of the DDP hook and
the synchronizer, which pass the same tensor every call). A sparse result must be zero everywhere it
does not write, and zeroing all of ``buf`` costs a length-n write per call; so :class:`OutputRegions`
remembers where the method's last call wrote ``buf``, and when ``buf`` is that call's result untouched
since (same storage, same ``_version``), only those entries are cleared: O(k) instead of O(n).
:class:`Output` is the view a method's ``reduce`` gets of this: the writers below zero what is stale
and record what they wrote, without the method keeping any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..transport.merge import GroupMask, Stale, average_blocks_into, average_into, clear
from .stats import Stats

__all__ = ["Output", "OutputRegions"]


class OutputRegions:
    """Where a method's last call wrote its ``out=`` tensor (kept across calls by the runner)."""

    __slots__ = ("support", "mark")

    def __init__(self) -> None:
        #: the entries written (int64 indices or the blocks' groups); None: unknown, zero it all
        self.support: torch.Tensor | GroupMask | None = None
        #: (storage pointer, version) of the tensor as that call returned it
        self.mark: tuple[int, int] | None = None

    def stale(self, out: torch.Tensor) -> Stale:
        """Where ``out`` may be non-zero: where the last call wrote, if ``out`` is its result untouched
        since, else anywhere."""
        if self.support is not None and self.mark == (out.data_ptr(), out._version):
            return self.support
        return "all"


class Output:
    """One call's output, for :meth:`~.base.Method.reduce`: write the result with one of the writers
    (or return a tensor of the method's own, which the runner copies into ``out=``).

    Attributes:
        layout: the (offset, numel) of each layer packed in the gradient, or ``None`` (as passed).
        accumulated: for a method with :meth:`~.base.Method.accumulate`, what it accumulated
            (:class:`~.accumulation.Accumulated`); ``None`` otherwise.
    """

    def __init__(self, grad: torch.Tensor, out: torch.Tensor | None, regions: OutputRegions, stats: Stats,
                 layout: Any = None, *, fresh: bool = False) -> None:
        self.grad, self.out, self.regions, self.stats, self.layout = grad, out, regions, stats, layout
        self.accumulated: Any = None
        # a sparse result is allocated as the call begins, before its temporaries: it then tends to get
        # the pages the allocator still holds from the caller's last result, not fresh pages that fault
        # on the first write (docs/memory.md, "Output into out=")
        self.fresh = torch.empty_like(grad) if fresh and out is None else None

    def zeros(self) -> torch.Tensor:
        """The output tensor, zero: without ``out=`` a new tensor the caller owns; with it the caller's,
        cleared where it may be non-zero. Say where you wrote with :meth:`written`."""
        if self.out is None:
            return self._new().zero_()
        clear(self.out, self.regions.stale(self.out))
        self.regions.support = None  # until the method says where it wrote
        return self.out

    def copy_of(self, grad: torch.Tensor) -> torch.Tensor:
        """The output tensor holding a copy of ``grad`` (for a dense method that reduces in place)."""
        if self.out is None:
            return grad.clone()
        self.regions.support = None
        return self.out.copy_(grad)

    def written(self, indices: torch.Tensor | None) -> None:
        """The entries of :meth:`zeros`'s tensor this call wrote (int64 indices, repeats allowed); ``None``
        means anywhere, and the next call zeroes the whole tensor."""
        self.regions.support = None if indices is None or self.out is None else indices.to(torch.int64)

    def average(self, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], divisor: int, *,
                keep_sign: bool = False) -> torch.Tensor:
        """The output tensor made the average of the chunks (``indices[c]``, ``values[c]``; each chunk's
        indices sorted for the C path) and zero elsewhere, in one ordered sweep that also zeroes the
        last call's entries (:func:`~sparsecomm.transport.merge.average_into`): each index's sum is
        taken in chunk order and divided by ``divisor`` on the way (``keep_sign``: each sum starts
        from its first value, as ``out[i] = v / divisor`` does, instead of from ``+0.0``)."""
        return self._write(lambda out, stale: average_into(out, indices, values, divisor, stale=stale,
                                                           keep_sign=keep_sign))

    def average_blocks(self, blocks: torch.Tensor, block_size: int, values: torch.Tensor, divisor: int, *,
                       keep_sign: bool = False) -> torch.Tensor:
        """:meth:`average` for a result made of whole blocks (OmniReduce, S2 Reducer): element
        ``blocks[b] * block_size + j`` (below n) becomes ``values[b, j] / divisor``, every other element
        zero (``blocks``: increasing ids); written by
        :func:`~sparsecomm.transport.merge.average_blocks_into`, which touches only those blocks and
        the last call's, with the same bits as :meth:`average` given those indices."""
        return self._write(lambda out, stale: average_blocks_into(out, blocks, block_size, values, divisor,
                                                                  stale=stale, keep_sign=keep_sign))

    def finish(self, result: torch.Tensor) -> torch.Tensor:
        """The call's result as the caller gets it (the runner's last step): ``out=`` holding it, or a
        tensor the caller owns (a copy where the method reduced ``grad`` in place)."""
        out = self.out
        if out is None:
            self.regions.mark = None
            return result.clone() if result.data_ptr() == self.grad.data_ptr() else result
        if result is not out:  # a method that returned a tensor of its own
            out.copy_(result)
            self.regions.support = None
        self.regions.mark = (out.data_ptr(), out._version)
        return out

    def _write(self, write: Callable[[torch.Tensor, Stale], tuple[torch.Tensor | GroupMask, int | None]]
               ) -> torch.Tensor:
        """The output tensor written by ``write(out, stale)``, which zeroes ``stale`` and returns (where
        it wrote, the non-zero results or ``None``); records both for the next call and the stats."""
        out, stale = (self._new(), "all") if self.out is None else (self.out, self.regions.stale(self.out))
        self.regions.support = None  # until the write succeeds
        written, nonzero = write(out, stale)
        if self.out is not None:
            self.regions.support = written
        if nonzero is not None:  # else the runner counts the non-zeros of the result
            self.stats.nnz_out = nonzero
        return out

    def _new(self) -> torch.Tensor:
        """A new tensor like the gradient for the caller to own (contents undefined)."""
        fresh, self.fresh = self.fresh, None
        return torch.empty_like(self.grad) if fresh is None else fresh
