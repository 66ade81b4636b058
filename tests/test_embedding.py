"""Sparse embedding gradients: every route of RowSparseReducer equals the dense average (S2's sketch
where it is collision-free), the same bits on every rank, sparse in gives sparse out, the synchronizer
path, a DDP comm hook path, and a 10M-row embedding with < 1% of rows touched averaged without a dense
n-vector (slow)."""

import re

import pytest
import torch
from sparsecomm_lab.bench.block_sparse import ZipfModel, zipf_tokens
from torch import nn

from sparsecomm import run_workers
from sparsecomm.integration.embedding import (
    ROUTES,
    EmbeddingSynchronizer,
    RowSparseReducer,
    reduce_embedding_grad,
    rows_of,
)

ROWS, DIM = 1000, 4
# S2's sketch is exact with one row of at least 2^ceil(log2(ROWS * DIM)) = 4096 columns
EXACT_SKETCH = {"sketch_rows": 1, "sketch_ratio": 64.0}


def _grad(rank, sparse, rows=ROWS, dim=DIM, tokens=300):
    gen = torch.Generator().manual_seed(rank)
    ids = zipf_tokens(rows, tokens, gen)
    values = torch.randn(tokens, dim, generator=gen)
    grad = torch.sparse_coo_tensor(ids.reshape(1, -1), values, (rows, dim),      # uncoalesced, as autograd's
                                   check_invariants=False)
    return grad if sparse else grad.to_dense()


def _reduce(route, sparse, options):
    rank = torch.distributed.get_rank()
    reducer = RowSparseReducer(None, route, num_rows=ROWS, dim=DIM, **options)
    grad = _grad(rank, sparse)
    out = reduce_embedding_grad(grad, reducer)
    return grad.to_dense(), out.is_sparse, out.to_dense(), dict(reducer.stats)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("P, sparse", [(3, True), (4, False)])
def test_every_route_averages_row_sparse_gradients(route, P, sparse):
    options = EXACT_SKETCH if route == "s2reducer" else {}
    results = run_workers(P, _reduce, route, sparse, options, timeout=60)
    dense = sum(r[0] for r in results) / P
    for grad, is_sparse, out, stats in results:
        assert is_sparse == sparse
        assert torch.equal(out, results[0][2])                    # the same bits on every rank
        assert torch.allclose(out, dense, atol=1e-5)
        assert stats["selected"] == int(grad.ne(0).any(1).sum()) * DIM
        if route not in ("dense", "s2reducer"):                  # (the collision-free sketch is large)
            assert 0 < stats["bytes_sent"] < ROWS * DIM * 4        # less than one dense gradient


def test_s2_route_with_a_collision_prone_sketch_estimates_on_the_union_rows():
    errors = {}
    for ratio in (0.5, 8.0):                             # lambda = 0.5 (S2's best) and a larger sketch
        results = run_workers(3, _reduce, "s2reducer", True, {"sketch_ratio": ratio}, timeout=60)
        dense = sum(r[0] for r in results) / 3
        union = dense.ne(0).any(1)
        out = results[0][2]
        assert all(torch.equal(r[2], out) for r in results)
        assert not out[~union].any()                     # nothing outside the rows set in the bitmap
        errors[ratio] = ((out - dense).norm() / dense.norm()).item()
    assert 0 < errors[8.0] < errors[0.5]


def test_rows_of_reads_sparse_and_dense_alike():
    grad = _grad(0, True)
    ids_s, rows_s = rows_of(grad, ROWS, DIM)
    ids_d, rows_d = rows_of(grad.to_dense(), ROWS, DIM)
    assert torch.equal(ids_s, ids_d) and torch.allclose(rows_s, rows_d)
    assert torch.equal(ids_s, torch.unique(grad.coalesce().indices()[0]))
    with pytest.raises(ValueError, match=r"shape \(1000, 4\), expected \(10, 4\)"):
        rows_of(grad, 10, DIM)


def _synchronize(route):
    torch.manual_seed(0)
    model = ZipfModel(ROWS, dim=DIM, hidden=8, classes=4, sparse=True)
    sync = EmbeddingSynchronizer(model, None, "dense", embedding_method=route,
                                 embedding_options=EXACT_SKETCH if route == "s2reducer" else {})
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    model.loss(zipf_tokens(ROWS, 64, gen).reshape(8, 8)).backward()
    stats = sync.synchronize()
    return model.embedding.weight.grad.is_sparse, model.embedding.weight.grad.to_dense(), \
        [p.grad.clone() for p in model.head.parameters()], stats.calls


def test_synchronizer_path_matches_the_dense_baseline():
    reference = run_workers(3, _synchronize, "dense", timeout=60)
    for route in ("topkdsa", "omnireduce", "s2reducer"):
        results = run_workers(3, _synchronize, route, timeout=60)
        for (is_sparse, emb, head, calls), (_, ref_emb, ref_head, _) in zip(results, reference, strict=True):
            assert is_sparse and calls == 2                       # the head's bucket + the embedding
            assert torch.allclose(emb, ref_emb, atol=1e-6)
            assert all(torch.equal(a, b) for a, b in zip(head, ref_head, strict=True))


def _ddp_sparse_bucket(route):
    """DDP hands a sparse embedding gradient to a comm hook as its own bucket, a sparse COO buffer:
    the entry point a hook calls for it is reduce_embedding_grad."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(ROWS, DIM, sparse=True))
    ddp = DistributedDataParallel(model)
    reducer = RowSparseReducer(None, route, num_rows=ROWS, dim=DIM, **(EXACT_SKETCH if route == "s2reducer" else {}))
    buffers = []

    def hook(state, bucket):
        buffers.append(bucket.buffer().is_sparse)
        future = torch.futures.Future()
        future.set_result(reduce_embedding_grad(bucket.buffer(), reducer))
        return future

    ddp.register_comm_hook(None, hook)
    tokens = zipf_tokens(ROWS, 64, torch.Generator().manual_seed(torch.distributed.get_rank())).reshape(8, 8)
    ddp(tokens).pow(2).sum().backward()
    local = torch.zeros(ROWS, DIM)                    # the local gradient of sum(e^2): 2 e per occurrence
    local.index_add_(0, tokens.reshape(-1), 2 * model[0].weight.detach()[tokens.reshape(-1)])
    return buffers, model[0].weight.grad.is_sparse, model[0].weight.grad.to_dense(), local


@pytest.mark.parametrize("route", ["omnireduce"])
def test_ddp_hook_path_keeps_sparse_gradients_sparse(route):
    results = run_workers(2, _ddp_sparse_bucket, route, timeout=60)
    expected = sum(r[3] for r in results) / 2
    for buffers, is_sparse, grad, _ in results:
        assert buffers == [True] and is_sparse
        assert torch.allclose(grad, expected, atol=1e-6)


# ---------------------------------------------------------------------- memory
BIG_ROWS, BIG_DIM = 10_000_000, 4
N_BIG = BIG_ROWS * BIG_DIM
DENSE_BYTES = N_BIG * 4                     # one dense fp32 n-vector: 160 MB
BOUND = 48 * 2 ** 20                        # the sparse routes stay below 48 MB (< 0.3 of it), s2reducer's
#                                             bitmap of one byte per row (10 MB, summed by all-reduce) included


def _kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _peak_of(route, control):
    """Peak RSS growth (VmHWM, reset first) of one call, and the largest single allocation of
    another (the profiler, whose own bookkeeping would blur the RSS figure)."""
    from torch.profiler import ProfilerActivity, profile

    rank = torch.distributed.get_rank()
    grad = _grad(rank, True, BIG_ROWS, BIG_DIM, tokens=200_000)
    touched = rows_of(grad, BIG_ROWS, BIG_DIM)[0].numel()
    reducer = RowSparseReducer(None, route, num_rows=BIG_ROWS, dim=BIG_DIM)
    reduce_embedding_grad(grad, reducer)              # warm-up: lazy imports, first-call buffers

    def call():
        out = reduce_embedding_grad(grad, reducer)
        if control:                                   # what a dense n-vector would show
            torch.ones(N_BIG).sum()
        return out

    torch.distributed.barrier()
    with open("/proc/self/clear_refs", "w") as f:     # reset the peak RSS to the current RSS
        f.write("5")
    base = _kib("VmRSS")
    out = call()
    rss = _kib("VmHWM") - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    return touched, rss, largest, out._nnz()


@pytest.mark.slow
@pytest.mark.parametrize("route", ["topka", "topkdsa", "omnireduce", "s2reducer"])
def test_ten_million_row_embedding_never_builds_a_dense_vector(route):
    results = run_workers(2, _peak_of, route, False, timeout=300)
    for touched, rss, largest, nnz in results:
        assert touched < BIG_ROWS // 100                  # fewer than 1% of the rows
        assert 0 < nnz <= 2 * touched
        assert rss < BOUND, f"{route}: peak RSS grew by {rss / 2 ** 20:.1f} MB"
        assert largest < BOUND, f"{route}: one allocation of {largest / 2 ** 20:.1f} MB"


@pytest.mark.slow
def test_the_memory_measurement_sees_a_dense_vector():
    touched, rss, largest, _ = run_workers(1, _peak_of, "topkdsa", True, timeout=300)[0]
    assert largest >= DENSE_BYTES and rss >= DENSE_BYTES * 0.9
