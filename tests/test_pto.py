"""PTO (Shi et al., section 4.2): the balanced contiguous partition, parallel_apply equal to the
local computation for P = 1..4 with a number of items no P divides, and its all-gather's bytes equal
to the cost formula."""

import itertools

import pytest
import torch

from sparsecomm import Communicator, parallel_apply, run_workers
from sparsecomm.integration.pto import partition, pto_cost


def _brute_force_best(costs, parts):
    best = None
    n = len(costs)
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs,parts", [([5, 1, 1, 1, 1, 5], 2), ([3, 9, 2, 2, 7, 1, 1], 3), ([4, 4, 4], 5),
                                         ([1], 1), ([], 3), ([0, 0, 8, 0], 2), ([10, 1, 1, 1, 1, 1, 1, 10], 4)])
def test_partition_is_contiguous_complete_and_optimal(costs, parts):
    shares = partition(costs, parts)
    assert len(shares) == parts
    assert shares[0][0] == 0 and shares[-1][1] == len(costs)
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
    assert all(start <= stop for start, stop in shares)
    if costs:
        assert max(sum(costs[a:b]) for a, b in shares) == _brute_force_best(costs, parts)


def test_partition_rejects_bad_input():
    with pytest.raises(ValueError, match="parts=0"):
        partition([1, 2], 0)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        partition([1, -2], 2)


def test_without_process_group_runs_locally():
    items = [torch.arange(4.0), torch.ones(2, 3)]
    assert [r.tolist() for r in parallel_apply(lambda t: t.sum(), items)] == [6.0, 6.0]


def _items(count):
    gen = torch.Generator().manual_seed(7)
    shapes = [(3, 4), (17,), (2, 2, 5), (1,), (40,), (6, 6), (9,)]
    return [torch.randn(shapes[i % len(shapes)], generator=gen) for i in range(count)]


def _pto_worker(count):
    comm = Communicator()
    items = _items(count)

    def ops(t):  # results of mixed shapes and dtypes
        return [t.norm(), t.sum(dim=0), (t > 0).sum(), t.to(torch.float64).abs().max()]

    local = [ops(t) for t in items]
    same = True
    for which in range(4):
        got = parallel_apply(lambda t, which=which: ops(t)[which], items, comm)
        same &= all(g.dtype == ref[which].dtype and g.shape == ref[which].shape and torch.equal(g, ref[which])
                    for g, ref in zip(got, local, strict=True))
    pairs = [(a, b) for a, b in zip(items, reversed(items), strict=False)]
    got = parallel_apply(lambda pair: pair[0].sum() + pair[1].sum(), pairs, comm)
    same &= all(torch.equal(g, a.sum() + b.sum()) for g, (a, b) in zip(got, pairs, strict=True))
    mark = comm.meter.snapshot()
    parallel_apply(lambda t: t.norm(), items, comm)
    traffic = comm.meter.since(mark)
    return same, traffic.rounds, traffic.bytes_sent, traffic.bytes_recv


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_parallel_apply_equals_local_and_meter_equals_formula(P):
    count = 11  # divisible by no P > 1 here
    results = run_workers(P, _pto_worker, count, timeout=120)
    costs = [t.numel() for t in _items(count)]
    for rank, (same, rounds, sent, recv) in enumerate(results):
        assert same, f"rank {rank}: parallel_apply differs from the local computation"
        model = pto_cost(P=P, n=count, rank=rank, costs=costs)
        assert (rounds, sent, recv) == (model.rounds, model.bytes_sent, model.bytes_recv)
