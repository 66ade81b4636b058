"""PTO, the parallel tensor operator: Shi et al., "Towards Scalable Distributed Training of Deep
Learning on Public Cloud Clusters" (MLSys 2021), section 4.2, equations (12)-(14).

After the gradient all-reduce every rank holds the same tensors, and an operation on them (eq. 12,
``r = OP(g)``) would be computed P times over. :func:`parallel_apply` splits the list of items into
P contiguous shares balanced by cost (eq. 13: rank p computes ``OP`` on share p only) and
all-gathers the results in order (eq. 14), so every rank ends with every result.

* Partition: :func:`partition` -- contiguous shares minimizing the largest share's cost (binary
  search over the bound, greedy fill), the same on every rank because it depends only on the costs.
  Contiguous shares keep the gathered results in input order without an index.
* All-gather: :func:`~sparsecomm.transport.sparse_collectives.allgatherv` (halving distances for
  P a power of two, Bruck otherwise) of one packed message per rank: the results' raw bytes and a
  small int64 description of each (dtype code, number of dimensions, sizes), so results may have
  any shape and dtype. Shares may be empty and of uneven size (gloo's own all_gather rejects both).
* Cost: :func:`pto_cost` (registered as ``"pto"``): ceil(log2 P) rounds; the bytes replay the
  schedule over the per-rank message sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..core.cost import Cost, register_collective_cost
from ..core.validate import check_int
from ..transport.comm import Communicator
from ..transport.sparse_collectives import allgatherv, allgatherv_cost

__all__ = ["parallel_apply", "partition", "default_cost", "result_bytes", "pto_cost", "DTYPES"]

Item = Any  # a Tensor, or a tuple / list of Tensors

#: dtypes a result may have; the code sent is the position in this tuple
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_META_DTYPE = torch.int64


def default_cost(item: Item) -> int:
    """The work of one item: its element count (summed over a tuple's tensors)."""
    if isinstance(item, torch.Tensor):
        return item.numel()
    return sum(t.numel() for t in item)


def partition(costs: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``parts`` contiguous shares of ``range(len(costs))`` minimizing the largest
    share's total cost. Later shares may be empty when there are fewer items than parts."""
    check_int("parts", parts, minimum=1)
    costs = [int(c) for c in costs]
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {min(costs)}")

    def shares_for(bound: int) -> list[tuple[int, int]] | None:
        out, start, load = [], 0, 0
        for i, c in enumerate(costs):
            if load + c > bound and i > start:
                out.append((start, i))
                start, load = i, 0
            load += c
        out.append((start, len(costs)))
        return out if len(out) <= parts else None

    low, high = max(costs, default=0), sum(costs)
    while low < high:
        middle = (low + high) // 2
        if shares_for(middle) is None:
            low = middle + 1
        else:
            high = middle
    shares = shares_for(low)
    assert shares is not None
    shares += [(len(costs), len(costs))] * (parts - len(shares))
    return shares


def _describe(result: torch.Tensor) -> list[int]:
    if result.dtype not in DTYPES:
        raise ValueError(f"parallel_apply: op returned dtype {result.dtype}; supported: {DTYPES}")
    return [DTYPES.index(result.dtype), result.dim(), *result.shape]


def _pack(results: list[torch.Tensor], device) -> list[torch.Tensor]:
    meta = torch.tensor([v for r in results for v in _describe(r)], dtype=_META_DTYPE, device=device)
    payload = [r.detach().contiguous().reshape(-1).view(torch.uint8) for r in results]
    data = torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8, device=device)
    return [meta, data]


def _unpack(meta: torch.Tensor, data: torch.Tensor) -> list[torch.Tensor]:
    values = meta.tolist()
    out, pos, offset = [], 0, 0
    while pos < len(values):
        dtype, ndim = DTYPES[values[pos]], values[pos + 1]
        shape = values[pos + 2:pos + 2 + ndim]
        pos += 2 + ndim
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        piece = data[offset:offset + nbytes].clone()  # clone: an aligned start for the dtype view
        out.append(piece.view(dtype).reshape(shape))
        offset += nbytes
    return out


def result_bytes(result: torch.Tensor) -> int:
    """Bytes one result adds to its rank's all-gather message: its data and its int64 description."""
    return result.numel() * result.element_size() + _META_DTYPE.itemsize * (2 + result.dim())


def _device_of(item: Item):
    return item.device if isinstance(item, torch.Tensor) else item[0].device


def parallel_apply(op: Callable[[Item], torch.Tensor], tensors: Sequence[Item], comm: Communicator | None = None,
                   *, cost: Callable[[Item], int] = default_cost) -> list[torch.Tensor]:
    """``[op(t) for t in tensors]`` computed by P ranks together (PTO, eq. 13-14).

    Args:
        op: applied to one item; returns a tensor (any shape, a dtype in :data:`DTYPES`). It must give
            the same result on every rank for the same item (the items must be identical on all ranks).
        tensors: the items, identical on every rank: tensors, or tuples of tensors (e.g. weight and
            gradient of one layer).
        comm: the ranks sharing the work; ``None``: all ranks of the default process group if one is
            initialized, else this process alone.
        cost: the work of one item, for balancing (default: element count).

    Returns every result, in input order, on every rank (on the device of the first item).
    """
    if comm is None and dist.is_available() and dist.is_initialized():
        comm = Communicator()
    items = list(tensors)
    if comm is None or comm.size == 1:
        return [op(item) for item in items]
    device = _device_of(items[0]) if items else torch.device("cpu")
    start, stop = partition([cost(item) for item in items], comm.size)[comm.rank]
    mine = [op(item) for item in items[start:stop]]
    gathered = allgatherv(comm, _pack(mine, device))
    results = [r for meta, data in gathered for r in _unpack(meta, data)]
    if len(results) != len(items):
        raise RuntimeError(f"parallel_apply gathered {len(results)} results for {len(items)} items: "
                           "the ranks disagree on the number of items")
    return results


@register_collective_cost("pto")
def pto_cost(P: int, n: int, rank: int, itemsize: int = 4, costs: Sequence[int] | None = None,
             result_shape: Sequence[int] = (), **_) -> Cost:
    """Cost of :func:`parallel_apply`'s all-gather: ``n`` items of ``costs`` (default equal), each
    giving one result of ``result_shape`` (default a scalar) with ``itemsize``-byte elements.
    ceil(log2 P) rounds; rank q's message is the bytes of its share's results and descriptions."""
    costs = list(costs) if costs is not None else [1] * n
    if len(costs) != n:
        raise ValueError(f"costs has {len(costs)} entries, need n={n}")
    one = itemsize * int(torch.Size(result_shape).numel()) + _META_DTYPE.itemsize * (2 + len(result_shape))
    message_bytes = [(stop - start) * one for start, stop in partition(costs, P)]
    return allgatherv_cost(message_bytes, P, rank)
