"""Communicator: exchange of payloads of unknown size, packed multi-tensor messages, splits, meter."""

import pytest
import torch

from sparsecomm import Communicator, TrafficMeter, run_workers
from sparsecomm.transport.collectives import ring_allreduce


def _ring_exchange():
    comm = Communicator()
    r, P = comm.rank, comm.size
    with comm.meter.phase("ex"):
        got = comm.exchange((r + 1) % P, torch.arange(r + 2, dtype=torch.float64), (r - 1) % P)
    t = comm.meter.phases()["ex"]
    return got.tolist(), t.as_dict()


@pytest.mark.parametrize("P", [2, 3, 5])
def test_exchange_unknown_sizes(P):
    for r, (got, t) in enumerate(run_workers(P, _ring_exchange)):
        src = (r - 1) % P
        assert got == [float(i) for i in range(src + 2)]
        assert t["rounds"] == 1 and t["bytes_sent"] == (r + 2) * 8 and t["bytes_recv"] == (src + 2) * 8
        assert t["header_bytes_sent"] == 8 and t["messages_sent"] == 1


def _packed():
    comm = Communicator()
    r, P = comm.rank, comm.size
    idx = torch.arange(r, dtype=torch.int32)
    val = torch.full((r,), r / 2, dtype=torch.float16)
    got = comm.exchange_many((r + 1) % P, [idx, val], (r - 1) % P, count=2)
    return [g.tolist() for g in got], [g.dtype for g in got]


def test_exchange_many_mixed_dtypes_and_empty_payloads():
    results = run_workers(3, _packed)
    for r, (got, dtypes) in enumerate(results):
        src = (r - 1) % 3
        assert got == [list(range(src)), [src / 2] * src] and dtypes == [torch.int32, torch.float16]


def _eager(limit):
    import sparsecomm.transport.comm as comm_module
    comm = Communicator()
    if limit is None:
        comm._eager_headers = False  # the NCCL protocol: every header a message of its own
    else:
        comm_module.EAGER_LIMIT_BYTES = limit
    r, P = comm.rank, comm.size
    posts = []
    real_post = comm._post
    comm._post = lambda *a, **kw: (posts.append(1), real_post(*a, **kw))[1]
    # rank r sends 16 + 120 r bytes: with a 128-byte limit only rank 0 sends one message, the others two
    idx = torch.arange(10 * r, dtype=torch.int64)
    val = torch.full((10 * r,), float(r))
    with comm.meter.phase("ex"):
        got = comm.exchange_many((r + 1) % P, [idx, val], (r - 1) % P, count=2)
    return [g.tolist() for g in got], len(posts), comm.meter.phases()["ex"].as_dict()


@pytest.mark.parametrize("limit", [128, 4 << 20, None])
def test_exchange_sends_the_header_inside_a_small_message(limit):
    """gloo takes a message shorter than the receive buffer: the header rides in front of the payload
    (one message) up to the eager limit, and a larger payload follows its header as before. Each side
    decides alone, and the meter books the same bytes either way, and as without the eager protocol
    (``limit=None``: NCCL's way, header and payload always apart)."""
    P = 4
    for r, (got, posts, t) in enumerate(run_workers(P, _eager, limit)):
        src = (r - 1) % P
        assert got == [list(range(10 * src)), [float(src)] * (10 * src)]
        sent_fits = limit is not None and 16 + 120 * r <= limit
        got_fits = limit is not None and 16 + 120 * src <= limit
        assert posts == (1 if sent_fits and got_fits else 2)
        assert t["header_bytes_sent"] == 16 and t["header_bytes_recv"] == 16
        assert t["bytes_sent"] == 120 * r and t["bytes_recv"] == 120 * src
        assert t["messages_sent"] == (1 if r else 0) and t["rounds"] == 1


def _ahead(limit):
    """Receives posted ahead (post_receives) carry the next exchange_many message from each source: one
    per source (named twice, it gets one), a frame past the eager limit included (its payload, sent
    second, finds no other receive from that source before its own); the exchange after them posts its
    own receive."""
    import time

    import sparsecomm.transport.comm as comm_module
    comm_module.EAGER_LIMIT_BYTES = limit
    comm = Communicator()
    r, P = comm.rank, comm.size
    taken = []
    real_post = comm._post
    comm._post = lambda *a, **kw: (taken.append(kw.get("posted") is not None), real_post(*a, **kw))[1]
    first, second = (r - 1) % P, (r + 1) % P
    comm.post_receives([first, second, first])
    posted = len(comm._ahead)
    time.sleep(0.003 * r)  # the peers' messages arrive while this rank is still away
    got = []
    for step in range(3):  # from r - 1, from r + 1, from r - 1 again; rank q sends 10 q + step entries
        dst, src = ((r + 1) % P, first) if step != 1 else ((r - 1) % P, second)
        n = 10 * r + step
        parts = comm.exchange_many(dst, [torch.arange(n, dtype=torch.int64), torch.full((n,), float(r))], src, count=2)
        got.append([p.tolist() for p in parts])
    return got, posted, len(comm._ahead), taken


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("limit", [128, 4 << 20])
def test_receives_posted_ahead_carry_the_next_exchange_from_each_source(P, limit):
    for r, (got, posted, left, taken) in enumerate(run_workers(P, _ahead, limit, timeout=60)):
        first, second = (r - 1) % P, (r + 1) % P
        for step, src in enumerate((first, second, first)):
            n = 10 * src + step
            assert got[step] == [list(range(n)), [float(src)] * n]
        assert posted == len({first, second}) and left == 0
        assert sum(taken) == posted  # each posted receive was taken, by the first exchange from its source


def _split(mode):
    comm = Communicator()
    team, cross = comm.split(2, mode)
    x = torch.full((4,), float(comm.rank))
    team_sum = ring_allreduce(team, x)[0].item()
    cross_sum = ring_allreduce(cross, x)[0].item()
    return team.ranks, cross.ranks, team_sum, cross_sum, comm.meter.totals().rounds


@pytest.mark.parametrize("mode, team0, cross0", [("consecutive", [0, 1, 2], [0, 3]), ("strided", [0, 2, 4], [0, 1])])
def test_split_teams(mode, team0, cross0):
    results = run_workers(6, _split, mode)
    team_ranks, cross_ranks, team_sum, cross_sum, rounds = results[0]
    assert team_ranks == team0 and cross_ranks == cross0
    assert team_sum == sum(team0) and cross_sum == sum(cross0)
    assert rounds == 2 * (3 - 1) + 2 * (2 - 1)          # both sub-communicators share one meter


def _bad_split(teams):
    Communicator().split(teams)


def test_split_rejects_teams_not_dividing_size():
    from sparsecomm import WorkerError
    with pytest.raises(WorkerError, match=r"teams=4 must be a positive integer dividing the size 6"):
        run_workers(6, _bad_split, 4)


def test_communicator_needs_process_group():
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        Communicator()


def test_meter_phases_nest_and_reset():
    meter = TrafficMeter()
    with meter.phase("a"):
        meter.record_send(10)
        with meter.phase("b"):
            meter.record_recv(4)
            meter.record_round()
        meter.record_send(8, header=True)
    phases = meter.phases()
    assert phases["a"].bytes_sent == 10 and phases["a"].header_bytes_sent == 8
    assert phases["b"].bytes_recv == 4 and phases["b"].rounds == 1
    mark = meter.snapshot()
    meter.record_send(5)
    assert meter.since(mark).bytes_sent == 5 and meter.totals().bytes_sent == 15
    meter.reset()
    assert meter.totals().bytes_sent == 0
