"""Sparse embedding gradients, averaged row by row without ever building the dense n-vector: the
workload S2 Reducer is built for ([S2Reducer], section 4: the embedding layers of GNMT
and LSTM language models, whose gradients touch only the rows of the tokens in the batch).

An embedding gradient is *row-sparse*: m touched rows (ids in ``[0, num_rows)``) of ``dim`` values.
It arrives as a ``torch.sparse_coo`` tensor (``nn.Embedding(sparse=True)``) or as a dense
(num_rows, dim) tensor with few non-zero rows (``sparse=False``); :func:`rows_of` reads both (a dense
one in slices, so the scan allocates no n-sized temporary). :class:`RowSparseReducer` averages it over
the ranks by one of five routes, each the row-sparse form of a registered method:

* ``"topka"``: all-gather of every rank's (row ids, rows) and a sum in rank order (what PyTorch DDP
  does for sparse gradients: the AllGather baseline of S2's Fig. 3);
* ``"topkdsa"``: SparCML's sparse streams with rows as items
  (:func:`~sparsecomm.transport.sparse_stream.dsa_allreduce` / ``split_allreduce``); the stream goes
  dense only past the break-even point, i.e. when the touched rows are that many;
* ``"omnireduce"``: the rows as OmniReduce blocks of ``dim`` values, aggregated per shard
  (:func:`~sparsecomm.transport.block_aggregate.block_allreduce`);
* ``"s2reducer"``: S2 Reducer's count-sketch and bitmap with rows as the unit: each touched row is
  hashed once into a bucket of ``dim`` values (a block count-sketch of ``sketch_ratio`` x the largest
  touched element count cells, S2's lambda), the bitmap has one byte per row; both are summed by
  all-reduce and the rows set in the bitmap are queried (median over the sketch rows). The bitmap is
  the only state that grows with the vocabulary;
* ``"dense"``: the baseline: scatter into (num_rows, dim) and all-reduce densely (native all-reduce).

The first four never allocate num_rows x dim values. Every route but ``s2reducer`` is exact (nothing to
feed back; the sketch's estimation error is S2's and is not fed back, as in the paper).

Entry points for the integration layer:

* :func:`reduce_embedding_grad` ``(grad, reducer) -> Tensor``: one parameter's gradient in, the
  averaged gradient out, sparse COO in gives sparse COO out (the call a DDP comm hook makes for a
  bucket holding a sparse gradient, ``bucket.buffer().is_sparse``);
* :class:`EmbeddingSynchronizer`: a :class:`~sparsecomm.integration.synchronizer.SparseSynchronizer`
  for the other parameters plus one :class:`RowSparseReducer` per embedding weight.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.validate import check_choice, check_int, check_number
from ..methods import Stats
from ..selection.sketch import CountSketch
from ..transport.block_aggregate import block_allreduce
from ..transport.chunk import index_dtype
from ..transport.collectives import allreduce, ring_cost
from ..transport.comm import Communicator
from ..transport.control import max_all_reduce
from ..transport.merge import nonzero_positions
from ..transport.sparse_collectives import allgatherv
from ..transport.sparse_stream import Stream, dense_switch_count, dsa_allreduce, split_allreduce
from .synchronizer import SparseSynchronizer

__all__ = ["ROUTES", "rows_of", "RowSparseReducer", "reduce_embedding_grad", "embedding_parameters",
           "EmbeddingSynchronizer"]

log = logging.getLogger(__name__)

ROUTES = ("topka", "topkdsa", "omnireduce", "s2reducer", "dense")
_SCAN_ROWS = 1 << 16
_SEED_STRIDE = 1_000_003


def rows_of(grad: Tensor | None, num_rows: int, dim: int) -> tuple[Tensor, Tensor]:
    """(sorted unique row ids (int64), their rows (m, dim)) of an embedding gradient: sparse COO
    (coalesced here), dense with few non-zero rows (scanned in slices of 65536 rows), or None."""
    if grad is None:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dim)
    if tuple(grad.shape) != (num_rows, dim):
        raise ValueError(f"embedding gradient has shape {tuple(grad.shape)}, expected ({num_rows}, {dim})")
    if grad.is_sparse:
        grad = grad.coalesce()
        ids = grad.indices()[0]
        values = grad.values().reshape(-1, dim)
        keep = values.ne(0).any(1)               # rows that summed to zero need not travel
        return ids[keep], values[keep]
    found = []
    for start in range(0, num_rows, _SCAN_ROWS):
        part = grad[start:start + _SCAN_ROWS]
        found.append(torch.nonzero(part.ne(0).any(1)).reshape(-1) + start)
    ids = torch.cat(found) if found else torch.empty(0, dtype=torch.int64)
    return ids, grad[ids]


class RowSparseReducer:
    """Average row-sparse gradients of a (num_rows, dim) parameter over the ranks by one route.

    Args:
        comm: communicator (default: all ranks).
        method: one of :data:`ROUTES`.
        num_rows, dim: the parameter's shape.
        algorithm: ``topkdsa``'s variant (``"auto"``, ``"recursive_doubling"``, ``"split_allgather"``).
        sketch_ratio, sketch_rows, seed: ``s2reducer``'s sketch (defaults 0.5, 3, 0 as the method).

    After a call, :attr:`stats` holds what it cost (one :class:`~sparsecomm.methods.Stats`; ``n`` is
    num_rows * dim, ``selected`` this rank's touched elements, ``nnz_out`` the result's).
    """

    def __init__(self, comm: Communicator | None = None, method: str = "topkdsa", *, num_rows: int, dim: int,
                 algorithm: str = "auto", sketch_ratio: float = 0.5, sketch_rows: int = 3, seed: int = 0) -> None:
        self.comm = comm if comm is not None else Communicator()
        self.method = check_choice("method", method, ROUTES)
        self.num_rows = check_int("num_rows", num_rows, minimum=1)
        self.dim = check_int("dim", dim, minimum=1)
        self.algorithm = check_choice("algorithm", algorithm, ("auto", "recursive_doubling", "split_allgather"))
        self.sketch_ratio = float(check_number("sketch_ratio", sketch_ratio, 0.0, strict=True))
        self.sketch_rows = check_int("sketch_rows", sketch_rows, minimum=1)
        self.seed = int(seed)
        self.last_variant: str | None = None
        self.calls = 0
        self.stats = Stats()

    def __call__(self, ids: Tensor, values: Tensor) -> tuple[Tensor | None, Tensor]:
        """The average over ranks of the rows ``values`` (m, dim) at sorted unique ``ids``: returns
        ``(ids, rows)``, or ``(None, (num_rows, dim) rows)`` when the result is held dense."""
        P = self.comm.size
        mark = self.comm.meter.snapshot()
        start = time.perf_counter()
        with self.comm.meter.phase(f"embedding:{self.method}"):
            out_ids, out = getattr(self, f"_{self.method}")(ids.to(torch.int64), values.reshape(-1, self.dim))
        out = out / P
        traffic = self.comm.meter.since(mark)
        self.stats = Stats(n=self.num_rows * self.dim, selected=values.numel(),
                           nnz_out=out.numel() if out_ids is not None else int(out.ne(0).any(1).sum()) * self.dim,
                           bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv,
                           header_bytes=traffic.header_bytes_sent, rounds=traffic.rounds,
                           time_comm=time.perf_counter() - start, time_total=time.perf_counter() - start)
        if self.method == "dense":                  # native all-reduce: the ring formula's bytes
            modelled = ring_cost(P=P, n=self.num_rows * self.dim, rank=self.comm.rank, itemsize=values.element_size())
            self.stats.update(bytes_sent=modelled.bytes_sent, bytes_recv=modelled.bytes_recv, modelled_bytes=True)
        self.calls += 1
        return out_ids, out

    # ------------------------------------------------------------------ routes
    def _topka(self, ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        gathered = allgatherv(self.comm, [ids.to(index_dtype(self.num_rows)), values.reshape(-1)])
        return _sum_rows([(g[0], g[1].reshape(-1, self.dim)) for g in gathered], self.dim)

    def _topkdsa(self, ids: Tensor, values: Tensor) -> tuple[Tensor | None, Tensor]:
        stream = Stream.sparse(self.num_rows, ids, values, self.dim)
        variant = self.algorithm
        if variant == "auto":
            most = max_all_reduce(self.comm, [ids.numel()])[0]
            switch = dense_switch_count(self.num_rows, self.dim, values.element_size())
            variant = "split_allgather" if self.comm.size > 2 and self.comm.size * most >= switch \
                else "recursive_doubling"
        total = dsa_allreduce(self.comm, stream)[0] if variant == "recursive_doubling" \
            else split_allreduce(self.comm, stream)
        self.last_variant = variant
        return total.indices if total.indices is None else total.indices.long(), total.values

    def _omnireduce(self, ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        keep = values.ne(0).any(1)
        out_ids, out, _ = block_allreduce(self.comm, ids[keep], values[keep], self.num_rows)
        return out_ids.long(), out

    def _s2reducer(self, ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """S2's sketch with rows as the unit: one hash per row id, buckets of ``dim`` values (a block
        count-sketch; ``sketch_ratio`` x the largest touched count of cells, as S2's lambda)."""
        dim = self.dim
        most = max_all_reduce(self.comm, [ids.numel()])[0]
        cols = max(1, math.ceil(self.sketch_ratio * max(most, 1) / self.sketch_rows))
        sketch = CountSketch(self.num_rows, self.sketch_rows, cols, seed=self.seed * _SEED_STRIDE + self.calls)
        table = torch.zeros(self.sketch_rows, cols, dim, dtype=values.dtype, device=values.device)
        buckets, signs = sketch.hashes(ids)
        for row in range(self.sketch_rows):
            table[row].index_add_(0, buckets[row], values * signs[row].to(values.dtype).unsqueeze(1))
        bitmap = torch.zeros(self.num_rows, dtype=torch.uint8 if self.comm.size <= 255 else torch.int32,
                             device=values.device)
        bitmap[ids] = 1
        table = allreduce(self.comm, table.reshape(-1), "rabenseifner").view(self.sketch_rows, cols, dim)
        bitmap = allreduce(self.comm, bitmap, "rabenseifner")
        union = nonzero_positions(bitmap)
        del bitmap
        buckets, signs = sketch.hashes(union)
        estimates = torch.stack([table[row][buckets[row]] * signs[row].to(values.dtype).unsqueeze(1)
                                 for row in range(self.sketch_rows)])
        if self.sketch_rows == 1:
            return union, estimates[0]
        if self.sketch_rows == 3:                 # the median of three without a sort
            a, b, c = estimates
            return union, torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
        return union, estimates.median(dim=0).values

    def _dense(self, ids: Tensor, values: Tensor) -> tuple[None, Tensor]:
        dense = torch.zeros(self.num_rows, self.dim, dtype=values.dtype, device=values.device)
        dense.index_add_(0, ids, values)
        return None, self.comm.native_all_reduce(dense)

    def __repr__(self) -> str:
        return f"RowSparseReducer(method={self.method!r}, num_rows={self.num_rows}, dim={self.dim})"


def _sum_rows(parts: list[tuple[Tensor, Tensor]], dim: int) -> tuple[Tensor, Tensor]:
    """Sum (ids, rows) parts by id, in the order given (the same bits on every rank)."""
    ids = torch.cat([p[0].long() for p in parts])
    if ids.numel() == 0:
        return ids, torch.empty(0, dim, dtype=parts[0][1].dtype)
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    out = torch.zeros(unique.numel(), dim, dtype=parts[0][1].dtype, device=parts[0][1].device)
    start = 0
    for part_ids, rows in parts:
        stop = start + part_ids.numel()
        out.index_add_(0, inverse[start:stop], rows)
        start = stop
    return unique, out


def reduce_embedding_grad(grad: Tensor | None, reducer: RowSparseReducer) -> Tensor:
    """The averaged gradient of one embedding weight: sparse COO when ``grad`` is sparse (or None),
    dense (num_rows, dim) when it is dense. Every rank must call it, with or without a gradient."""
    ids, values = rows_of(grad, reducer.num_rows, reducer.dim)
    out_ids, out = reducer(ids, values)
    shape = (reducer.num_rows, reducer.dim)
    if grad is not None and not grad.is_sparse:
        if out_ids is None:
            return out
        dense = torch.zeros_like(grad)
        dense[out_ids] = out.to(grad.dtype)
        return dense
    if out_ids is None:                          # the result went dense: keep only its non-zero rows
        out_ids, out = rows_of(out, *shape)
    return torch.sparse_coo_tensor(out_ids.reshape(1, -1), out, shape, is_coalesced=True, check_invariants=False)


def embedding_parameters(model: nn.Module) -> list[Tensor]:
    """The weights of the ``nn.Embedding`` and ``nn.EmbeddingBag`` modules of ``model`` (trainable)."""
    found: list[Tensor] = []
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.weight.requires_grad \
                and all(module.weight is not p for p in found):
            found.append(module.weight)
    return found


class _Holder(nn.Module):
    """The parameters that are not embedding weights, for the inner synchronizer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.held = nn.ParameterList(params)


class EmbeddingSynchronizer:
    """Embedding weights through :class:`RowSparseReducer`, everything else through a
    :class:`SparseSynchronizer` (same step / synchronize / state_dict interface).

    Args:
        model, optimizer, method, **options: as for :class:`SparseSynchronizer` (the non-embedding
            parameters: e.g. ``method="dense"``, or ``"s2reducer", density=0.01``).
        embedding_method: a route of :data:`ROUTES` for the embedding weights (default ``"topkdsa"``).
        embedding_options: keyword arguments of :class:`RowSparseReducer` (``algorithm``, ``sketch_ratio``...).
        process_group: as for :class:`SparseSynchronizer`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 method: str = "dense", *, embedding_method: str = "topkdsa",
                 embedding_options: dict[str, Any] | None = None, process_group=None, **options: Any) -> None:
        self.embeddings = embedding_parameters(model)
        others = [p for p in model.parameters() if p.requires_grad and all(p is not e for e in self.embeddings)]
        self.optimizer = optimizer
        self.inner = SparseSynchronizer(_Holder(others), None, method, process_group=process_group, **options)
        self.comm = self.inner.comm
        self.reducers = [RowSparseReducer(self.comm, embedding_method, num_rows=p.shape[0], dim=p.shape[1],
                                          **(embedding_options or {})) for p in self.embeddings]
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        with torch.no_grad():
            for param in self.embeddings:
                dist.broadcast(param.data, src=src, group=process_group)
        self.last_stats = Stats(calls=0)

    def synchronize(self) -> Stats:
        """Average every gradient over the ranks; the step's stats (all parameters added up)."""
        records = [self.inner.synchronize()] if self.inner.buckets else []
        for param, reducer in zip(self.embeddings, self.reducers, strict=True):
            param.grad = reduce_embedding_grad(param.grad, reducer)
            records.append(reducer.stats)
        self.last_stats = Stats.total(records) if records else Stats(calls=0)
        return self.last_stats

    def step(self, closure=None):
        """:meth:`synchronize`, then ``optimizer.step(closure)``."""
        if self.optimizer is None:
            raise RuntimeError("EmbeddingSynchronizer.step needs the optimizer; pass it at construction")
        self.synchronize()
        return self.optimizer.step(closure)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "calls": [r.calls for r in self.reducers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        for reducer, calls in zip(self.reducers, state["calls"], strict=True):
            reducer.calls = int(calls)
