"""A method's error-feedback residual (what it did not send, kept for its next call), in two buffers.

A call that accumulates ``acc = residual + grad`` before it knows that every rank goes on (the runner
agrees after that work, :mod:`.runner`) writes ``acc`` to a second buffer, the *spare*: a call the ranks
refuse or skip leaves the residual as it was, and one that goes on makes the spare the residual
(:meth:`ResidualStore.commit`), the old residual becoming the next call's spare. Error feedback then
keeps two length-n buffers instead of one (docs/memory.md). A method that updates its residual in
place, after the ranks agreed, uses :meth:`ResidualStore.for_update` and never a spare. The ``Memory``
of GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine Learning",
ICDCS 2021) is the same idea with one buffer.
"""

from __future__ import annotations

from typing import TypeGuard

import torch

from ..core.buffers import long_lived_empty, long_lived_zeros

__all__ = ["ResidualStore"]


class ResidualStore:
    """The residual (``current``, ``None`` until the first call) and its spare buffer."""

    __slots__ = ("current", "spare")

    def __init__(self) -> None:
        self.current: torch.Tensor | None = None
        self.spare: torch.Tensor | None = None

    def for_update(self, like: torch.Tensor) -> torch.Tensor:
        """The residual, created as zeros like ``like`` on first use (or when n, dtype or device
        change), for a method that updates it in place."""
        if not _fits(self.current, like):
            self.current = long_lived_zeros(like.shape, dtype=like.dtype, device=like.device)
        assert self.current is not None
        return self.current

    def peek(self, like: torch.Tensor) -> torch.Tensor:
        """The residual when it fits ``like``, else zeros like it that are not kept: what a call reads
        before it knows it goes on, changing nothing."""
        return self.current if _fits(self.current, like) else torch.zeros_like(like)

    def spare_for(self, like: torch.Tensor) -> torch.Tensor:
        """The spare buffer like ``like`` (contents undefined), reused across calls; never the residual."""
        spare = self.spare
        if not _fits(spare, like) or (self.current is not None and spare.data_ptr() == self.current.data_ptr()):
            self.spare = spare = long_lived_empty(like.shape, dtype=like.dtype, device=like.device)
        return spare

    def commit(self, acc: torch.Tensor) -> None:
        """Make ``acc`` (the :meth:`spare_for` buffer) the residual; the old residual becomes the spare."""
        self.current, self.spare = acc, self.current


def _fits(buffer: torch.Tensor | None, like: torch.Tensor) -> TypeGuard[torch.Tensor]:
    """Whether ``buffer`` can stand for a tensor like ``like``: same shape, dtype and device."""
    return buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype \
        and buffer.device == like.device
