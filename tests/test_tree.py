"""Tree all-reduce (NCCL's double binary tree) and the two-level dense all-reduce: equal to torch's
all_reduce for P = 1..8 on several node layouts (2x3 included), the meter equal to their cost
formulas, and the one-node fallback flag."""

import pytest
import torch
import torch.distributed as dist
from invariants import assert_consistent, assert_traffic_matches, make_gradient, trace_method

from sparsecomm import make_method, run_workers
from sparsecomm.methods import collective_cost, cost
from sparsecomm.transport.tree import tree_children, tree_parent

N = 1003


def _versus_torch(name, options, n):
    rank = dist.get_rank()
    grad = make_gradient(n, rank, 0, dtype=torch.float64)
    method = make_method(name, **options)
    out = method(grad.clone())
    reference = grad.clone()
    dist.all_reduce(reference)
    return out, reference / dist.get_world_size(), dict(method.stats)


@pytest.mark.parametrize("P", range(1, 9))
def test_tree_equals_torch_all_reduce_and_its_cost(P):
    results = run_workers(P, _versus_torch, "tree", {}, N, timeout=60)
    for out, reference, _ in results:
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    traces = run_workers(P, trace_method, "tree", {}, N, 2, timeout=60)
    assert_consistent(traces)
    assert_traffic_matches(traces, "tree", n=N)


# (P, L): every P = 1..8 with one or more layouts, a 2x3 among them
TWOLEVEL_LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 3), (4, 2), (5, 1), (6, 3), (6, 2), (7, 7), (8, 4), (8, 2)]


@pytest.mark.parametrize("P,L", TWOLEVEL_LAYOUTS)
def test_twolevel_equals_torch_all_reduce_and_its_cost(P, L):
    for out, reference, stats in run_workers(P, _versus_torch, "twolevel", {"local_size": L}, N, timeout=60):
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
        assert stats["dense_fallback"] == (P > 1 and L == P)
    traces = run_workers(P, trace_method, "twolevel", {"local_size": L}, N, 2, timeout=60)
    assert_consistent(traces)
    assert_traffic_matches(traces, "twolevel", n=N, local_size=L)


def test_twolevel_rabenseifner_leaders():
    traces = run_workers(6, trace_method, "twolevel", {"local_size": 2, "allreduce": "rabenseifner"}, N, 1,
                         timeout=60)
    assert_consistent(traces)
    assert_traffic_matches(traces, "twolevel", n=N, local_size=2, allreduce="rabenseifner")


def test_tree_shapes_and_balance():
    """Heap tree: every non-root position has one parent whose children list it; no rank is interior
    in both trees, so every rank sends at most 2n (3 halves up and down one tree, 1 half the other)."""
    for P in range(1, 9):
        for p in range(1, P):
            assert p in tree_children(tree_parent(p), P)
        for rank in range(P):
            assert not (tree_children(rank, P) and tree_children(P - 1 - rank, P))
            assert cost("tree", P=P, n=1000, rank=rank).bytes_sent <= 4 * 2000
    assert cost("tree", P=1, n=N, rank=0).rounds == 0


def test_only_the_leaders_cross_nodes():
    """Two-level: local rank 0 does the inter-node all-reduce, the others only talk inside the node."""
    ring = cost("ring", P=2, n=N, rank=0)
    leader = cost("twolevel", P=8, n=N, rank=4, local_size=4)
    member = cost("twolevel", P=8, n=N, rank=5, local_size=4)
    assert leader.bytes_sent - ring.bytes_sent == collective_cost("tree_broadcast", P=4, n=N, rank=0).bytes_sent
    assert member.bytes_sent == collective_cost("tree_reduce", P=4, n=N, rank=1).bytes_sent + \
        collective_cost("tree_broadcast", P=4, n=N, rank=1).bytes_sent


def test_twolevel_refuses_a_bad_allreduce():
    from sparsecomm import WorkerError
    with pytest.raises(WorkerError, match="twolevel: allreduce='tree' must be one of"):
        run_workers(2, trace_method, "twolevel", {"allreduce": "tree"}, N, 1, timeout=30)
