"""A new synchronization method in one file: random-k with error feedback.

Every rank selects the same k = ceil(density * n) coordinates, drawn at random from a generator
seeded by the step (so no indices are sent), adds its residual, all-reduces the k values with
Rabenseifner's algorithm and keeps what it did not send as its residual. It is the smallest method
that satisfies every invariant; docs/adding-a-method.md walks through it.

Cost per rank: Rabenseifner's all-reduce of k values, ``rabenseifner_cost(P, k)``: 2 log2 p' - 1
rounds (+2 when P is not a power of two) and about 2 k (P-1)/P values sent.

Placed in ``sparsecomm/methods/`` this file is found automatically; imported from anywhere else it
registers ``"randk"`` in the importing process (``tests/test_examples.py`` imports it inside its
workers only).
"""

from __future__ import annotations

from typing import Any

import torch

from sparsecomm.core.cost import Cost, register_cost
from sparsecomm.methods.base import Method, Output, register_method
from sparsecomm.transport.collectives import allreduce, allreduce_cost


@register_method("randk")
class RandomK(Method):
    """Random-k: the same k random coordinates on every rank, all-reduced, with error feedback.

    Args:
        comm: communicator (default: all ranks).
        density: k = ceil(density * n).
        seed: seeds the coordinates of each step (the same on every rank).
    """

    sparse = True
    has_residual = True

    def __init__(self, comm=None, *, density: float, seed: int = 0) -> None:
        super().__init__(comm, density=density)
        self.seed = int(seed)

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        n, P, k = grad.numel(), self.comm.size, self.k(grad.numel())
        with self.timer("residual"):
            acc = self.residual_for(grad).add_(grad)  # acc is self.residual, updated in place
        with self.timer("select"):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
            chosen = torch.randperm(n, generator=generator)[:k].sort().values.to(grad.device)
        with self.timer("comm"):
            summed = allreduce(self.comm, acc[chosen], "rabenseifner")  # cost: _randk_cost below
        with self.timer("decompress"):
            result = out.zeros()  # the caller's out= tensor, zeroed where the last call wrote, or a new one
            result[chosen] = summed.div_(P)
            out.written(chosen)
        with self.timer("residual"):
            acc.index_fill_(0, chosen, 0)  # sent: nothing of it stays behind
        self.stats.update(selected=k, nnz_out=k)
        return result


@register_cost("randk")
def _randk_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, **_: Any) -> Cost:
    return allreduce_cost("rabenseifner", P=P, n=k, rank=rank, itemsize=itemsize)
