"""Every wait has a deadline (issue 23, item 2): the hook's private group takes the user's timeout,
a stuck rank is named on every other rank, and a rank's local failure cannot desynchronize the others."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsecomm
from sparsecomm import make_method, run_workers
from sparsecomm.integration.overlap import private_group
from sparsecomm.transport.deadline import ProtocolBroken, RankStalledError, group_timeout


def _private_group_timeout():
    group = private_group(None).group
    # both ranks use the group before either returns: a rank whose worker exits while its peer still
    # connects the group's mesh closes the connection under it ("Connection closed by peer")
    dist.barrier(group=group)
    return group_timeout(None).total_seconds(), group_timeout(group).total_seconds()


def test_the_hooks_private_group_takes_the_default_groups_timeout():
    for default, private in run_workers(2, _private_group_timeout, timeout=60, stall_timeout=7):
        assert default == private == 7


def _stuck_under_hook(method, stuck_rank):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    options = {"density": 0.1} if make_method(method, density=0.1 if method != "dense" else None).sparse else {}
    state = sparsecomm.SparseHookState(None, method, **options)
    ddp.register_comm_hook(state, sparsecomm.hook)
    for step in range(3):
        loss = ddp(torch.randn(8, 20)).pow(2).mean()
        if step == 1 and rank == stuck_rank:
            time.sleep(14)  # alive (its heartbeat goes on) but stuck before backward, past 4 s + naming
            return "stuck", 0.0
        start = time.monotonic()
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "finished", 0.0


@pytest.mark.parametrize("method", ["topk", "dense"])
def test_a_stuck_rank_is_named_under_the_hook_within_the_timeout(method):
    results = run_workers(3, _stuck_under_hook, method, 2, timeout=90, stall_timeout=4)
    for rank in (0, 1):
        message, waited = results[rank]
        assert "rank(s) [2] stopped participating" in message, message
        assert "Unable to cast" not in message
        assert waited < 4 + 8, waited
    assert results[2][0] == "stuck"


def _fails_after_agreement(name):
    """Rank 1's call raises after the agreement (a failure the local checks cannot foresee), in its
    ``reduce``: ``topkdsa`` still exchanges its streams with the others then, ``topk`` (on gloo)
    gathered everything inside the agreement."""
    rank = dist.get_rank()
    method = make_method(name, density=0.1)
    method(torch.ones(100))
    if rank == 1:
        def broken(*args, **kwargs):
            raise MemoryError("out of memory (injected)")
        method.reduce = broken
    start = time.monotonic()
    calls = []
    for _ in range(2):
        try:
            method(torch.ones(100))
            calls.append("went on")
        except Exception as exc:  # noqa: BLE001
            calls.append(f"{type(exc).__name__}: {exc}")
    return calls, time.monotonic() - start


def test_a_failure_after_the_agreement_is_named_on_the_others_and_stops_the_method():
    """The others wait for rank 1 in the same call, time out and name it with its error."""
    results = run_workers(3, _fails_after_agreement, "topkdsa", timeout=90, stall_timeout=4)
    assert "out of memory (injected)" in results[1][0][0]
    for rank in (0, 2):
        first = results[rank][0][0]
        assert "rank 1 failed mid-call (MemoryError: out of memory (injected))" in first, first
    assert all(calls[1].startswith(ProtocolBroken.__name__) for calls, _ in results)


def test_a_failure_after_an_all_gather_inside_the_agreement_is_named_at_the_next_call():
    """``topk`` on gloo sends its all-gather inside the agreement: when rank 1 fails after it, the
    others already hold every message and return the average; their next call waits for rank 1,
    which refuses it, and names rank 1 with its error."""
    results = run_workers(3, _fails_after_agreement, "topk", timeout=90, stall_timeout=4)
    assert "out of memory (injected)" in results[1][0][0]
    assert results[1][0][1].startswith(ProtocolBroken.__name__)
    for rank in (0, 2):
        first, second = results[rank][0]
        assert first == "went on"
        assert "rank 1 failed mid-call (MemoryError: out of memory (injected))" in second, second


def _fails_before_agreement():
    """Rank 1's selection raises before the agreement of a method that agrees after its scan."""
    rank = dist.get_rank()
    method = make_method("topka", density=0.1)
    assert method.accumulates
    method(torch.ones(100))
    residual = method.residual.clone()
    if rank == 1:
        def broken(*args, **kwargs):
            raise MemoryError("out of memory (injected)")
        method.selector.accumulate = broken
    try:
        method(torch.ones(100))
        first = "went on"
    except Exception as exc:  # noqa: BLE001
        first = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        del method.selector.accumulate
    unchanged = bool(torch.equal(method.residual, residual))
    method(torch.ones(100))  # nothing was sent: the ranks are still in step
    return first, unchanged, method.step


def test_a_failure_before_a_deferred_agreement_raises_on_every_rank_and_changes_nothing():
    results = run_workers(3, _fails_before_agreement, timeout=90, stall_timeout=10)
    for rank, (first, unchanged, step) in enumerate(results):
        assert "out of memory (injected)" in first if rank == 1 else "rank 1" in first, first
        assert "nothing was applied" in first, first
        assert unchanged and step == 2


def _local_problem_on_one_rank(kind, name):
    rank = dist.get_rank()
    options = {"density": 0.2} if name not in ("dense", "ring", "tree", "torus2d", "twolevel", "rabenseifner") else {}
    method = make_method(name, **options)
    method(torch.ones(64))
    grad = torch.arange(64, dtype=torch.float32)
    if rank == dist.get_world_size() - 1:
        grad = grad.requires_grad_() if kind == "requires_grad" else torch.empty(64, device="meta")
    outcome = []
    for _ in range(2):  # the bad rank retries, as the docs invite: the others must not be paired with it
        try:
            method(grad)
            outcome.append("ok")
        except Exception as exc:  # noqa: BLE001
            outcome.append(f"{type(exc).__name__}: {exc}")
    good = method(torch.ones(64) * (rank + 1))
    return outcome, good, method.step


@pytest.mark.parametrize("kind", ["requires_grad", "meta"])
@pytest.mark.parametrize("name", ["hitopk", "s2reducer", "omnireduce", "topk"])
def test_a_local_problem_on_one_rank_raises_on_every_rank_before_anything_is_sent(kind, name):
    results = run_workers(3, _local_problem_on_one_rank, kind, name, timeout=90, stall_timeout=10)
    cause = "requires grad" if kind == "requires_grad" else "meta tensor"
    for rank, (outcome, _, step) in enumerate(results):
        for text in outcome:
            assert "rank 2" in text and (cause in text or rank == 2), text
        assert step == 2
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[2][1], rtol=0, atol=0)


def test_the_error_of_a_stuck_rank_is_a_runtime_error_with_its_ranks():
    error = RankStalledError("x", [3])
    assert isinstance(error, RuntimeError) and error.ranks == [3]
