"""gTop-k: tree schedule, exactly-k output, invariants for P = 1..8, traffic within its bound."""

import math

import pytest
from invariants import assert_conserved, assert_consistent, assert_traffic_matches, trace_method

from sparsecomm import run_workers
from sparsecomm.methods.gtopk import tree_schedule

N = 997


def test_tree_schedule_is_a_binomial_tree():
    for P in range(1, 9):
        sends = {r: [peer for role, peer in tree_schedule(P, r) if role == "send"] for r in range(P)}
        recvs = {r: [peer for role, peer in tree_schedule(P, r) if role == "recv"] for r in range(P)}
        assert sends[0] == [] and all(len(sends[r]) == 1 for r in range(1, P))   # one parent each
        assert sorted(c for r in range(P) for c in recvs[r]) == list(range(1, P))  # every child once
        for r in range(1, P):
            assert r in recvs[sends[r][0]]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("density", [0.01, 0.2])
def test_gtopk_invariants(P, density):
    traces = run_workers(P, trace_method, "gtopk", {"density": density}, N, 3, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    k = math.ceil(density * N)
    assert_traffic_matches(traces, "gtopk", n=N, k=k)
    for trace in traces:
        assert all(rec["stats"]["nnz_out"] <= k for rec in trace)
