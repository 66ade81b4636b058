"""TopkA (all-gather of packed top-k messages): invariants for P = 1..8, the variable-size all-gather,
the select hook and the traffic against RedSync's equation (1)."""

import pytest
import torch
import torch.distributed as dist
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_traffic_matches,
    make_gradient,
    trace_method,
)

from sparsecomm import run_workers
from sparsecomm.methods import cost
from sparsecomm.methods.topka import TopkAllGather
from sparsecomm.transport.comm import Communicator
from sparsecomm.transport.sparse_collectives import allgatherv as sparse_allgatherv
from sparsecomm.transport.sparse_collectives import allgatherv_traffic as allgatherv_bytes

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
N = 1003


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_topka_consistent_conserved_and_traffic_equals_equation_1(P):
    density = 0.02
    traces = run_workers(P, trace_method, "topka", {"density": density}, N, 3, timeout=90)
    assert_consistent(traces)
    assert_conserved(traces)
    k = 21  # ceil(0.02 * 1003)
    assert_traffic_matches(traces, "topka", n=N, k=k)
    for trace in traces:
        for rec in trace:
            assert rec["stats"]["selected"] == k
            # exactly the k largest |grad + old residual| were sent: the rest is the residual
            acc = rec["grad"] + (0 if rec["old_residual"] is None else rec["old_residual"])
            sent = rec["new_residual"] == 0
            assert int(sent.sum()) == k
            assert acc.abs()[sent].min() >= acc.abs()[~sent].max()


def _gather_variable(seed):
    comm = Communicator()
    r = comm.rank
    idx = torch.arange(r * 3 + seed % 2, dtype=torch.int32)  # sizes differ per rank, some empty
    val = torch.full((idx.numel(),), float(r), dtype=torch.float64)
    got = sparse_allgatherv(comm, [idx, val])
    return [(i.tolist(), v.tolist()) for i, v in got], comm.meter.totals().as_dict()


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_variable_size_allgather_delivers_every_message_in_rank_order(P):
    results = run_workers(P, _gather_variable, 0, timeout=60)
    expected = [(list(range(q * 3)), [float(q)] * (q * 3)) for q in range(P)]
    sizes = [q * 3 * (4 + 8) for q in range(P)]
    for rank, (got, traffic) in enumerate(results):
        assert got == expected
        rounds, sent, recv = allgatherv_bytes(sizes, rank)
        assert (traffic["rounds"], traffic["bytes_sent"], traffic["bytes_recv"]) == (rounds, sent, recv)
        assert rounds == (P - 1).bit_length()


class _AboveOne(TopkAllGather):
    """A hard-threshold comparator through the hook: every |acc| > 1 (count differs per rank)."""

    def select(self, acc):
        return torch.nonzero(acc.abs() > 1.0).flatten()


def _run_subclass(n, steps):
    method = _AboveOne(density=0.5)
    rank = dist.get_rank()
    records = []
    for step in range(steps):
        grad = make_gradient(n, rank, step)
        old = None if method.residual is None else method.residual.clone()
        out = method(grad.clone())
        records.append({"grad": grad, "old_residual": old, "out": out.clone(),  # valid until the next call
                        "new_residual": method.residual.clone(), "stats": dict(method.stats),
                        "sent": method.last_sent.clone()})
    return records


@pytest.mark.parametrize("P", [3, 4])
def test_select_hook_subclass_with_variable_counts(P):
    traces = run_workers(P, _run_subclass, 200, 2, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    for step in range(2):
        counts = [trace[step]["stats"]["selected"] for trace in traces]
        assert len(set(counts)) > 1, "test needs different counts per rank"
        message_bytes = [trace[step]["stats"]["message_bytes"] for trace in traces]
        assert message_bytes == [c * 8 for c in counts]
        for rank, trace in enumerate(traces):
            s = trace[step]["stats"]
            want = cost("topka", P=P, n=200, k=0, rank=rank, message_bytes=message_bytes)
            assert (s["rounds"], s["bytes_sent"], s["bytes_recv"]) == \
                (want.rounds, want.bytes_sent, want.bytes_recv)
            acc = trace[step]["grad"] + (0 if trace[step]["old_residual"] is None else trace[step]["old_residual"])
            assert torch.equal(trace[step]["sent"], torch.nonzero(acc.abs() > 1.0).flatten())


def test_cost_bound_with_max_count():
    exact = cost("topka", P=8, n=10**6, k=1000, rank=0)
    assert (exact.rounds, exact.bytes_sent, exact.exact) == (3, 7 * 1000 * 8, True)
    bound = cost("topka", P=6, n=10**6, k=1000, rank=2, max_count=2000)
    assert (bound.rounds, bound.bytes_sent, bound.exact) == (3, 5 * 2000 * 8, False)


def _gather_known(sizes):
    comm = Communicator()
    r = comm.rank
    idx = torch.arange(sizes[r], dtype=torch.int32) + 10 * r
    val = torch.full((sizes[r],), float(r), dtype=torch.float32)
    numels = [(s, s) for s in sizes]
    known = sparse_allgatherv(comm, [idx, val], numels)
    after_known = comm.meter.totals().as_dict()
    unknown = sparse_allgatherv(comm, [idx, val])
    same = all(torch.equal(a, b) for x, y in zip(known, unknown, strict=True) for a, b in zip(x, y, strict=True))
    error = ""
    try:
        sparse_allgatherv(comm, [idx, val], [(s + 1, s + 1) for s in sizes])
    except ValueError as exc:
        error = str(exc)
    return same, after_known, error


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_allgather_of_known_sizes_sends_no_headers_and_delivers_the_same(P):
    sizes = [q % 3 + 2 for q in range(P)]  # known to every rank, unequal
    for rank, (same, traffic, error) in enumerate(run_workers(P, _gather_known, sizes, timeout=60)):
        assert same
        rounds, sent, recv = allgatherv_bytes([s * 8 for s in sizes], rank)
        assert (traffic["rounds"], traffic["bytes_sent"], traffic["bytes_recv"]) == (rounds, sent, recv)
        assert traffic["header_bytes_sent"] == 0
        assert f"rank {rank} sends parts of lengths" in error


def _topka_header_bytes(n, density):
    method = TopkAllGather(density=density)
    method(make_gradient(n, dist.get_rank(), 0))
    return method.stats["header_bytes"], method.comm.meter.phases()


@pytest.mark.parametrize("P", [2, 3, 4])
def test_topka_exact_count_messages_travel_without_size_headers(P):
    for header_bytes, phases in run_workers(P, _topka_header_bytes, 500, 0.02, timeout=60):
        # only the per-call agreement sends header bytes; the all-gather's messages are payload alone
        assert header_bytes == phases["topka"].header_bytes_sent == 0
        assert phases["agreement"].header_bytes_sent > 0
