"""run_workers: results in rank order, clear errors for raising / exiting / hanging workers within the
timeout, and no process left behind on any path."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from sparsecomm import WorkerError, run_workers


def _rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def _record_pid_then(directory, behaviour):
    rank = dist.get_rank()
    with open(os.path.join(directory, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        if behaviour == "raise":
            raise ValueError("boom from the test")
        if behaviour == "exit":
            os._exit(3)
        if behaviour == "hang":
            time.sleep(3600)
    if behaviour == "hang":
        dist.barrier()          # the others wait for rank 1 in a collective: a realistic deadlock
    return rank


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _assert_no_worker_left(directory):
    pids = []
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as handle:
            pids.append(int(handle.read()))
    assert pids, "the workers never started"
    left = [pid for pid in pids if _alive(pid)]
    assert not left, f"worker processes {left} outlived run_workers"


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_results_in_rank_order(P):
    assert run_workers(P, _rank_and_size) == [(r, P) for r in range(P)]


def test_worker_that_raises_names_rank_and_traceback(tmp_path):
    with pytest.raises(WorkerError) as info:
        run_workers(3, _record_pid_then, str(tmp_path), "raise", timeout=30)
    err = info.value
    assert err.rank == 1 and "rank 1 raised ValueError: boom from the test" in str(err)
    assert "_record_pid_then" in err.worker_traceback
    _assert_no_worker_left(tmp_path)


def test_worker_that_exits_is_reported(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 exited \(exit code 3\)"):
        run_workers(3, _record_pid_then, str(tmp_path), "exit", timeout=30)
    assert time.monotonic() - start < 30
    _assert_no_worker_left(tmp_path)


def test_worker_that_hangs_times_out(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"timeout: rank\(s\) \[.*1.*\] did not finish within 3 s"):
        run_workers(3, _record_pid_then, str(tmp_path), "hang", timeout=3)
    assert time.monotonic() - start < 10
    _assert_no_worker_left(tmp_path)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match=r"world_size=.* must be an integer >= 1"):
        run_workers(bad, _rank_and_size)


def test_bad_timeout_and_fn():
    with pytest.raises(ValueError, match="timeout"):
        run_workers(2, _rank_and_size, timeout=0)
    with pytest.raises(TypeError, match="callable"):
        run_workers(2, "not a function")


def test_a_failed_connect_is_retried_before_fn_runs(tmp_path, monkeypatch):
    # Forked workers inherit this patch: rank 1's first connect fails, as gloo's does under load.
    marker = tmp_path / "failed-once"
    real_init = dist.init_process_group

    def flaky_init(*args, rank, **kwargs):
        if rank == 1 and not marker.exists():
            marker.write_text("x")
            raise RuntimeError("Gloo connectFullMesh failed (injected by the test)")
        return real_init(*args, rank=rank, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", flaky_init)
    assert run_workers(3, _rank_and_size, timeout=30) == [(0, 3), (1, 3), (2, 3)]
    assert marker.exists()


def test_a_connect_that_keeps_failing_is_reported(monkeypatch):
    real_init = dist.init_process_group

    def broken_init(*args, rank, **kwargs):
        if rank == 2:
            raise RuntimeError("no route (injected by the test)")
        return real_init(*args, rank=rank, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", broken_init)
    with pytest.raises(WorkerError, match=r"rank 2 raised RuntimeError: no route \(injected by the test\)"):
        run_workers(3, _rank_and_size, timeout=30)


def _stall(kind):
    rank = dist.get_rank()
    if rank == 1:
        if kind == "sleep":
            time.sleep(3600)                       # stuck outside any collective
        os.kill(os.getpid(), signal.SIGSTOP)       # frozen: its heartbeat stops too
    if kind == "frozen-alone":
        time.sleep(20)                             # nobody waits for rank 1 in a collective
        return rank
    dist.all_reduce(torch.ones(4))
    return rank


@pytest.mark.parametrize("kind", ["sleep", "stop", "frozen-alone"])
def test_a_rank_that_stops_participating_is_named_within_the_stall_timeout(kind):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 stopped participating: ") as info:
        run_workers(3, _stall, kind, timeout=60, stall_timeout=4)
    assert info.value.rank == 1
    assert time.monotonic() - start < 15
    heartbeat = "no heartbeat for 4 s" in str(info.value)
    waited = "rank(s) [0, 2] waited 4 s for it in a collective" in str(info.value)
    # a stopped rank trips both detectors at about the same time; either may report first
    assert {"sleep": waited, "stop": heartbeat or waited, "frozen-alone": heartbeat}[kind], str(info.value)


_LAUNCH_AND_WAIT = """
import sys, time, torch
torch.set_num_threads(1)
from sparsecomm import run_workers
def fn():
    time.sleep(60)
print("started", flush=True)
run_workers(2, fn, timeout=120)
"""


def _store_dirs():
    import tempfile
    root = tempfile.gettempdir()
    return {name for name in os.listdir(root) if name.startswith("sparsecomm-")}


def test_a_killed_launcher_leaves_no_temporary_directory(tmp_path):
    before = _store_dirs()
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH_AND_WAIT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 20
    while not (_store_dirs() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    created = _store_dirs() - before
    assert created, "the launcher never made its store directory"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while created & _store_dirs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not created & _store_dirs(), f"{created & _store_dirs()} left behind after SIGKILL"


def test_bad_stall_timeout():
    with pytest.raises(ValueError, match=r"stall_timeout=0 must be a finite number > 0"):
        run_workers(2, _rank_and_size, stall_timeout=0)
