"""HiTopKComm: hierarchical top-k communication for m nodes x L GPUs, Shi et al., "Towards Scalable
Distributed Training of Deep Learning on Public Cloud Clusters" ([ShiCloud]), section
3.2, Algorithm 2, equations (4)-(10).

The P ranks form m = P / L nodes of L consecutive ranks (``local_size`` = L, see
:func:`~sparsecomm.methods.torus2d.resolve_local_size`). Per call, on rank (node i, local rank j):

1. Intra-node ring reduce-scatter of the gradient (Algorithm 2 lines 2-4, equation (4)): rank j
   holds shard j = ``chunk_offsets(n, L)[j]`` summed over its node.
2. Error feedback (not in Algorithm 2, which the paper runs inside MSTopK-SGD with residuals):
   ``acc = shard + residual[shard]``. The residual lives on the shard's owner, the only rank that
   ever sees that node-summed shard. With one rank per node (L = 1) the shard is the gradient
   itself: nothing is copied, the selection's scan adds it and also checks its finiteness
   (:meth:`HiTopKComm.accumulate`; MSTopK's generator is put back if the call does not go on,
   :meth:`HiTopKComm.moved_by_accumulate`). With L > 1 the reduce-scatter comes first and the
   residual's shard is updated in place.
3. ``k_j = ceil(density * c_j)`` entries of ``acc`` by MSTopK (lines 5-8, equation (5); ``selector``
   option); the rest stays in ``residual[shard]``.
4. Inter-node all-gather of the (indices, values) among the m ranks with local rank j (lines 11-14),
   and their sum by index in node order (lines 15-20, equation (6)): the union of the m selections.
5. Intra-node all-gather of the L shard unions (lines 21-23), sparse as equation (10) counts it;
   every rank scatters them into zeros and divides by P.

Every rank with local rank j sums the same m messages in the same order, so all ranks hold the same
bits. Conservation: sum over ranks of (grad + old residual) = sum over shards of acc = (sum of the
selections) + (new residuals) = P * out + sum of new residuals.

Cost per rank (``s_i`` index bytes, ``s`` value bytes, c = chunk sizes of n over L, u_q the union
size of shard q, ``AG(p, sizes, r)`` = :func:`~sparsecomm.transport.sparse_collectives.allgatherv_traffic`)::

    reduce-scatter (7):   L-1 rounds,            (n - c_j) s sent,    (n - c_(j-1)) s received
    inter-node AG (9):    ceil(log2 m) rounds,   AG(m, [k_j (s_i + s)] * m, i)
    intra-node AG (10):   ceil(log2 L) rounds,   AG(L, [u_q (s_i + s) for q < L], j)

Rounds are exact; bytes are exact given the union sizes (``union_sizes`` option, the ``union_nnz``
stat of the L ranks of a node), otherwise a bound with u_q <= min(m k_q, c_q).

Inter-node bytes (what crosses the node NIC when the job's nodes are the method's, e.g. under
``run_workers(P, fn, net="2x4:1gbit")``) are exactly the inter-node all-gather's, eq. (9):
``AG(m, [k_j (s_i + s)] * m, i)`` (cost ``"hitopk_inter_node"``); the paper's eq. (9) counts
4 (m - 1) rho d / n bytes of values, the pairs double it. :func:`paper_bytes` gives eq. (7), (9) and
(10) in bytes, as the paper writes them (the hierarchy benchmark prints them beside the meter).

Only one node (m = 1, e.g. ``torchrun`` or ``run_workers`` on one machine, where
``LOCAL_WORLD_SIZE`` = P): stage 1 is then a dense reduce-scatter of the whole gradient over all
ranks and there is no inter-node stage. The method logs a warning when it is built and sets
``stats.dense_fallback`` on every call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..core.cost import Cost, chunk_offsets, chunk_sizes, register_collective_cost, register_cost
from ..selection import make as make_selector
from ..selection.scan import take_and_clear
from ..transport.chunk import SparseChunk, add_chunks, index_dtype, pair_bytes
from ..transport.collectives import ring_reduce_scatter
from ..transport.comm import Communicator
from ..transport.merge import ascending
from ..transport.sparse_collectives import allgather_chunks, allgatherv_traffic
from ..transport.topology import resolve_local_size, split_nodes
from .base import Layout, Method, Output, register_method, selection_count
from .select_allgather import SelectorStateMixin

__all__ = ["HiTopKComm", "paper_bytes"]

log = logging.getLogger(__name__)


@register_method("hitopk")
class HiTopKComm(SelectorStateMixin, Method):
    """HiTopKComm (Algorithm 2) with error feedback on each shard's owner (see the module docstring).

    Args:
        density: fraction of each shard selected, k_j = ceil(density * c_j) (the paper's rho d / n).
        local_size: ranks per node L (consecutive ranks share a node); must divide P. Default:
            ``LOCAL_WORLD_SIZE`` from the environment (``torchrun`` sets it), else 1: every rank is
            its own node and the method is MSTopK + the flat all-gather of equation (3).
        selector: a name of :mod:`sparsecomm.selection` (default ``"mstopk"``, Algorithm 1).
        **selector_options: passed to ``sparsecomm.selection.make(selector, ...)``.

    Stats beyond the base class: ``union_nnz`` (the size of this rank's shard union after the
    inter-node sum, u_j), ``local_size``.
    """

    sparse = True
    has_residual = True

    def __init__(self, comm: Communicator | None = None, *, density: float,
                 local_size: int | None = None, selector: str = "mstopk", **selector_options: Any) -> None:
        super().__init__(comm, density=density)
        self.local_size, self.node, self.cross = split_nodes(self.comm, local_size)
        self.selector_name = selector
        self.selector = make_selector(selector, **selector_options)
        self.one_node = self.comm.size > 1 and self.cross.size == 1
        if self.one_node:
            log.warning("hitopk: all P=%d ranks form one node (local_size=%d, from %s): there is no "
                        "inter-node stage, and stage 1 is a dense reduce-scatter of the whole gradient "
                        "over every rank (stats.dense_fallback). Pass local_size= or run on several "
                        "nodes for the hierarchy.", self.comm.size, self.local_size,
                        "the argument" if local_size is not None else "LOCAL_WORLD_SIZE")

    @property
    def accumulates(self) -> bool:
        """With one rank per node: the shard is the gradient, and the selection's scan of ``acc =
        residual + grad`` also tells whether it is finite (:meth:`accumulate`)."""
        return self.node.size == 1

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad`` and the shard's (the gradient's) k_j entries, in one scan."""
        return self.selector.accumulate(residual, grad, self.k(grad.numel()), dest=acc)

    def moved_by_accumulate(self) -> list[Any]:
        """The selector (MSTopK draws from a generator)."""
        return [self.selector]

    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        n = grad.numel()
        start, size = chunk_offsets(n, self.node.size)[self.node.rank]
        if out.accumulated is not None:  # the whole gradient is this rank's shard
            acc, selected, _ = out.accumulated
            with self.timer("select"):
                idx = ascending(selected)
        else:
            with self.timer("comm"):
                shard = ring_reduce_scatter(self.node, grad)
            acc = self.residual_for(grad)[start:start + size]   # a view: the residual is updated in place
            with self.timer("select"):
                idx = ascending(self.selector.accumulate(acc, shard, self.k(size)))  # acc += shard in the scan
        with self.timer("residual"):
            mine = SparseChunk(idx.to(index_dtype(n)) + start, take_and_clear(acc, idx))  # acc keeps the rest
        self.stats["selected"] = idx.numel()
        with self.timer("comm"):
            across = allgather_chunks(self.cross, mine)
        with self.timer("select"):
            union = add_chunks(across)
        with self.timer("comm"):
            shards = allgather_chunks(self.node, union)
        with self.timer("decompress"):
            # the shards are disjoint and each sorted: one ordered sweep, divided on the way
            result = out.average([shard.indices for shard in shards], [shard.values for shard in shards],
                                 self.comm.size)
        self.stats["union_nnz"] = union.nnz
        self.stats["local_size"] = self.local_size
        self.stats.dense_fallback = self.one_node
        return result

    def __repr__(self) -> str:
        return f"HiTopKComm(P={self.comm.size}, density={self.density:g}, local_size={self.local_size})"


@register_cost("hitopk")
def _hitopk_cost(P: int, n: int, rank: int, itemsize: int = 4, density: float | None = None,
                 local_size: int | None = None, union_sizes: Sequence[int] | None = None,
                 **_: Any) -> Cost:
    """Equations (7), (9), (10) in rounds and bytes (see the module docstring). Needs ``density``
    (k is per shard, ceil(density * c_j)); ``union_sizes`` (one per local rank) makes bytes exact."""
    if density is None:
        raise ValueError("the hitopk cost needs density= (k is chosen per shard)")
    L = resolve_local_size(P, local_size)
    m = P // L
    node_id, j = divmod(rank, L)
    c = chunk_sizes(n, L)
    k = [selection_count(density, size) for size in c]
    per_element = pair_bytes(n, itemsize)
    exact = union_sizes is not None
    if union_sizes is None:
        union_sizes = [min(m * k[q], c[q]) for q in range(L)]
    elif len(union_sizes) != L:
        raise ValueError(f"union_sizes has {len(union_sizes)} entries, need one per local rank (L={L})")
    rs = Cost(L - 1, (n - c[j]) * itemsize, (n - c[(j - 1) % L]) * itemsize) if L > 1 else Cost(0, 0, 0)
    inter = Cost(*allgatherv_traffic([k[j] * per_element] * m, node_id))
    intra = Cost(*allgatherv_traffic([u * per_element for u in union_sizes], j))
    total = rs + inter + intra
    return total if exact else total.bound()


@register_collective_cost("hitopk_inter_node")
def _hitopk_inter_node_cost(P: int, n: int, rank: int, itemsize: int = 4, density: float | None = None,
                            local_size: int | None = None, **_: Any) -> Cost:
    """Exact inter-node traffic of one call, eq. (9): the all-gather of k_j pairs among the m ranks
    with local rank j (0 when m = 1). Equals the meter's ``inter_node_bytes_*`` when the job's
    nodes (``LOCAL_WORLD_SIZE``) are the method's ``local_size``."""
    if density is None:
        raise ValueError("the hitopk_inter_node cost needs density= (k is chosen per shard)")
    L = resolve_local_size(P, local_size)
    node_id, j = divmod(rank, L)
    k = selection_count(density, chunk_sizes(n, L)[j])
    return Cost(*allgatherv_traffic([k * pair_bytes(n, itemsize)] * (P // L), node_id))


def paper_bytes(P: int, n: int, density: float, local_size: int, itemsize: int = 4) -> dict[str, float]:
    """Bytes one rank sends per call by the paper's eq. (7), (9), (10) (Shi et al., section 3.2),
    with d = n elements, m = P / L nodes of L ranks, rho = density, values of ``itemsize`` bytes
    and indices as large again (the paper's formulas count the values only; pairs double them)::

        eq7_intra = s (L-1) d / L            (ring reduce-scatter inside the node)
        eq9_inter = 2 s (m-1) rho d / L      (all-gather of the selections across nodes)
        eq10_intra = 2 s (L-1) rho d m / L   (all-gather of the unions inside the node, all distinct)
    """
    L = local_size
    m = P // L
    return {"eq7_intra": itemsize * (L - 1) * n / L,
            "eq9_inter": 2 * itemsize * (m - 1) * density * n / L,
            "eq10_intra": 2 * itemsize * (L - 1) * density * n * m / L}
