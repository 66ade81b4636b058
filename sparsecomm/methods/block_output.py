"""The output of a method whose result is made of whole blocks (OmniReduce, S2 Reducer): shared by
those methods (a method module imports no other)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..transport.merge import Stale, average_blocks_into
from .base import Method

__all__ = ["output_average_blocks"]


def output_average_blocks(method: Method, like: Tensor, blocks: Tensor, block_size: int, values: Tensor,
                          divisor: int, *, keep_sign: bool = False) -> Tensor:
    """:meth:`Method.output_average` for a result made of whole blocks: element ``blocks[b] * block_size
    + j`` (below n) becomes ``values[b, j] / divisor``, every other element zero (``blocks``: increasing
    ids; ``values``: ``len(blocks) * block_size`` values). Written by
    :func:`~sparsecomm.transport.merge.average_blocks_into`, which touches only those blocks and the
    last call's groups, never building the index of every element; the same bits, records and
    ``stats.nnz_out`` as ``output_average`` given those indices."""
    out = method._call_out
    stale: Stale = "all"
    if out is None:
        out = torch.empty_like(like)
    else:
        stale = method._stale(out)
    method._out_support = None  # until the write succeeds
    written, nonzero = average_blocks_into(out, blocks, block_size, values, divisor, stale=stale,
                                           keep_sign=keep_sign)
    if method._call_out is not None:
        method._out_support = written
    if nonzero is not None:
        method.stats.nnz_out = nonzero
    return out
