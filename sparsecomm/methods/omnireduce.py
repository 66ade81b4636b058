"""OmniReduce: block-sparse aggregation of only the non-zero blocks (Fei et al., SIGCOMM'21), the
baseline of S2 Reducer's evaluation ([S2Reducer], section 4, Fig. 3 and 7).

Per call, on every rank:

1. ``acc = grad + residual``; the blocks of ``block_size`` elements with the largest L2 norm are
   selected whole (``selectors.make("block_topk")``, its energies taken chunk by chunk as the sum is
   written, whose total also tells whether the gradient is finite: one read of
   gradient and residual, one write of ``acc``), at least k = ceil(density * n) elements; the
   rest of ``acc`` stays in the residual (error feedback, nothing lost). With density 1 every block
   is selected and OmniReduce is what its paper describes: a lossless all-reduce that skips the
   all-zero blocks of an already sparse gradient (embedding layers, block-sparsified gradients).
2. The selected blocks that are not all zero go to their shard's aggregator and the non-zero sums
   come back by an all-gather (:func:`~sparsecomm.transport.block_aggregate.block_allreduce`: an
   all-to-all of P - 1 rounds, then ceil(log2 P) rounds). The last block is padded with zeros on
   the wire when ``block_size`` does not divide n.
3. Divide by P, written into the output block by block
   (:func:`~sparsecomm.transport.merge.average_blocks_into`: only the result blocks and the last call's
   are touched).

Cost (:func:`_omnireduce_cost`): P - 1 + ceil(log2 P) rounds; exact from the block counts the call
records (stats ``block_counts``, ``result_blocks``); from k alone an upper bound (every rank's
ceil(k / block_size) + 1 blocks fall into every shard, every shard's sum has P times as many).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..core.cost import Cost, chunk_sizes, register_cost
from ..core.validate import check_int
from ..selection.block import BlockTopK, gather_blocks, zero_blocks
from ..transport.block_aggregate import block_allreduce, block_allreduce_traffic
from ..transport.comm import Communicator
from .base import Layout, Method, Output, register_method

__all__ = ["OmniReduce"]


@register_method("omnireduce")
class OmniReduce(Method):
    """Block top-K with error feedback, aggregation of the non-zero blocks (module docstring).

    Args:
        density: at least k = ceil(density * n) elements selected per rank, in whole blocks.
        block_size: elements per block (default 256, OmniReduce's default block).
    """

    sparse = True
    has_residual = True
    tracks_sent = True

    def __init__(self, comm: Communicator | None = None, *, density: float, block_size: int = 256) -> None:
        super().__init__(comm, density=density)
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.selector = BlockTopK(block_size=block_size)  # selectors.make("block_topk")

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad``, added chunk by chunk as the block energies are taken (whose sum
        tells whether the gradient is finite); returns the selected blocks."""
        return self.selector.accumulate_blocks(residual, grad, self.k(grad.numel()), acc)

    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        n, P, B = grad.numel(), self.comm.size, self.block_size
        acc, blocks, _ = out.accumulated  # acc is the residual from here on
        with self.timer("select"):
            values = gather_blocks(acc, blocks, B)          # (blocks, B), zero past n
        with self.timer("residual"):
            zero_blocks(acc, blocks, B)                     # what stays: acc minus what is sent
        with self.timer("select"):
            self.last_sent = self.selector.elements(blocks, n)
            nonzero = values.ne(0).any(1)
            blocks, values = blocks[nonzero], values[nonzero]
        self.stats.selected = self.last_sent.numel()
        with self.timer("comm"):
            ids, sums, counts = block_allreduce(self.comm, blocks, values, num_blocks=math.ceil(n / B))
        with self.timer("decompress"):
            # out = sums / P on the result blocks (sorted ids) and 0 elsewhere, in one pass over those
            # blocks and the last call's, which also counts stats.nnz_out
            result = out.average_blocks(ids, B, sums, P, keep_sign=True)
        self.stats["blocks_sent"] = blocks.numel()
        self.stats["block_counts"] = counts["sent"]
        self.stats["result_blocks"] = counts["result"]
        return result

    def __repr__(self) -> str:
        return f"OmniReduce(P={self.comm.size}, density={self.density:g}, block_size={self.block_size})"


@register_cost("omnireduce")
def _omnireduce_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, block_size: int = 256,
                     block_counts: Sequence[Sequence[int]] | None = None,
                     result_blocks: Sequence[int] | None = None, **_: Any) -> Cost:
    """Exact with ``block_counts[s][q]`` (blocks rank s sends to shard q) and ``result_blocks[q]``;
    otherwise the bound of the module docstring."""
    num_blocks = math.ceil(n / block_size)
    if block_counts is not None and result_blocks is not None:
        return Cost(*block_allreduce_traffic(block_counts, result_blocks, rank, num_blocks, block_size, itemsize))
    shards = chunk_sizes(num_blocks, P)
    per_rank = min(num_blocks, math.ceil(k / block_size) + 1)
    sent = [[min(per_rank, s) for s in shards] for _ in range(P)]
    result = [min(P * per_rank, s) for s in shards]
    return Cost(*block_allreduce_traffic(sent, result, rank, num_blocks, block_size, itemsize), exact=False)
