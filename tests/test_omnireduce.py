"""OmniReduce: invariants for P = 1..8, traffic equal to its formula from the recorded block counts
and within its bound from k, and only non-zero blocks on the wire."""

import math

import pytest
import torch
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_equals_dense,
    assert_traffic_matches,
    trace_method,
)

from sparsecomm import make_method, run_workers

N = 1003


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_omnireduce_invariants_and_traffic(P):
    options = {"density": 0.05, "block_size": 16}
    traces = run_workers(P, trace_method, "omnireduce", options, N, 2, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    k = math.ceil(0.05 * N)
    assert_traffic_matches(traces, "omnireduce", n=N, k=k, block_size=16)
    for step in range(2):
        recs = [trace[step] for trace in traces]
        exact = {"block_counts": [rec["stats"]["block_counts"] for rec in recs],
                 "result_blocks": recs[0]["stats"]["result_blocks"]}
        assert_traffic_matches([[rec] for rec in recs], "omnireduce", n=N, k=k, block_size=16, **exact)
        for rec in recs:                                   # whole blocks selected, at least k elements
            sent = (rec["new_residual"] == 0) & (rec["grad"] != 0)
            assert k <= int(sent.sum()) <= k + 15


def _block_sparse_call(n, block, blocks_per_rank):
    rank = torch.distributed.get_rank()
    grad = torch.zeros(n)
    for j in range(blocks_per_rank):
        start = ((rank * 7 + j * 13) % (n // block)) * block
        grad[start:start + block] = torch.randn(block, generator=torch.Generator().manual_seed(rank * 100 + j))
    method = make_method("omnireduce", density=1.0, block_size=block)
    out = method(grad.clone())
    return grad, out, dict(method.stats)


@pytest.mark.parametrize("P", [3, 4])
def test_lossless_on_block_sparse_gradients_sends_only_nonzero_blocks(P):
    n, block = 4096, 64
    results = run_workers(P, _block_sparse_call, n, block, 3, timeout=60)
    dense = sum(g for g, _, _ in results) / P
    for grad, out, stats in results:
        assert torch.allclose(out, dense, atol=1e-6)
        assert stats["blocks_sent"] == int((grad.view(-1, block) != 0).any(1).sum())
        assert stats["bytes_sent"] < 3 * P * (4 + block * 4) * 2      # far below n floats
    nonzero_out = int((dense.view(-1, block) != 0).any(1).sum())
    assert sum(results[0][2]["result_blocks"]) == nonzero_out


def test_density_one_equals_dense_with_a_short_last_block():
    traces = run_workers(3, trace_method, "omnireduce", {"density": 1.0, "block_size": 100}, N, 2, timeout=60)
    assert_consistent(traces)
    assert_equals_dense(traces)
