"""CLT-k, cyclic local top-k (Chen et al., ScaleCom, NeurIPS 2020; reference [16] of ExDyna, which
uses it as a comparator: ExDyna section III).

At step t the *leader* ``t mod P`` selects the exact top-k of its ``acc = grad + residual``; its k
indices are broadcast to every rank, and every rank's ``acc`` at those indices is summed by an
all-reduce. All ranks zero ``acc`` there and keep the rest as residual. Exactly k coordinates per
step, whatever P (no gradient build-up), but the P-1 other ranks idle while the leader selects, and
a rank leads only every P steps.

Cost per rank: a binomial-tree broadcast of k indices from the leader (vrank = (rank - leader) mod
P; at round mask = 1, 2, 4, ... the ranks with vrank < mask send to vrank + mask; a non-leader
receives once, in the round where mask <= vrank < 2 mask; only rounds a rank takes part in count),
then the chosen all-reduce (Rabenseifner default, or ring) of k values.
``cost("cltk", P, n, k, rank, leader=t % P, allreduce=...)`` is exact.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.cost import Cost, register_cost
from ..selection import make as make_selector
from ..selection.metrics import SparsificationMetrics
from ..selection.scan import Scratch, take_and_clear
from ..transport.chunk import index_dtype
from ..transport.collectives import allreduce, allreduce_cost, check_allreduce
from ..transport.comm import Communicator
from ..transport.merge import ascending
from .accumulation import add_checked
from .base import Layout, Method, Output, register_method

__all__ = ["CyclicLocalTopk", "binomial_broadcast"]



def binomial_broadcast(comm: Communicator, tensor: torch.Tensor, root: int) -> torch.Tensor:
    """Broadcast ``tensor`` (contiguous; its size known everywhere) from ``root``, in place.

    ceil(log2 P) rounds of a binomial tree; returns ``tensor``.
    """
    P, r = comm.size, comm.rank
    vrank = (r - root) % P
    mask = 1
    while mask < P:
        if vrank < mask and vrank + mask < P:
            comm.sendrecv(tensor, (r + mask) % P, None, None)
        elif mask <= vrank < 2 * mask:
            comm.sendrecv(None, None, tensor, (r - mask) % P)
        mask *= 2
    return tensor


def _binomial_broadcast_cost(P: int, m: int, rank: int, root: int, itemsize: int) -> Cost:
    vrank = (rank - root) % P
    rounds = sent = recv = 0
    mask = 1
    while mask < P:
        if vrank < mask and vrank + mask < P:
            rounds += 1
            sent += m
        elif mask <= vrank < 2 * mask:
            rounds += 1
            recv += m
        mask *= 2
    return Cost(rounds, sent * itemsize, recv * itemsize)


@register_method("cltk")
class CyclicLocalTopk(SparsificationMetrics, Method):
    """CLT-k: the step's leader selects the top-k, broadcasts the indices, values are all-reduced.

    Args:
        density: k = ceil(density * n).
        allreduce: ``"rabenseifner"`` (default) or ``"ring"`` for the k values.
        global_error: also report the error metrics, local and global error (a pass over the
            residual and one extra exchange after the metered call, per call).

    Stats: ``leader``; ``counts`` (k for the leader, 0 elsewhere); ``padding_overhead`` is 1.0
    (a broadcast pads nothing).
    """

    sparse = True
    has_residual = True

    def __init__(self, comm=None, *, density: float, allreduce: str = "rabenseifner",
                 global_error: bool = False) -> None:
        super().__init__(comm, density=density)
        self.allreduce = check_allreduce(allreduce, "cltk")
        self.track_global_error = bool(global_error)
        self.selector = make_selector("exact_topk")
        self._scratch = Scratch()  # the plain fused scan's buffers (the ranks that do not lead)

    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor,
                   layout: Layout) -> torch.Tensor | None:
        """``acc = residual + grad``: in the leader's selection scan (its top-k returned), elsewhere in
        the plain fused scan."""
        if self.comm.rank == self.step % self.comm.size:
            return self.selector.accumulate(residual, grad, self.k(grad.numel()), dest=acc)
        with self.timer("residual"):
            add_checked(residual, grad, acc, self._scratch, self.name)
        return None

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        n, P, r = grad.numel(), self.comm.size, self.comm.rank
        k = self.k(n)
        leader = self.step % P
        acc, selected, _ = out.accumulated  # acc is the residual from here on
        if r == leader:
            indices = ascending(selected).to(index_dtype(n))
        else:
            indices = torch.empty(k, dtype=index_dtype(n), device=grad.device)
        with self.timer("comm"):
            binomial_broadcast(self.comm, indices, leader)
        chosen = indices.long()
        with self.timer("residual"):
            taken = take_and_clear(acc, chosen)  # acc keeps the rest
        with self.timer("comm"):
            summed = allreduce(self.comm, taken, self.allreduce)
        with self.timer("decompress"):
            result = out.average([chosen], [summed], P, keep_sign=True)  # summed / P, 0 elsewhere
        self.stats.update(selected=k if r == leader else 0, nnz_out=k, leader=leader,
                          counts=[k if q == leader else 0 for q in range(P)], padding_overhead=1.0)
        return result


@register_cost("cltk")
def _cltk_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, leader: int = 0,
               allreduce: str = "rabenseifner", **_: Any) -> Cost:
    index_size = index_dtype(n).itemsize
    broadcast = _binomial_broadcast_cost(P, k, rank, leader % P, index_size)
    return broadcast + allreduce_cost(allreduce, P=P, n=k, rank=rank, itemsize=itemsize)
