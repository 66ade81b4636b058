"""Block-sparse all-reduce through per-shard aggregators: OmniReduce's aggregation (Fei et al.,
"Efficient Sparse Collective Communication and its application to Accelerate Distributed Deep
Learning", SIGCOMM'21, section 3), as S2 Reducer compares with it ([S2Reducer], section 4).

A vector of ``num_blocks`` blocks of ``block`` values; each rank holds some of them (``ids``, sorted
unique, and their values, (m, block)). The block index space is cut into P near-equal shards; rank q
aggregates shard q:

1. every rank sends its non-zero blocks of shard q to rank q (:func:`~.alltoallv.alltoallv`: P - 1
   rounds, one packed (ids, values) message each);
2. rank q adds the blocks it received, in rank order, and drops the blocks that summed to zero;
3. an all-gather of the non-zero result blocks (:func:`~.sparse_collectives.allgatherv`,
   ceil(log2 P) rounds) gives every rank the same sum.

OmniReduce streams blocks through dedicated aggregator processes (or programmable switches) with a
look-ahead of the next non-zero block per worker; here the aggregators are the workers themselves and
each step is one message, the reduce-scatter + all-gather form its paper describes for a
worker-colocated deployment.

Cost (:func:`block_allreduce_traffic`): P - 1 + ceil(log2 P) rounds; one block costs
``s_idx + block * s_val`` bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.cost import chunk_offsets
from .alltoallv import alltoallv, alltoallv_traffic
from .chunk import index_dtype
from .comm import Communicator
from .sparse_collectives import allgatherv, allgatherv_traffic

__all__ = ["block_allreduce", "block_allreduce_traffic", "shard_counts", "block_bytes"]


def block_bytes(num_blocks: int, block: int, value_size: int) -> int:
    """Wire bytes of one block: its id and its values."""
    return index_dtype(num_blocks).itemsize + block * value_size


def shard_counts(ids: Tensor, num_blocks: int, P: int) -> list[int]:
    """How many of the sorted block ``ids`` fall into each of the P shards."""
    edges = torch.tensor([start for start, _ in chunk_offsets(num_blocks, P)][1:] + [num_blocks],
                         dtype=torch.int64, device=ids.device)
    ends = torch.searchsorted(ids.long(), edges).tolist()
    return [b - a for a, b in zip([0] + ends[:-1], ends, strict=True)]


def block_allreduce(comm: Communicator, ids: Tensor, values: Tensor,
                    num_blocks: int) -> tuple[Tensor, Tensor, dict[str, list[int]]]:
    """Sum over ranks of a block-sparse vector (see the module docstring).

    ``ids``: sorted unique block ids (any integer dtype), ``values``: (len(ids), block). Returns the
    sorted ids of the non-zero result blocks, their values (same dtype), and the counts that
    :func:`block_allreduce_traffic` needs (``sent``: blocks to each shard, ``result``: result blocks
    per shard, identical on every rank).
    """
    P = comm.size
    block, dtype, device = values.shape[1], values.dtype, values.device
    idt = index_dtype(num_blocks)
    ids = ids.to(idt)
    counts = shard_counts(ids, num_blocks, P)
    pieces, start = [], 0
    for c in counts:
        pieces.append([ids[start:start + c], values[start:start + c].reshape(-1)])
        start += c
    received = alltoallv(comm, pieces, [idt, dtype], device)
    got_ids = torch.cat([m[0] for m in received])
    got_vals = torch.cat([m[1] for m in received]).reshape(-1, block)
    unique, inverse = torch.unique(got_ids, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), block, dtype=dtype, device=device)
    offset = 0
    for m in received:                               # rank order: the same sum whatever P
        c = m[0].numel()
        summed.index_add_(0, inverse[offset:offset + c], got_vals[offset:offset + c])
        offset += c
    keep = summed.ne(0).any(1)
    unique, summed = unique[keep], summed[keep]
    gathered = allgatherv(comm, [unique, summed.reshape(-1)])
    out_ids = torch.cat([g[0] for g in gathered])
    out_vals = torch.cat([g[1] for g in gathered]).reshape(-1, block)
    result = [g[0].numel() for g in gathered]
    return out_ids, out_vals, {"sent": counts, "result": result}


def block_allreduce_traffic(sent: Sequence[Sequence[int]], result: Sequence[int], rank: int, num_blocks: int,
                            block: int, value_size: int) -> tuple[int, int, int]:
    """(rounds, bytes sent, bytes received) of ``rank`` when rank s sends ``sent[s][q]`` blocks to
    shard q and shard q's sum has ``result[q]`` non-zero blocks."""
    P = len(sent)
    if P == 1:
        return 0, 0, 0
    size = block_bytes(num_blocks, block, value_size)
    r1, s1, v1 = alltoallv_traffic([[c * size for c in row] for row in sent], rank)
    r2, s2, v2 = allgatherv_traffic([c * size for c in result], rank)
    return r1 + r2, s1 + s2, v1 + v2
