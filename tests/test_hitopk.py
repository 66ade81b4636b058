"""HiTopKComm (Shi et al. Algorithm 2) and the 2D-torus all-reduce: invariants for every valid
(P, local_size) with P = 1..8, exact traffic, the local_size rule and its default."""

import math

import pytest
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_equals_dense,
    assert_traffic_matches,
    trace_method,
)

from sparsecomm import run_workers
from sparsecomm.core.cost import chunk_sizes
from sparsecomm.launch.launcher import WorkerError
from sparsecomm.methods import cost
from sparsecomm.transport.topology import resolve_local_size

N = 997
DENSITY = 0.05
# (P, local_size): every P = 1..8, one node per rank, one node for all, and real hierarchies.
LAYOUTS = [(1, 1), (2, 2), (3, 1), (3, 3), (4, 2), (5, 5), (6, 2), (6, 3), (7, 1), (8, 2), (8, 4)]


def _assert_hitopk_traffic(traces, L, density):
    """Exact bytes per step given the union sizes node 0 reports; the bound holds without them."""
    for step in range(len(traces[0])):
        unions = [traces[j][step]["stats"]["union_nnz"] for j in range(L)]
        one_step = [[trace[step]] for trace in traces]
        assert_traffic_matches(one_step, "hitopk", n=N, density=density, local_size=L, union_sizes=unions)
    assert_traffic_matches(traces, "hitopk", n=N, density=density, local_size=L)


@pytest.mark.parametrize("P,L", LAYOUTS)
def test_hitopk_invariants(P, L):
    traces = run_workers(P, trace_method, "hitopk", {"density": DENSITY, "local_size": L}, N, 3, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    _assert_hitopk_traffic(traces, L, DENSITY)
    shards = chunk_sizes(N, L)
    m = P // L
    for rank, trace in enumerate(traces):
        k = math.ceil(DENSITY * shards[rank % L])
        for rec in trace:
            assert rec["stats"]["selected"] == k
            assert k <= rec["stats"]["union_nnz"] <= m * k
            # the residual lives on the shard's owner only
            start = sum(shards[:rank % L])
            outside = rec["new_residual"].clone()
            outside[start:start + shards[rank % L]] = 0
            assert not outside.any()


@pytest.mark.parametrize("P,L", [(4, 4), (5, 1), (6, 2)])
def test_hitopk_density_one_equals_dense(P, L):
    traces = run_workers(P, trace_method, "hitopk", {"density": 1.0, "local_size": L}, N, 2, timeout=60)
    assert_consistent(traces)
    assert_equals_dense(traces)
    for trace in traces:
        assert all(not rec["new_residual"].any() for rec in trace)
    _assert_hitopk_traffic(traces, L, 1.0)


@pytest.mark.parametrize("P,L", [(1, 1), (3, 3), (5, 1), (6, 2), (6, 3), (7, 7), (8, 2)])
def test_torus2d_equals_dense_with_exact_traffic(P, L):
    traces = run_workers(P, trace_method, "torus2d", {"local_size": L}, N, 2, timeout=60)
    assert_consistent(traces)
    assert_equals_dense(traces)
    assert_traffic_matches(traces, "torus2d", n=N, local_size=L)
    expected_rounds = 2 * (L - 1) + 2 * (P // L - 1)
    assert all(rec["stats"]["rounds"] == expected_rounds for trace in traces for rec in trace)


def test_torus2d_cost_is_two_rings():
    """Degenerate layouts reduce to one ring all-reduce over all ranks."""
    for P in range(1, 9):
        for rank in range(P):
            ring = cost("ring", P=P, n=N, rank=rank)
            assert cost("torus2d", P=P, n=N, rank=rank, local_size=1) == ring
            assert cost("torus2d", P=P, n=N, rank=rank, local_size=P) == ring


def test_local_size_rule_and_default(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_local_size(6) == 1
    assert resolve_local_size(6, 3) == 3
    for bad in (4, 0, -2, 2.0, True):
        with pytest.raises(ValueError, match="dividing the number of ranks P=6"):
            resolve_local_size(6, bad)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_local_size(8) == 4
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='4'.*P=6"):
        resolve_local_size(6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="must be an integer"):
        resolve_local_size(6)


def test_hitopk_takes_local_size_from_environment(monkeypatch):
    """LOCAL_WORLD_SIZE (what torchrun sets) reaches the workers and the cost formula alike."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    traces = run_workers(4, trace_method, "hitopk", {"density": DENSITY}, N, 1, timeout=60)
    assert all(trace[0]["stats"]["local_size"] == 2 for trace in traces)
    assert_traffic_matches(traces, "hitopk", n=N, density=DENSITY)


@pytest.mark.parametrize("name,options", [("hitopk", {"density": DENSITY}), ("torus2d", {})])
def test_local_size_must_divide_P(name, options):
    with pytest.raises(WorkerError, match="must be a positive integer dividing the number of ranks P=3"):
        run_workers(3, trace_method, name, dict(options, local_size=2), N, 1, timeout=60)
