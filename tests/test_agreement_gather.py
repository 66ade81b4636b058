"""The first message that rides on the agreement (gloo): ``control.max_all_reduce_gathering`` delivers
every rank's block with the maxima, in the steps and bytes of ``allgatherv``; a ``SelectAllGather`` call
sends ceil(log2 P) messages in all and returns the same bits as when it agrees first; ranks that do not
all carry it disagree on every rank instead of misreading each other."""

import pytest
import torch
import torch.distributed as dist

from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import make_method
from sparsecomm.transport import control
from sparsecomm.transport.agreement import AgreementError
from sparsecomm.transport.comm import EAGER_LIMIT_BYTES, Communicator
from sparsecomm.transport.sparse_collectives import allgatherv_traffic

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]


def _block_of(rank: int, big: bool) -> list[torch.Tensor]:
    """Rank r's block: r + 1 int32 and 2 r + 1 float64 (unaligned sizes), or past the eager limit."""
    if big and rank == 1:
        return [torch.arange(EAGER_LIMIT_BYTES // 4 + 5, dtype=torch.int32)]
    return [torch.arange(rank + 1, dtype=torch.int32), torch.full((2 * rank + 1,), rank + 0.5, dtype=torch.float64)]


def _gather(big: bool, without: int | None):
    comm = Communicator()
    rank, P = comm.rank, comm.size
    block = None if rank == without else _block_of(rank, big)
    maxima, gathered, steps = control.max_all_reduce_gathering(comm, [rank, -rank, 7], block)
    expected = [torch.cat([t.contiguous().view(torch.uint8) for t in _block_of(q, big)]) for q in range(P)]
    same = gathered is not None and all(torch.equal(a, b) for a, b in zip(gathered, expected, strict=True))
    sizes = [int(b.numel()) for b in expected]
    rounds, sent, recv = allgatherv_traffic(sizes, rank)
    traffic = (len(steps), sum(s.sent for s in steps), sum(s.recv for s in steps)) == (rounds, sent, recv)
    return maxima, same, gathered is None, traffic


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_every_rank_gets_every_block_and_the_maxima_in_the_steps_of_allgatherv(P):
    for maxima, same, _, traffic in run_workers(P, _gather, False, None, timeout=60):
        assert maxima == [P - 1, 0, 7]
        assert same and traffic


@pytest.mark.parametrize("P", [2, 3])
def test_a_block_past_the_eager_limit_follows_in_a_second_message(P):
    for maxima, same, _, traffic in run_workers(P, _gather, True, None, timeout=60):
        assert maxima == [P - 1, 0, 7]
        assert same and traffic


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_a_rank_without_a_block_leaves_every_rank_without_blocks_but_with_the_maxima(P):
    for maxima, _, none, _ in run_workers(P, _gather, False, P - 1, timeout=60):
        assert maxima == [P - 1, 0, 7]
        assert none


def _carries_nothing(comm: Communicator) -> bool:
    """``control.carries_blocks`` of a rank whose agreement carries no payload (as on NCCL), with gloo's frames."""
    return False


def _calls(name: str, gathers: bool):
    """Three calls of ``name``; ``gathers=False`` makes every rank agree first and all-gather after (the
    NCCL path), with the same frames for the agreement."""
    method = make_method(name, density=0.02)
    if not gathers:
        control.carries_blocks = _carries_nothing  # this worker process only
    sends = []
    real_isend = Communicator._isend

    def counting_isend(*args, **kwargs):
        sends.append(1)
        return real_isend(*args, **kwargs)

    Communicator._isend = counting_isend  # every message a Communicator sends
    try:
        outputs = []
        for call in range(3):
            grad = torch.randn(3000, generator=torch.Generator().manual_seed(10 * dist.get_rank() + call))
            outputs.append(method(grad))
    finally:
        Communicator._isend = real_isend
    return outputs, len(sends) / 3, method.stats.rounds


@pytest.mark.parametrize("name", ["topka", "threshold", "redsync", "exdyna"])
@pytest.mark.parametrize("P", [2, 3, 4, 7, 8])
def test_gathering_in_the_agreement_gives_the_same_bits_without_the_agreements_messages(P, name):
    folded = run_workers(P, _calls, name, True, timeout=60)
    apart = run_workers(P, _calls, name, False, timeout=60)
    for (outs, messages, rounds), (ref, ref_messages, ref_rounds) in zip(folded, apart, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
        assert rounds == ref_rounds  # the method's own rounds and traffic are unchanged
        assert ref_messages - messages == (P - 1).bit_length()  # messages each rank sent per call
        if name != "exdyna":  # an all-gather and nothing else: one message per round
            assert messages == rounds == (P - 1).bit_length()


def _mixed(kind: str):
    rank = dist.get_rank()
    method = make_method("topka", density=0.05)
    if rank == 1 and kind == "method":
        method = make_method("rabenseifner")
    if rank == 1 and kind == "gathers":
        control.carries_blocks = _carries_nothing  # this worker process only
    try:
        method(torch.randn(2000))
        return "went on"
    except AgreementError as exc:
        return str(exc)


@pytest.mark.parametrize("kind, text", [("method", "method differs across ranks"),
                                        ("gathers", "whether the agreement carries the first message differs")])
def test_ranks_that_do_not_all_gather_disagree_on_every_rank(kind, text):
    for message in run_workers(3, _mixed, kind, timeout=60):
        assert text in message, message
        assert "rank 1" in message


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8])
def test_spardl_sends_its_spar_reduce_scatter_in_the_agreement_with_the_same_bits(P):
    """SparDL's Spar-Reduce-Scatter step i sends to rank r + P/2^i and receives from r - P/2^i, the
    agreement's own schedule when P is a power of two: its messages ride there (log2 P messages fewer
    per call, the agreement's); elsewhere nothing changes."""
    folded = run_workers(P, _calls, "spardl", True, timeout=60)
    apart = run_workers(P, _calls, "spardl", False, timeout=60)
    rides = P >= 2 and P & (P - 1) == 0
    for (outs, messages, rounds), (ref, ref_messages, ref_rounds) in zip(folded, apart, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
        assert rounds == ref_rounds == 2 * (P - 1).bit_length()  # its own rounds (Table I) are unchanged
        assert ref_messages - messages == ((P - 1).bit_length() if rides else 0)


def _spardl_beside(other: str):
    rank = dist.get_rank()
    method = make_method("spardl", density=0.05)
    if rank == 1 and other == "gathers":
        control.carries_blocks = _carries_nothing  # this worker process only
    elif rank == 1:
        method = make_method(other) if other == "rabenseifner" else make_method(other, density=0.05)
    grad = torch.randn(2000, generator=torch.Generator().manual_seed(rank))
    try:
        method(grad)
        return "went on", None
    except AgreementError as exc:
        return str(exc), None if method.residual is None else bool((method.residual == 0).all())


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("other, text", [("topka", "method differs across ranks"),
                                         ("rabenseifner", "method differs across ranks"),
                                         ("gathers", "whether the agreement carries the first message differs")])
def test_a_rank_that_does_not_send_spardls_message_in_the_agreement_disagrees_on_every_rank(P, other, text):
    for message, residual_untouched in run_workers(P, _spardl_beside, other, timeout=60):
        assert text in message, message
        assert "rank 1" in message
        assert residual_untouched in (None, True)  # nothing was applied on the first call


def _riding(bad: int):
    """Each rank's message is the set of ranks that shaped it (a bit mask); rank ``bad``'s header
    differs. Returns (the maxima, the masks handed to ``produce``, the last step's mask or None)."""
    comm = Communicator()
    rank = comm.rank
    value = 5 if rank == bad else 0
    mine = [1 << rank]
    handed: list[int] = []

    def produce(step: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        handed.append(int(received[0].view(torch.int64)[0]))
        mine[0] |= handed[-1]
        return [torch.tensor([mine[0]], dtype=torch.int64)]

    maxima, last, moved = control.max_all_reduce_carrying(comm, [value, -value],
                                                          [torch.tensor([mine[0]], dtype=torch.int64)],
                                                          produce, lambda both: both[0] == -both[1])
    return maxima, handed, None if last is None else int(last[0].view(torch.int64)[0]), len(moved)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_riding_messages_reach_produce_only_from_ranks_that_agree_so_far(P):
    """``max_all_reduce_carrying``: with every header equal each step's message is made from the previous
    one's and the last one carries every rank; where rank P - 1's header differs, no message it shaped
    is ever handed to ``produce`` (nor returned), and every rank still reaches the same maxima."""
    steps = (P - 1).bit_length()
    for rank, (maxima, handed, last, moved) in enumerate(run_workers(P, _riding, -1, timeout=60)):
        assert maxima == [0, 0] and len(handed) == steps - 1 and moved == steps
        shaped = 1 << rank
        for mask in handed:
            shaped |= mask
        assert last is not None and shaped | last == (1 << P) - 1
    for rank, (maxima, handed, last, moved) in enumerate(run_workers(P, _riding, P - 1, timeout=60)):
        assert maxima == [5, 0] and moved == steps
        assert all(not mask >> (P - 1) & 1 for mask in handed), (rank, handed)
        assert last is None  # after the last step every rank has heard of rank P - 1


def _spardl_with_another_n(odd: int):
    rank = dist.get_rank()
    method = make_method("spardl", density=0.05)
    grad = torch.randn(3000 if rank == odd else 2000, generator=torch.Generator().manual_seed(rank))
    try:
        method(grad)
        return "went on", None
    except AgreementError as exc:
        return str(exc), None if method.residual is None else bool((method.residual == 0).all())


@pytest.mark.parametrize("P", [4, 8])
def test_spardl_riding_the_agreement_reads_nothing_from_a_rank_with_another_n(P):
    """SparDL makes its later messages before the verdict is complete: a rank with another n shapes
    none of the messages its peers read (its indices would fall outside their gradient); every rank
    raises the same error naming it, and nothing was applied."""
    for message, residual_untouched in run_workers(P, _spardl_with_another_n, P - 1, timeout=60):
        assert "gradient length differs across ranks" in message and f"rank {P - 1}" in message, message
        assert residual_untouched in (None, True)


def _preposted_agreements(big: bool, twice: bool):
    """Receives posted before the local work carry the agreement; posting again before it posts
    nothing more; none is left afterwards, and the next exchange gets its own message."""
    import time

    comm = Communicator()
    rank, P = comm.rank, comm.size
    control.post_receives_ahead(comm)
    if twice:  # a leftover from a call that failed before its agreement: the next one uses it
        control.post_receives_ahead(comm)
    posted = control.posted_ahead(comm)
    time.sleep(0.002 * rank)  # the peers' messages arrive while this rank still works
    maxima, gathered, _ = control.max_all_reduce_gathering(comm, [rank, -rank, 7], _block_of(rank, big))
    expected = [torch.cat([t.contiguous().view(torch.uint8) for t in _block_of(q, big)]) for q in range(P)]
    same = gathered is not None and all(torch.equal(a, b) for a, b in zip(gathered, expected, strict=True))
    left = control.posted_ahead(comm)
    after = comm.exchange((rank + 1) % P, torch.full((3,), float(rank)), (rank - 1) % P)
    return maxima, same, posted, left, after.tolist() == [float((rank - 1) % P)] * 3


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_receives_posted_before_the_local_work_carry_the_agreement_and_nothing_else(P, twice):
    for maxima, same, posted, left, exchanged in run_workers(P, _preposted_agreements, False, twice, timeout=60):
        assert maxima == [P - 1, 0, 7] and same
        assert posted == (P - 1).bit_length() and left == 0  # one receive per step, all used
        assert exchanged  # the next message went to its own receive, not to a leftover one


@pytest.mark.parametrize("P", [2, 3])
def test_a_preposted_agreement_takes_a_block_past_the_eager_limit(P):
    for maxima, same, _, left, _ in run_workers(P, _preposted_agreements, True, False, timeout=60):
        assert maxima == [P - 1, 0, 7] and same and left == 0


def _method_preposts(name: str):
    method = make_method(name) if name == "rabenseifner" else make_method(name, density=0.02)
    comm = method.comm
    posts = []
    real = control.post_receives_ahead

    def spy(posting):
        real(posting)
        posts.append(control.posted_ahead(posting))

    control.post_receives_ahead = spy  # this worker process only
    outputs = [method(torch.randn(3000, generator=torch.Generator().manual_seed(10 * comm.rank + c)))
               for c in range(3)]
    return posts, control.posted_ahead(comm), outputs


@pytest.mark.parametrize("name", ["topka", "spardl", "cltk", "rabenseifner"])
@pytest.mark.parametrize("P", [1, 3, 4])
def test_a_method_that_agrees_after_its_local_work_posts_its_receives_first(P, name):
    results = run_workers(P, _method_preposts, name, timeout=60)
    steps = (P - 1).bit_length()
    for posts, left, outputs in results:
        # a method that agrees first (rabenseifner) has no local work to hide the wait behind
        assert posts == ([] if name == "rabenseifner" else [steps] * 3) and left == 0
        assert all(torch.equal(a, b) for a, b in zip(outputs, results[0][2], strict=True))
