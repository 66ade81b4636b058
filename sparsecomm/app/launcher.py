"""Local launcher: P worker processes on this machine, each with an initialized gloo process group.

``run_workers(P, fn, *args)`` forks P children (the fork start method starts P = 8 in well under a
second, where spawn or torchrun take seconds), sets ``torch.set_num_threads(1)`` first in each,
joins them through a ``FileStore`` in a fresh temporary directory (no TCP port to pick or race for),
runs ``fn(*args)`` and returns the per-rank results in rank order.

Failure handling: a worker that raises makes the call raise :class:`WorkerError` naming the rank,
with the worker's traceback; a worker that exits or is killed, or a call that outlives ``timeout``,
also ends in a :class:`WorkerError` within the timeout. On every path all children are killed and
reaped (children also die with their parent through ``PR_SET_PDEATHSIG``): no orphan processes.

Start-up: under heavy load gloo's full-mesh connect occasionally fails on one rank (seen about once
in 60 launches of P = 8 on a 2-core machine running 6 busy processes). All ranks then agree, through
the store, to give up before running ``fn``, and the launcher starts them again (3 attempts).

With ``net="1gbit"`` (any tc rate), every worker lives in its own network namespace on an emulated
switch whose links are rate-limited (see :mod:`sparsecomm.app.netemu`); gloo binds that namespace's
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
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..core.validate import check_int

__all__ = ["run_workers", "WorkerError", "current_network"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_current_network: str | None = None


class WorkerError(RuntimeError):
    """A worker raised, died, or did not finish within the timeout."""

    def __init__(self, message: str, rank: int | None = None, worker_traceback: str = "") -> None:
        super().__init__(message + (f"\n--- traceback of rank {rank} ---\n{worker_traceback}"
                                    if worker_traceback else ""))
        self.rank = rank
        self.worker_traceback = worker_traceback


def current_network() -> str | None:
    """Inside a worker: the emulated rate (``net=``) it runs under, or ``None`` for loopback."""
    return _current_network


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: best effort only
        pass


def _send(conn: mp.connection.Connection, message: tuple) -> None:
    # Plain pickle, not multiprocessing's: torch's reducers would pass tensors as shared-memory
    # handles that die with this process before the parent reads them.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple,
                 conn: mp.connection.Connection, network, net: str | None, timeout: float,
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
        init_error = None
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:  # reported below, once every rank knows whether all connected
            init_error = (f"{type(exc).__name__}: {exc}", traceback.format_exc())
        if not _all_ranks_connected(store, rank, world_size, init_error is None, timeout):
            _send(conn, ("init_failed",) + (init_error or ("another rank failed to connect", "")))
            return
        try:
            result = fn(*args)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        _send(conn, ("ok", result))
    except BaseException as exc:  # report everything, SystemExit included
        with contextlib.suppress(Exception):
            _send(conn, ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        conn.close()


def _all_ranks_connected(store, rank: int, world_size: int, connected: bool, timeout: float) -> bool:
    """Tell the others through the store whether this rank's process group came up; learn theirs.

    Under heavy load gloo's full-mesh connect occasionally fails on one rank. No rank runs ``fn``
    before every rank has said it connected, so when one reports a failure (at once; its peers may
    be stuck in their own connect) the launcher can kill them all and start them again.
    """
    keys = [f"sparsecomm/connected/{r}" for r in range(world_size)]
    store.set(keys[rank], "1" if connected else "0")
    if not connected:
        return False
    store.wait(keys, datetime.timedelta(seconds=timeout))
    return all(store.get(key) == b"1" for key in keys)


def _validate(world_size: Any, fn: Any, timeout: Any) -> None:
    check_int("world_size", world_size, minimum=1)
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")


def run_workers(world_size: int, fn: Callable, *args: Any, net: str | None = None,
                timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
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

    with network_cm as network:
        for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
            try:
                return _launch(world_size, fn, args, network, net, timeout, backend)
            except _ConnectFailed as failure:
                if attempt == _LAUNCH_ATTEMPTS:
                    raise failure.error from None
                log.warning("workers failed to connect (attempt %d of %d), starting them again: %s",
                            attempt, _LAUNCH_ATTEMPTS, failure.error)
    raise AssertionError("unreachable")


_LAUNCH_ATTEMPTS = 3


class _ConnectFailed(Exception):
    """Every rank gave up before running ``fn`` because some process group failed to connect."""

    def __init__(self, error: WorkerError) -> None:
        super().__init__(str(error))
        self.error = error


def _launch(world_size: int, fn: Callable, args: tuple, network, net: str | None, timeout: float,
            backend: str) -> list[Any]:
    """One attempt: fork the workers, collect their results, reap them on every path."""
    ctx = mp.get_context("fork")
    tmpdir = tempfile.mkdtemp(prefix="sparsecomm-")
    procs: list[mp.process.BaseProcess] = []
    conns: list[mp.connection.Connection] = []
    finished = False
    try:
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


_SECONDARY_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _collect(procs: list[mp.process.BaseProcess], conns: list[mp.connection.Connection],
             deadline: float, timeout: float) -> list[Any]:
    """Gather one message per rank; fail on the first error, exit or deadline.

    When a worker fails, its peers usually fail next with "connection closed by peer"; the other
    errors arriving within a short grace period are gathered so the root cause is the one reported.
    """
    results: list[Any] = [None] * len(procs)
    errors: list[tuple] = []   # (rank, summary, traceback)
    pending = {conn: rank for rank, conn in enumerate(conns)}
    grace_end = None
    while pending:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if now >= deadline:
            if errors:
                break
            raise WorkerError(f"timeout: rank(s) {sorted(pending.values())} did not finish within "
                              f"{timeout:g} s (hung or deadlocked); all workers were killed")
        limit = min(deadline, grace_end or deadline) - now
        ready = mp.connection.wait(list(pending), timeout=min(limit, 0.2))
        for conn in ready:
            assert isinstance(conn, mp.connection.Connection)
            rank = pending.pop(conn)
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(1.0)
                message = ("error", f"exited (exit code {procs[rank].exitcode}) without returning a result", "")
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                errors.append((rank, message[1], message[2], message[0] == "init_failed"))
        for conn, rank in list(pending.items()):
            if procs[rank].exitcode is not None and not conn.poll():
                pending.pop(conn)
                errors.append((rank, f"exited (exit code {procs[rank].exitcode}) without returning a result",
                               "", False))
        if errors and grace_end is None:
            grace_end = min(deadline, time.monotonic() + 2.0)
    if errors:
        primary = next((e for e in errors if not any(m in e[1] for m in _SECONDARY_FAILURE)), errors[0])
        rank, summary, tb, _ = primary
        others = sorted(e[0] for e in errors if e is not primary)
        also = f" (rank(s) {others} failed too)" if others else ""
        verb = "raised " if tb else ""
        error = WorkerError(f"rank {rank} {verb}{summary}{also}", rank=rank, worker_traceback=tb)
        if all(e[3] for e in errors):
            raise _ConnectFailed(error)
        raise error
    return results


def _reap(procs: list[mp.process.BaseProcess], grace: float) -> None:
    """Let finished workers exit for up to ``grace`` seconds, then kill and join the rest."""
    end = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)
