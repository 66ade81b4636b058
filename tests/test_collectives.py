"""Dense collectives built from point-to-point: equal torch's own results, and the meter equals the
cost model to the byte, for P = 1..8."""

import pytest
import torch
import torch.distributed as dist

from sparsecomm import Communicator, run_workers
from sparsecomm.core.cost import chunk_offsets
from sparsecomm.methods import collective_cost
from sparsecomm.transport import collectives as C
from sparsecomm.transport import sparse_collectives as SC

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]


def _collectives_worker(n: int):
    comm = Communicator()
    r, P = comm.rank, comm.size
    gen = torch.Generator().manual_seed(1234 + r)
    # Integer-valued floats: every summation order gives the same bits, so results compare exactly.
    x = torch.randint(-1000, 1000, (n,), generator=gen).float()
    ref = x.clone()
    dist.all_reduce(ref)
    gathered_ref = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(gathered_ref, x)
    out = {}
    for name, fn in [("ring", C.ring_allreduce), ("rabenseifner", C.rabenseifner_allreduce)]:
        mark = comm.meter.snapshot()
        result = fn(comm, x)
        t = comm.meter.since(mark)
        out[name] = (torch.equal(result, ref), t.rounds, t.bytes_sent, t.bytes_recv, torch.equal(x, x))
    mark = comm.meter.snapshot()
    gathered = C.recursive_doubling_allgather(comm, x)
    t = comm.meter.since(mark)
    out["recursive_doubling_allgather"] = (all(torch.equal(a, b) for a, b in zip(gathered, gathered_ref, strict=False)),
                                           t.rounds, t.bytes_sent, t.bytes_recv, True)
    mark = comm.meter.snapshot()
    gathered = SC.bruck_allgatherv(comm, [x])
    t = comm.meter.since(mark)
    out["bruck_allgather"] = (all(torch.equal(a[0], b) for a, b in zip(gathered, gathered_ref, strict=False)),
                              t.rounds, t.bytes_sent, t.bytes_recv, True)
    mark = comm.meter.snapshot()
    piece = C.ring_reduce_scatter(comm, x)
    start, size = chunk_offsets(n, P)[r]
    out["reduce_scatter"] = (torch.equal(piece, ref[start:start + size]), comm.meter.since(mark).rounds)
    return out


@pytest.mark.parametrize("P", WORLD_SIZES)
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_collectives_equal_torch_and_cost_model(P, n):
    results = run_workers(P, _collectives_worker, n, timeout=60)
    for rank, res in enumerate(results):
        for name, formula in [("ring", "ring_allreduce"), ("rabenseifner", "rabenseifner_allreduce"),
                              ("recursive_doubling_allgather", "recursive_doubling_allgather"),
                              ("bruck_allgather", "bruck_allgather")]:
            equal, rounds, sent, recv, _ = res[name]
            assert equal, f"{name} differs from torch at P={P} n={n} rank={rank}"
            model = collective_cost(formula, P=P, n=n, rank=rank)
            assert (rounds, sent, recv) == (model.rounds, model.bytes_sent, model.bytes_recv), \
                f"{name} P={P} n={n} rank={rank}: meter {(rounds, sent, recv)} != model {model}"
        assert res["reduce_scatter"] == (True, P - 1)


def _uneven_bruck_worker():
    comm = Communicator()
    r = comm.rank
    idx = torch.arange(r * 3, dtype=torch.int32)          # rank r contributes 3r entries
    val = torch.full((r * 3,), float(r), dtype=torch.bfloat16)
    gathered = SC.bruck_allgatherv(comm, [idx, val])
    return [(g[0].tolist(), g[1].float().tolist()) for g in gathered], comm.meter.totals().rounds


@pytest.mark.parametrize("P", [3, 5, 8])
def test_bruck_allgatherv_uneven_sizes_and_dtypes(P):
    for gathered, rounds in run_workers(P, _uneven_bruck_worker, timeout=60):
        assert rounds == (P - 1).bit_length()
        for q, (idx, val) in enumerate(gathered):
            assert idx == list(range(q * 3)) and val == [float(q)] * (q * 3)


def _float_consistency_worker(n):
    comm = Communicator()
    x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
    ref = x.clone()
    dist.all_reduce(ref)
    a, b = C.ring_allreduce(comm, x), C.rabenseifner_allreduce(comm, x)
    return a, b, ref


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8])
def test_float_results_identical_on_all_ranks_and_close_to_torch(P):
    results = run_workers(P, _float_consistency_worker, 513, timeout=60)
    for a, b, ref in results:
        assert torch.equal(a, results[0][0]) and torch.equal(b, results[0][1])
        assert torch.allclose(a, ref, atol=1e-5) and torch.allclose(b, ref, atol=1e-5)


@pytest.mark.parametrize("P, rounds", [(2, [1, 1]), (4, [3] * 4), (8, [5] * 8),
                                       (6, [2, 5, 2, 5, 3, 3]), (3, [2, 3, 1])])
def test_rabenseifner_middle_rounds_are_one(P, rounds):
    # 2 log2 p' - 1 rounds on the p' active ranks (+2 for a folded pair; 2 for the rank folded out):
    # the halving's last step and the doubling's first are one exchange of the segment
    assert [collective_cost("rabenseifner_allreduce", P=P, n=1000, rank=r).rounds for r in range(P)] == rounds
