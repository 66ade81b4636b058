"""S2 Reducer (Sparse-Sketch Reducer): block-wise top-K, then a count-sketch of the selected values and
a bitmap of the selected blocks, both summed by all-reduce ([S2Reducer], section 3.1,
Algorithm 1).

Per call, on every rank:

1. ``acc = grad + residual``; block-wise top-K by L2 norm (``selectors.make("block_topk")``, section
   2.2) picks whole blocks of ``block_size`` elements, at least k = ceil(density * n) elements; the
   rest of ``acc`` stays in the residual (error feedback). The sum is written chunk by chunk as the
   block energies are taken, whose total also tells whether the gradient is
   finite: one read of gradient and residual and one write of ``acc``.
2. Insert the selected values into a ``rows`` x ``cols`` count-sketch (:mod:`sparsecomm.selection.sketch`)
   with ``rows * cols ~= sketch_ratio * k`` (the paper's lambda, 0.5 its best setting); mark the
   selected blocks in the bitmap (Algorithm 1 lines 2-7). The hashes are seeded by ``(seed, step)``,
   the same on every rank.
3. All-reduce the sketch table and the bitmap (line 8) with the metered Rabenseifner all-reduce
   (``allreduce="ring"`` for the ring).
4. Every element of a block set in the summed bitmap is queried as the median over the rows
   (lines 9-15); the rest of the output is zero. Divide by P. On the CPU, C kernels hash and insert
   (:meth:`CountSketch.insert`), query the union block by block (:meth:`CountSketch.query_blocks`) and
   write it into the output (:func:`~sparsecomm.transport.merge.average_blocks_into`), touching only
   the union's blocks and the last call's.

Both all-reduces give every rank the same table and bitmap and the query is deterministic, so
every rank returns the same bits.

Conservation: the selected-vs-residual split is exact, sum over ranks of (grad + old residual) =
S + sum of new residuals, with S the sum of the selections. The output estimates S / P: it is exact
when the sketch has no collision (``cols >= 2^ceil(log2 n)``, see :attr:`CountSketch.exact`) and
otherwise carries the sketch's estimation error (zero in expectation, Theorem 1), which is not fed
back to any residual. ``measure_error=True`` measures it (stats ``sketch_error``: ||out - S/P|| /
||S/P||, ``sketch_error_max``: max |out - S/P|) with one extra dense all-reduce of the selections.

Departures from the paper: the bitmap travels as one unsigned byte per block holding the number of
ranks that selected it (int32 when P > 255), since the all-reduce sums; a bit-packed OR would be 8x
smaller. The sketch size uses the target k, known to every rank before selection.

Cost per rank: ``AR(P, x, s)`` = the all-reduce's cost for x elements of s bytes
(:func:`~sparsecomm.transport.collectives.allreduce_cost`); exact::

    AR(P, rows * cols, itemsize) + AR(P, ceil(n / block_size), bitmap bytes)
    [+ AR(P, n, itemsize) with measure_error]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..core.cost import Cost, register_cost
from ..core.validate import check_int, is_number
from ..selection.block import BlockTopK, gather_blocks, zero_blocks
from ..selection.sketch import CountSketch
from ..transport.collectives import allreduce, allreduce_cost, check_allreduce
from ..transport.comm import Communicator
from ..transport.merge import nonzero_positions
from .base import Layout, Method, Output, register_method

__all__ = ["SparseSketchReducer", "sketch_shape", "bitmap_dtype"]

#: the all-reduce functions by option name; each name is also that algorithm's cost formula
_SEED_STRIDE = 1_000_003


def sketch_shape(k: int, sketch_ratio: float, rows: int) -> tuple:
    """(rows, cols) with rows * cols ~= sketch_ratio * k buckets (at least one column)."""
    return rows, max(1, math.ceil(sketch_ratio * k / rows))


def bitmap_dtype(P: int) -> torch.dtype:
    """One byte per block while the count of ranks fits in it."""
    return torch.uint8 if P <= 255 else torch.int32


@register_method("s2reducer")
class SparseSketchReducer(Method):
    """S2 Reducer with error feedback (see the module docstring).

    Args:
        density: at least k = ceil(density * n) elements selected per rank, in whole blocks.
        sketch_ratio: lambda, sketch buckets per selected element (> 0; default 0.5, the paper's best).
        rows: rows of the count-sketch, the estimates a median is taken over (default 3).
        block_size: elements per block of the block top-K and the bitmap (default 32).
        seed: hash seed; step t uses ``seed * 1000003 + t`` on every rank.
        allreduce: ``"rabenseifner"`` (default, latency-optimal for small sketches) or ``"ring"``.
        measure_error: also all-reduce the exact selections to report the sketch error (costs a
            dense all-reduce; for experiments).
    """

    sparse = True
    tracks_sent = True
    #: one row with at least 2^ceil(log2 n) columns: the hash is a permutation, so no collisions
    exact_options = {"rows": 1, "sketch_ratio": 2.0}
    has_residual = True

    def __init__(self, comm: Communicator | None = None, *, density: float, sketch_ratio: float = 0.5,
                 rows: int = 3, block_size: int = 32, seed: int = 0, allreduce: str = "rabenseifner",
                 measure_error: bool = False) -> None:
        super().__init__(comm, density=density)
        if not is_number(sketch_ratio) or sketch_ratio <= 0:
            raise ValueError(f"sketch_ratio={sketch_ratio!r} must be a positive number (sketch buckets "
                             f"per selected element)")
        check_int("rows", rows, minimum=1)
        self.sketch_ratio = float(sketch_ratio)
        self.rows = rows
        self.block_size = block_size
        self.seed = int(seed)
        self.allreduce_name = check_allreduce(allreduce, "s2reducer")
        self.measure_error = bool(measure_error)
        self.selector = BlockTopK(block_size=block_size)  # selectors.make("block_topk")

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad``, added chunk by chunk as the block energies are taken (whose sum
        tells whether the gradient is finite); returns the selected blocks."""
        return self.selector.accumulate_blocks(residual, grad, self.k(grad.numel()), acc)

    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        n, P, B = grad.numel(), self.comm.size, self.block_size
        k = self.k(n)
        rows, cols = sketch_shape(k, self.sketch_ratio, self.rows)
        sketch = CountSketch(n, rows, cols, seed=self.seed * _SEED_STRIDE + self.step)
        acc, blocks, _ = out.accumulated  # acc is the residual from here on
        with self.timer("select"):
            idx = self.selector.elements(blocks, n)          # increasing
            values = gather_blocks(acc, blocks, B).reshape(-1)[:idx.numel()]
        with self.timer("residual"):
            zero_blocks(acc, blocks, B)                      # what stays: acc minus what is sent
        with self.timer("select"):
            table = sketch.insert(sketch.empty_table(grad.dtype, grad.device), idx, values)
            bitmap = torch.zeros(math.ceil(n / B), dtype=bitmap_dtype(P), device=grad.device)
            bitmap[blocks] = 1
        self.last_sent = idx
        self.stats["selected"] = idx.numel()
        with self.timer("comm"):
            table = allreduce(self.comm, table.reshape(-1), self.allreduce_name).view(rows, cols)
            bitmap = allreduce(self.comm, bitmap, self.allreduce_name)
        with self.timer("decompress"):
            union = nonzero_positions(bitmap)                # the blocks any rank selected, increasing
            # out = estimate / P on the union's elements and 0 elsewhere: the queries block by block,
            # then one write of those blocks (and the last call's) that also counts stats.nnz_out
            estimates = sketch.query_blocks(table, union, B)
            result = out.average_blocks(union, B, estimates, P, keep_sign=True)
        short = -n % B if union.numel() and int(union[-1]) == n // B else 0  # the short last block's gap
        union_nnz = union.numel() * B - short
        self.stats.update(union_nnz=union_nnz, sketch_cells=rows * cols)
        if self.measure_error:
            self._measure_error(result, idx, values)
        return result

    def _measure_error(self, out: Tensor, idx: Tensor, values: Tensor) -> None:
        """stats sketch_error / sketch_error_max against the exact average of the selections."""
        selected = torch.zeros_like(out)
        selected[idx] = values
        with self.timer("comm"):
            exact = allreduce(self.comm, selected, self.allreduce_name).div_(self.comm.size)
        err = out.double() - exact.double()
        scale = exact.double().norm().item()
        self.stats["sketch_error"] = err.norm().item() / scale if scale else err.norm().item()
        self.stats["sketch_error_max"] = err.abs().max().item() if err.numel() else 0.0

    def __repr__(self) -> str:
        return (f"SparseSketchReducer(P={self.comm.size}, density={self.density:g}, "
                f"sketch_ratio={self.sketch_ratio:g}, rows={self.rows}, block_size={self.block_size})")


@register_cost("s2reducer")
def _s2reducer_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, sketch_ratio: float = 0.5,
                    rows: int = 3, block_size: int = 32, allreduce: str = "rabenseifner",
                    measure_error: bool = False, **_: Any) -> Cost:
    """Exact: the all-reduce of the sketch table and of the bitmap (see the module docstring)."""
    check_allreduce(allreduce, "s2reducer")
    r, c = sketch_shape(k, sketch_ratio, rows)
    bitmap_bytes = bitmap_dtype(P).itemsize
    total = allreduce_cost(allreduce, P=P, n=r * c, rank=rank, itemsize=itemsize) + \
        allreduce_cost(allreduce, P=P, n=math.ceil(n / block_size), rank=rank, itemsize=bitmap_bytes)
    if measure_error:
        total = total + allreduce_cost(allreduce, P=P, n=n, rank=rank, itemsize=itemsize)
    return total
