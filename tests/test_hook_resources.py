"""What a SparseHookState holds outside Python's memory is released (its thread, its private process
group and the group's sockets), and the hook's usage mistakes are named as such."""

import contextlib
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm import SparseHookState, hook, run_workers
from sparsecomm.transport.deadline import RankStalledError


def _counts() -> tuple[int, int]:
    """This process's threads (the kernel's, so gloo's own count) and open file descriptors."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _one_state(close: bool) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Linear(20, 5))
    state = SparseHookState(None, "topk", density=0.1)
    model.register_comm_hook(state, hook)
    model(torch.randn(4, 20)).sum().backward()
    if close:
        state.close()


def _thirty_states() -> dict:
    torch.manual_seed(0)
    _one_state(close=True)  # torch's own lazily started threads (autograd, DDP) come with the first
    gc.collect()
    start = _counts()
    for _ in range(30):
        _one_state(close=True)
    closed = _counts()
    for _ in range(30):
        _one_state(close=False)
    gc.collect()
    collected = _counts()
    # a state's group destroyed by hand, then a new state: its group must come up as usual
    state = SparseHookState(None, "topk", density=0.1)
    dist.destroy_process_group(state.comm.group)
    model = nn.parallel.DistributedDataParallel(nn.Linear(20, 5))
    other = SparseHookState(None, "topk", density=0.1)
    model.register_comm_hook(other, hook)
    model(torch.randn(4, 20)).sum().backward()
    return {"start": start, "closed": closed, "collected": collected, "after_destroy": other.iter}


def test_thirty_states_leave_threads_and_descriptors_where_they_were():
    for result in run_workers(2, _thirty_states, timeout=240):
        (threads, fds) = result["start"]
        for when in ("closed", "collected"):
            assert abs(result[when][0] - threads) <= 1 and abs(result[when][1] - fds) <= 1, (when, result)
        assert result["after_destroy"] == 1


def _missing_hook():
    model = nn.parallel.DistributedDataParallel(nn.Linear(20, 5))
    if dist.get_rank() == 0:
        try:
            model.register_comm_hook(SparseHookState(None, "topk", density=0.1), hook)
        except RankStalledError as exc:
            return str(exc), exc.ranks
        return "no error", None
    with contextlib.suppress(RuntimeError):  # rank 1 runs plain DDP: its all-reduce waits for rank 0 in vain
        model(torch.randn(4, 20)).sum().backward()
    return "plain DDP", None


def test_a_rank_that_registered_no_hook_is_named():
    message, ranks = run_workers(2, _missing_hook, timeout=60, stall_timeout=3)[0]
    assert ranks == [1]
    assert message.startswith("rank(s) [1] did not create its SparseHookState (it registered no sparsecomm hook, "
                              "or made its hook states in another order than the other ranks) within 3 s")


def _shared_state():
    state = SparseHookState(None, "topk", density=0.1)
    first = nn.parallel.DistributedDataParallel(nn.Linear(20, 5))
    second = nn.parallel.DistributedDataParallel(nn.Linear(30, 7))
    first.register_comm_hook(state, hook)
    second.register_comm_hook(state, hook)
    first(torch.randn(4, 20)).sum().backward()
    try:
        second(torch.randn(4, 30)).sum().backward()
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_one_state_shared_by_two_ddp_models_is_named_as_such():
    for message in run_workers(2, _shared_state, timeout=60):
        assert "one SparseHookState is registered on two DDP models; give each model its own SparseHookState" \
            in message
