"""gTop-k: global top-k by a reduction tree and a broadcast tree (Shi et al., ICDCS 2019), the
baseline of SparDL's Table I ([SparDL], "gTopk": 2 log P alpha, 4 k log P beta).

Per call, on every rank r:

1. ``acc = grad + residual``; keep the local top-k of ``acc`` (exact), the rest stays in the residual.
   The sum is written inside the selection's scan, which also tells whether the gradient is finite
   (:meth:`GlobalTopk.accumulate`).
2. Reduction along a binomial tree to rank 0: at step ``mask`` = 1, 2, 4, ... a rank whose lowest
   set bit is ``mask`` sends its current k-sparse vector (indices, values) to ``r - mask`` and leaves;
   a rank receiving from ``r + mask`` adds the two by index and keeps the top-k of the sum. What the
   merge discards stays in *that* rank's residual (SparDL's "in-procedure residual" rule), so no
   gradient is lost.
3. Broadcast of the root's k-sparse vector along the same tree, in reverse.
4. Every rank scatters the k values into a dense zero vector and divides by P.

The original runs only on powers of two; binomial trees make it correct for every P.
Cost per rank: each tree edge is one round carrying at most k indices + k values; over the two
trees a rank takes part in at most 2 ceil(log2 P) rounds and sends at most (its edges) * 2k elements
(Table I's 4 k log P for the root's edges). Exact figures are data-dependent (a merge of two
k-sparse vectors may hold fewer than k non-zeros), so the formula is an upper bound.
"""

from __future__ import annotations

import torch

from ..core.cost import Cost, register_cost
from ..selection import make as make_selector
from ..selection.scan import largest_of_chunk, take_and_clear
from ..transport.chunk import SparseChunk, add_chunks, index_dtype
from .base import Layout, Method, Output, register_method


def tree_schedule(P: int, rank: int) -> list[tuple[str, int]]:
    """This rank's reduction-tree steps in order: ``("recv", child)`` or ``("send", parent)``.

    The broadcast tree is the same list reversed with the roles swapped.
    """
    steps: list[tuple[str, int]] = []
    mask = 1
    while mask < P:
        if rank & mask:
            steps.append(("send", rank - mask))
            break
        if rank + mask < P:
            steps.append(("recv", rank + mask))
        mask *= 2
    return steps


@register_method("gtopk")
class GlobalTopk(Method):
    """gTop-k sparse all-reduce with error feedback (see the module docstring).

    Args:
        density: k = ceil(density * n) values survive globally.
    """

    sparse = True
    has_residual = True

    def __init__(self, comm=None, *, density: float) -> None:
        super().__init__(comm, density=density)
        self.selector = make_selector("exact_topk")  # exact top-k by a sampled floor and one scan

    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, layout: Layout) -> torch.Tensor:
        """``acc = residual + grad`` and its local top-k, in one scan."""
        return self.selector.accumulate(residual, grad, self.k(grad.numel()), dest=acc)

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        comm, n = self.comm, grad.numel()
        k = self.k(n)
        acc, local_idx, _ = out.accumulated  # acc is the residual from here on
        with self.timer("residual"):
            held = SparseChunk(local_idx.to(index_dtype(n)), take_and_clear(acc, local_idx))  # acc keeps the rest
        self.stats["selected"] = k
        current: SparseChunk | None = held          # None once this rank handed its chunk to its parent
        for role, peer in tree_schedule(comm.size, comm.rank):
            if role == "send":
                with self.timer("comm"):
                    comm.exchange_many(peer, held.parts(), None, count=0)
                current = None
                break
            with self.timer("comm"):
                received = self._receive(peer, n, grad)
            with self.timer("select"):
                held, dropped = largest_of_chunk(add_chunks([held, received]), k)
                current = held
                dropped.scatter_add_(acc)              # in-procedure residual stays here
        with self.timer("comm"):
            current = self._broadcast(current, n, grad)
        with self.timer("decompress"):
            # values / P at the (sorted) indices, 0 elsewhere
            result = out.average([current.indices], [current.values.to(grad.dtype)], comm.size, keep_sign=True)
        self.stats["nnz_out"] = current.nnz
        return result

    def _broadcast(self, chunk: SparseChunk | None, n: int, grad: torch.Tensor) -> SparseChunk:
        """Send the root's chunk down the reduction tree, in reverse order of its edges."""
        comm = self.comm
        for role, peer in reversed(tree_schedule(comm.size, comm.rank)):
            if role == "send":      # my parent in the reduction tree is my parent here: receive
                chunk = self._receive(peer, n, grad)
            else:
                assert chunk is not None, "a rank forwards down the tree only after it holds the result"
                comm.exchange_many(peer, chunk.parts(), None, count=0)
        assert chunk is not None
        return chunk

    def _receive(self, peer: int, n: int, grad: torch.Tensor) -> SparseChunk:
        """One packed (indices, values) message of unknown length from ``peer``."""
        indices, values = self.comm.exchange_many(None, [], peer, count=2,
                                                  dtypes=[index_dtype(n), grad.dtype], device=grad.device)
        return SparseChunk(indices, values)


@register_cost("gtopk")
def _gtopk_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, **_) -> Cost:
    """Upper bound: every tree edge of this rank carries at most k (index, value) pairs."""
    edges = tree_schedule(P, rank)
    idx_size = 4 if n < 2 ** 31 else 8
    per_message = k * (idx_size + itemsize)
    sends = sum(1 for role, _ in edges if role == "send") + sum(1 for role, _ in edges if role == "recv")
    # reduction: sends to parent; broadcast: sends to each child
    return Cost(2 * len(edges), sends * per_message, sends * per_message, exact=False)
