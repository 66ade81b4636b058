"""Local launcher: P worker processes on this machine, each with an initialized gloo process group.

``run_workers(P, fn, *args)`` forks P children (the fork start method starts P = 8 in well under a
second, where spawn or torchrun take seconds), sets ``torch.set_num_threads(1)`` first in each,
joins them through a ``FileStore`` in a fresh temporary directory (no TCP port to pick or race for),
runs ``fn(*args)`` and returns the per-rank results in rank order.

Failure handling: a worker that raises makes the call raise :class:`WorkerError` naming the rank,
with the worker's traceback; a worker that exits or is killed, or a call that outlives ``timeout``,
also ends in a :class:`WorkerError` within the timeout. On every path all children are killed and
reaped (children also die with their parent through ``PR_SET_PDEATHSIG``): no orphan processes.

A rank that stops participating is named within ``stall_timeout`` (default 50 s), two ways:

* every collective of the process group times out after ``stall_timeout``: the ranks waiting for
  the stalled one raise, and the rank that did not (still busy, or stuck outside any collective)
  is the one reported: "rank 2 stopped participating: rank(s) [0, 1, 3] waited 50 s for it";
* each worker sends a heartbeat every ``stall_timeout / 10`` seconds from a thread; a rank whose
  heartbeats stop for ``stall_timeout`` (frozen: stopped, or deadlocked with the interpreter lock
  held) is reported as such, even if no other rank is waiting for it yet.

The FileStore lives in a temporary directory that a small janitor process removes when the
launcher ends by any path, SIGKILL included (it waits for the end of a pipe that only the launcher
and its workers hold open).

Start-up: under heavy load gloo's full-mesh connect occasionally fails on one rank. All ranks then
agree, through the store, to give up before running ``fn``, and the launcher starts them again (3 attempts).

With ``net="1gbit"`` (any tc rate), every worker lives in its own network namespace on an emulated
switch whose links are rate-limited (see :mod:`sparsecomm.launch.netemu`); gloo binds that namespace's
interface through ``GLOO_SOCKET_IFNAME``. With ``net="2x4:1gbit"`` (``NODESxLOCAL:RATE``, optionally
``NODESxLOCAL:RATE/INTRA_RATE``) the workers form NODES emulated nodes of LOCAL consecutive ranks:
the ranks of a node share its namespace, talk to each other over its loopback (unlimited, or at
INTRA_RATE) and share one NIC of RATE for traffic to other nodes.

Node environment: every worker gets the variables ``torchrun`` sets, so code can rely on them under
both launchers: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (ranks per node L),
``GROUP_RANK`` (the node) and ``GROUP_WORLD_SIZE`` (the nodes). The layout is the ``net=`` one: L =
LOCAL for ``"NODESxLOCAL:RATE"``, L = 1 for a plain rate (every rank has its own link); without
``net``, L is ``LOCAL_WORLD_SIZE`` of the calling process when it is set, else P: all workers run on
this one machine, as ``torchrun`` on one machine would say.

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

from ..core.validate import check_int, check_number

__all__ = ["run_workers", "WorkerError", "current_network", "node_environment"]

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


def node_environment(rank: int, world_size: int, local_size: int) -> dict[str, str]:
    """The variables ``torchrun`` gives worker ``rank`` of ``world_size`` in nodes of ``local_size``."""
    node, local_rank = divmod(rank, local_size)
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(world_size // local_size)}


def _local_size(world_size: int, net: str | None) -> int:
    """Ranks per node for the workers' environment (see the module docstring)."""
    from ..transport.nodemap import LOCAL_SIZE_ENV, resolve_local_size

    if net is not None:
        from .netemu import parse_net

        return parse_net(net, world_size).local_size
    if os.environ.get(LOCAL_SIZE_ENV) is None:
        return world_size
    return resolve_local_size(world_size)


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
                 conn: mp.connection.Connection, beat: mp.connection.Connection, network, net: str | None,
                 timeout: float, stall_timeout: float, backend: str, local_size: int) -> None:
    global _current_network
    import torch

    torch.set_num_threads(1)
    _die_with_parent()
    import torch.distributed as dist

    try:
        os.environ.update(node_environment(rank, world_size, local_size))
        if network is not None:
            os.environ.update(network.enter(rank))  # while single-threaded: only the caller moves
        _start_heartbeat(beat, stall_timeout / _BEATS_PER_STALL)
        _current_network = net
        store = dist.FileStore(store_path, world_size)
        init_error = None
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=stall_timeout))
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


_BEATS_PER_STALL = 10


def _start_heartbeat(beat: mp.connection.Connection, interval: float) -> None:
    """A daemon thread sending one byte every ``interval`` seconds until the process ends."""
    import threading

    def run() -> None:
        with contextlib.suppress(OSError, ValueError):
            while True:
                beat.send_bytes(b".")
                time.sleep(interval)

    threading.Thread(target=run, name="sparsecomm-heartbeat", daemon=True).start()


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


def _validate(world_size: Any, fn: Any, timeout: Any, stall_timeout: Any) -> None:
    check_int("world_size", world_size, minimum=1)
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    check_number("timeout", timeout, 0, strict=True)
    check_number("stall_timeout", stall_timeout, 0, strict=True)


#: Default seconds after which a rank that stopped participating is reported.
STALL_TIMEOUT = 50.0


def run_workers(world_size: int, fn: Callable, *args: Any, net: str | None = None,
                timeout: float = 120.0, stall_timeout: float = STALL_TIMEOUT,
                backend: str = "gloo") -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in one process group.

    Args:
        world_size: number of workers P (>= 1).
        fn: called in every worker after ``torch.distributed`` is initialized; read the rank with
            ``torch.distributed.get_rank()`` or build a :class:`~sparsecomm.Communicator`.
            Its return value must pickle.
        net: ``None`` or ``"loopback"`` for loopback, or a tc rate string (``"1gbit"``, ``"100mbit"``) to put each
            worker in its own network namespace behind a link of that rate, or
            ``"NODESxLOCAL:RATE[/INTRA_RATE]"`` (``"2x4:1gbit"``) for emulated nodes sharing one
            NIC of RATE each (needs root + iproute2; raises ``RuntimeError`` saying why when
            unavailable, ``ValueError`` when NODES x LOCAL is not ``world_size``).
        timeout: seconds for the whole call (start, work and exit).
        stall_timeout: seconds after which a rank that stopped participating is reported: the
            process group's timeout for each collective, and the longest silence of a worker's
            heartbeat.
        backend: the torch.distributed backend of the workers (``"gloo"`` on CPU).

    Returns:
        ``[fn's result on rank 0, ..., on rank P-1]``.

    Raises:
        WorkerError: a worker raised (its rank and traceback are in the message), exited without a
            result, or the call did not finish within ``timeout``.
    """
    _validate(world_size, fn, timeout, stall_timeout)
    from .netemu import emulated_net

    net = emulated_net(net)
    local_size = _local_size(world_size, net)
    network_cm: Any = contextlib.nullcontext(None)
    if net is not None:
        from .netemu import EmulatedNetwork, parse_net, unavailable_reason

        spec = parse_net(net, world_size)
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"net={net!r} cannot be emulated here: {reason}")
        network_cm = EmulatedNetwork(world_size, spec.rate, local_size=spec.local_size,
                                     intra_rate=spec.intra_rate)

    with network_cm as network:
        for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
            try:
                return _launch(world_size, fn, args, network, net, timeout, stall_timeout, backend,
                               local_size)
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
            stall_timeout: float, backend: str, local_size: int) -> list[Any]:
    """One attempt: fork the workers, collect their results, reap them on every path."""
    ctx = mp.get_context("fork")
    janitor, janitor_pipe, tmpdir = _start_janitor()
    procs: list[mp.process.BaseProcess] = []
    conns: list[mp.connection.Connection] = []
    beats: list[mp.connection.Connection] = []
    finished = False
    try:
        store_path = os.path.join(tmpdir, "store")
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            beat_parent, beat_child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"sparsecomm-rank{rank}",
                               args=(rank, world_size, store_path, fn, args, child_end, beat_child,
                                     network, net, timeout, stall_timeout, backend, local_size),
                               daemon=True)
            proc.start()
            child_end.close()
            beat_child.close()
            procs.append(proc)
            conns.append(parent_end)
            beats.append(beat_parent)
        results = _Collector(procs, conns, beats, timeout, stall_timeout).run()
        finished = True
        return results
    finally:
        _reap(procs, grace=2.0 if finished else 0.0)
        for conn in conns + beats:
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        os.close(janitor_pipe)
        os.waitpid(janitor, 0)


def _start_janitor() -> tuple[int, int, str]:
    """Fork a process that makes the store's temporary directory and removes it once the launcher
    and its workers are gone.

    It blocks on a pipe whose write end only the launcher (and the workers it forks, which die with
    it) hold; the end of the pipe, however the launcher ends, triggers the removal. The janitor makes
    the directory itself, so no moment exists in which it exists without a janitor. Returns
    ``(pid, write end, directory)``: the launcher closes the write end and reaps the janitor.
    """
    hold_read, hold_write = os.pipe()
    name_read, name_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the janitor: no torch, no logging, nothing that a fork from a threaded parent breaks
        status = 0
        try:
            os.close(hold_write)
            os.close(name_read)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the terminal hits the launcher
            path = tempfile.mkdtemp(prefix="sparsecomm-")
            os.write(name_write, path.encode())
            os.close(name_write)
            while os.read(hold_read, 1):
                pass
            shutil.rmtree(path, ignore_errors=True)
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(hold_read)
    os.close(name_write)
    with os.fdopen(name_read, "rb") as names:
        path = names.read().decode()
    if not path:
        os.close(hold_write)
        os.waitpid(pid, 0)
        raise RuntimeError("the launcher's janitor process could not make a temporary directory")
    return pid, hold_write, path


_SECONDARY_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_COLLECTIVE_TIMEOUT = ("Timed out waiting", "timed out", "Timeout", "stopped participating")


class _Collector:
    """Gather one message per rank; fail on the first error, exit, stalled rank or deadline.

    When a worker fails, its peers usually fail next with "connection closed by peer"; the other
    errors arriving within a short grace period are gathered so the root cause is the one reported.
    """

    GRACE = 2.0

    def __init__(self, procs: list[mp.process.BaseProcess], conns: list[mp.connection.Connection],
                 beats: list[mp.connection.Connection], timeout: float, stall_timeout: float) -> None:
        self.procs, self.timeout, self.stall_timeout = procs, timeout, stall_timeout
        now = time.monotonic()
        self.deadline = now + timeout
        self.pending = {conn: rank for rank, conn in enumerate(conns)}
        self.beating = {beat: rank for rank, beat in enumerate(beats)}
        self.last_beat = [now] * len(procs)
        self.results: list[Any] = [None] * len(procs)
        self.errors: list[tuple[int, str, str, bool]] = []   # (rank, summary, traceback, init failure)

    def run(self) -> list[Any]:
        grace_end = None
        while self.pending:
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if now >= self.deadline:
                if self.errors:
                    break
                raise WorkerError(f"timeout: rank(s) {sorted(self.pending.values())} did not finish within "
                                  f"{self.timeout:g} s (hung or deadlocked); all workers were killed")
            if not self.errors:
                self._check_heartbeats(now)
            limit = min(self.deadline, grace_end or self.deadline) - now
            ready = mp.connection.wait(list(self.pending) + list(self.beating), timeout=min(limit, 0.2))
            for conn in ready:
                assert isinstance(conn, mp.connection.Connection)
                if conn in self.beating:
                    self._read_beats(conn)
                else:
                    self._read_result(conn)
            self._check_exits()
            if self.errors and grace_end is None:
                grace_end = min(self.deadline, time.monotonic() + self.GRACE)
        if self.errors:
            raise self._error()
        return self.results

    def _read_beats(self, beat: mp.connection.Connection) -> None:
        rank = self.beating[beat]
        try:
            while beat.poll():
                beat.recv_bytes()
        except (EOFError, OSError):  # the worker is gone; its result pipe tells how
            del self.beating[beat]
        self.last_beat[rank] = time.monotonic()

    def _check_heartbeats(self, now: float) -> None:
        silent = [rank for rank in sorted(self.pending.values()) if now - self.last_beat[rank] > self.stall_timeout]
        if silent:
            raise WorkerError(f"rank {silent[0]} stopped participating: no heartbeat for {self.stall_timeout:g} s "
                              "(the process is frozen: stopped, or blocked holding the interpreter lock); "
                              "all workers were killed", rank=silent[0])

    def _read_result(self, conn: mp.connection.Connection) -> None:
        rank = self.pending.pop(conn)
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            self.procs[rank].join(1.0)
            message = ("error", f"exited (exit code {self.procs[rank].exitcode}) without returning a result", "")
        if message[0] == "ok":
            self.results[rank] = message[1]
        else:
            self.errors.append((rank, message[1], message[2], message[0] == "init_failed"))

    def _check_exits(self) -> None:
        for conn, rank in list(self.pending.items()):
            if self.procs[rank].exitcode is not None and not conn.poll():
                self.pending.pop(conn)
                self.errors.append((rank, f"exited (exit code {self.procs[rank].exitcode}) without returning "
                                          "a result", "", False))

    def _error(self) -> Exception:
        errors = self.errors
        waited = [e[0] for e in errors if any(m in e[1] for m in _COLLECTIVE_TIMEOUT)]
        if waited and self.pending:  # the others timed out in a collective; these never came
            stuck = sorted(self.pending.values())
            return WorkerError(f"rank {stuck[0]} stopped participating: rank(s) {sorted(waited)} waited "
                               f"{self.stall_timeout:g} s for it in a collective (the process group's "
                               f"timeout) while it did not enter it" +
                               (f"; rank(s) {stuck[1:]} did not finish either" if stuck[1:] else "") +
                               "; all workers were killed", rank=stuck[0])
        primary = next((e for e in errors if not any(m in e[1] for m in _SECONDARY_FAILURE)), errors[0])
        rank, summary, tb, _ = primary
        others = sorted(e[0] for e in errors if e is not primary)
        also = f" (rank(s) {others} failed too)" if others else ""
        verb = "raised " if tb else ""
        error = WorkerError(f"rank {rank} {verb}{summary}{also}", rank=rank, worker_traceback=tb)
        if all(e[3] for e in errors):
            return _ConnectFailed(error)
        return error


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
