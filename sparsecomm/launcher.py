"""Local launcher: P worker processes on this machine, each with an initialized gloo process group.

``run_workers(P, fn, *args)`` forks P children (the fork start method starts P = 8 in well under a
second, where spawn or torchrun take seconds), sets ``torch.set_num_threads(1)`` first in each,
joins them through a ``FileStore`` in a fresh temporary directory (no TCP port to pick or race for),
runs ``fn(*args)`` and returns the per-rank results in rank order.

Failure handling: a worker that raises makes the call raise :class:`WorkerError` naming the rank,
with the worker's traceback; a worker that exits or is killed, or a call that outlives ``timeout``,
also ends in a :class:`WorkerError` within the timeout. On every path all children are killed and
reaped (children also die with their parent through ``PR_SET_PDEATHSIG``): no orphan processes.

With ``net="1gbit"`` (any tc rate), every worker lives in its own network namespace on an emulated
switch whose links are rate-limited (see :mod:`sparsecomm.netemu`); gloo binds that namespace's
interface through ``GLOO_SOCKET_IFNAME``.

Caveat inherited from fork: a parent process that already ran a multithreaded torch operation makes
children hang on their first parallel op. Call ``torch.set_num_threads(1)`` early in a parent that
computes before launching (the ``sparsecomm`` CLI and the test suite do).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

__all__ = ["run_workers", "WorkerError", "current_network"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_current_network: Optional[str] = None


class WorkerError(RuntimeError):
    """A worker raised, died, or did not finish within the timeout."""

    def __init__(self, message: str, rank: Optional[int] = None, worker_traceback: str = "") -> None:
        super().__init__(message + (f"\n--- traceback of rank {rank} ---\n{worker_traceback}"
                                    if worker_traceback else ""))
        self.rank = rank
        self.worker_traceback = worker_traceback


def current_network() -> Optional[str]:
    """Inside a worker: the emulated rate (``net=``) it runs under, or ``None`` for loopback."""
    return _current_network


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: best effort only
        pass


def _worker_main(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple,
                 conn: mp.connection.Connection, network, net: Optional[str], timeout: float,
                 backend: str) -> None:
    global _current_network
    import torch

    torch.set_num_threads(1)
    _die_with_parent()
    import torch.distributed as dist

    try:
        if network is not None:
            os.environ.update(network.enter(rank))
        _current_network = net
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            result = fn(*args)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException as exc:  # report everything, SystemExit included
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        conn.close()


def _validate(world_size: Any, fn: Any, timeout: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")


def run_workers(world_size: int, fn: Callable, *args: Any, net: Optional[str] = None,
                timeout: float = 120.0, backend: str = "gloo") -> List[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in one process group.

    Args:
        world_size: number of workers P (>= 1).
        fn: called in every worker after ``torch.distributed`` is initialized; read the rank with
            ``torch.distributed.get_rank()`` or build a :class:`~sparsecomm.Communicator`.
            Its return value must pickle.
        net: ``None`` for loopback, or a tc rate string (``"1gbit"``, ``"100mbit"``) to put each
            worker in its own network namespace behind a link of that rate (needs root + iproute2;
            raises ``RuntimeError`` saying why when unavailable).
        timeout: seconds for the whole call (start, work and exit); also the process group's
            timeout for each collective.
        backend: the torch.distributed backend of the workers (``"gloo"`` on CPU).

    Returns:
        ``[fn's result on rank 0, ..., on rank P-1]``.

    Raises:
        WorkerError: a worker raised (its rank and traceback are in the message), exited without a
            result, or the call did not finish within ``timeout``.
    """
    _validate(world_size, fn, timeout)
    network_cm: Any = contextlib.nullcontext(None)
    if net is not None:
        from .netemu import EmulatedNetwork, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"net={net!r} cannot be emulated here: {reason}")
        network_cm = EmulatedNetwork(world_size, net)

    ctx = mp.get_context("fork")
    tmpdir = tempfile.mkdtemp(prefix="sparsecomm-")
    procs: List[mp.process.BaseProcess] = []
    conns: List[mp.connection.Connection] = []
    finished = False
    try:
        with network_cm as network:
            store_path = os.path.join(tmpdir, "store")
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"sparsecomm-rank{rank}",
                                   args=(rank, world_size, store_path, fn, args, child_end,
                                         network, net, timeout, backend), daemon=True)
                proc.start()
                child_end.close()
                procs.append(proc)
                conns.append(parent_end)
            results = _collect(procs, conns, time.monotonic() + timeout, timeout)
            finished = True
            return results
    finally:
        _reap(procs, grace=2.0 if finished else 0.0)
        for conn in conns:
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(procs: List[mp.process.BaseProcess], conns: List[mp.connection.Connection],
             deadline: float, timeout: float) -> List[Any]:
    """Gather one message per rank; fail fast on the first error, exit or deadline."""
    results: List[Any] = [None] * len(procs)
    pending = {conn: rank for rank, conn in enumerate(conns)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = sorted(pending.values())
            raise WorkerError(f"timeout: rank(s) {ranks} did not finish within {timeout:g} s "
                              f"(hung or deadlocked); all workers were killed")
        ready = mp.connection.wait(list(pending) + [p.sentinel for p in procs], timeout=min(remaining, 0.5))
        for item in ready:
            if item in pending:
                rank = pending.pop(item)
                try:
                    message = item.recv()
                except EOFError:
                    message = None
                if message is None:
                    procs[rank].join(1.0)
                    raise WorkerError(f"rank {rank} exited (exit code {procs[rank].exitcode}) "
                                      f"without returning a result", rank=rank)
                if message[0] == "error":
                    raise WorkerError(f"rank {rank} raised {message[1]}", rank=rank,
                                      worker_traceback=message[2])
                results[rank] = message[1]
        for rank, proc in enumerate(procs):
            if conns[rank] in pending and proc.exitcode is not None and not conns[rank].poll():
                pending.pop(conns[rank])
                raise WorkerError(f"rank {rank} exited (exit code {proc.exitcode}) without returning "
                                  f"a result", rank=rank)
    return results


def _reap(procs: List[mp.process.BaseProcess], grace: float) -> None:
    """Let finished workers exit for up to ``grace`` seconds, then kill and join the rest."""
    end = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)
