"""A method that hands the runner the start of its call: local top-k with error feedback, all-gathered.

Every rank adds its residual to its gradient and selects the k = ceil(density * n) largest magnitudes
of the sum in one pass (:meth:`~sparsecomm.methods.base.Method.accumulate`); its message, those
entries, is an all-gather (:meth:`~sparsecomm.methods.base.Method.first_message`); every rank averages
the P messages. This is TopkA (``sparsecomm/methods/topka.py``) in a few lines, and it gets what TopkA
gets from the runner without a line about it: on the CPU the selection's pass also counts the
gradient's NaN/Inf for the call's checks, and on gloo and MPI the all-gather travels in the checks'
own messages (``stats.extra["gathered_in_agreement"]``), ceil(log2 P) messages per call in all.
docs/adding-a-method.md explains the contract.

Cost per rank: an all-gather of P messages of k (index, value) pairs, ceil(log2 P) rounds and
(P - 1) k (s_idx + s_val) bytes each way (:func:`~sparsecomm.transport.sparse_collectives.allgatherv_cost`).

Imported from outside ``sparsecomm/methods/`` it registers ``"eftopk"`` in the importing process only
(``tests/test_examples.py`` imports it inside its workers).
"""

from __future__ import annotations

from typing import Any

import torch

from sparsecomm.core.cost import Cost, register_cost
from sparsecomm.methods.accumulation import AllGather
from sparsecomm.methods.base import Layout, Method, Output, register_method
from sparsecomm.selection import make as make_selector
from sparsecomm.selection.scan import take_and_clear
from sparsecomm.transport.chunk import SparseChunk, index_dtype, pair_bytes
from sparsecomm.transport.sparse_collectives import allgather_chunks, allgatherv_cost


@register_method("eftopk")
class ErrorFeedbackTopK(Method):
    """Local top-k with error feedback, all-gathered and averaged.

    Args:
        comm: communicator (default: all ranks).
        density: k = ceil(density * n) entries per rank.
    """

    sparse = True
    has_residual = True

    def __init__(self, comm=None, *, density: float) -> None:
        super().__init__(comm, density=density)
        self.selector = make_selector("exact_topk")  # keeps no state between calls

    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, layout: Layout) -> torch.Tensor:
        # acc = residual + grad and its k largest magnitudes, in one pass that raises on NaN/Inf
        return self.selector.accumulate(residual, grad, self.k(grad.numel()), dest=acc)

    def first_message(self, acc: torch.Tensor, picked: torch.Tensor) -> AllGather:
        with self.timer("select"):
            indices = picked.sort().values  # sorted: the receivers merge the messages in one sweep
            chunk = SparseChunk(indices.to(index_dtype(acc.numel())), take_and_clear(acc, indices))
        self.stats.selected = chunk.nnz  # acc keeps what was not sent: the residual
        index_type, value_type = chunk.indices.dtype, chunk.values.dtype

        def send() -> list[SparseChunk]:  # the all-gather, where the runner does not carry it
            with self.timer("comm"):
                return allgather_chunks(self.comm, chunk)
        return AllGather(parts=chunk.parts(), send=send,
                         unpack=lambda blocks: [SparseChunk.from_bytes(b, index_type, value_type) for b in blocks])

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        gathered = out.accumulated.replies  # every rank's message, in rank order
        with self.timer("decompress"):
            return out.average([c.indices for c in gathered], [c.values for c in gathered], self.comm.size)


@register_cost("eftopk")
def _eftopk_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, **_: Any) -> Cost:
    return allgatherv_cost([k * pair_bytes(n, itemsize)] * P, P, rank, exact=True)
