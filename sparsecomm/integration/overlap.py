"""The DDP hook's communication thread, and how much of its work backward hid.

The hook hands each bucket to one thread per hook state and returns a pending future, so bucket i is
selected and communicated while backward still computes bucket i+1 (DDP's own all-reduce overlaps
the same way; torch's PowerSGD hook chains its asynchronous work with ``.then()``). One thread takes
the buckets in the order DDP hands them over, which is bucket-index order on every rank, so every
rank issues the same collectives in the same order. The thread communicates over a process group of
its own (:func:`private_group`): DDP's reducer keeps issuing collectives on its group from the
backward thread (the unused-parameter bitmap, bucket rebuilds), and two threads sharing one gloo
group could pair different collectives across ranks.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..transport.deadline import group_timeout, meet

__all__ = ["CommThread", "PrivateGroup", "hidden_seconds", "private_group"]

log = logging.getLogger(__name__)


class PrivateGroup:
    """A process group the library made for itself (:func:`private_group`) and releases itself.

    ``releasable``: whether destroying it is safe. A group over every rank of the job is named by
    torch's running group count, which a destroyed group does not give back, so the next group gets a
    fresh name on every rank. A group over a subset is named by a hash of its ranks and of the number
    of groups alive, so destroying one would let the next group over the same ranks take its name and
    read the dead group's addresses from the store: such a group lives until the job's process group
    is destroyed.
    """

    def __init__(self, group: dist.ProcessGroup, releasable: bool) -> None:
        self.group = group
        self.releasable = releasable

    def release(self) -> None:
        """Destroy the group (its threads and sockets), once; nothing when it is not releasable or is
        gone already (destroyed by hand, or with the whole job's group)."""
        group, self.group = self.group, None  # type: ignore[assignment]
        if group is None or not self.releasable or not (dist.is_available() and dist.is_initialized()):
            return
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError, KeyError) as exc:  # "Invalid process group specified": gone already
            log.debug("private process group already destroyed: %s", exc)


#: groups made so far per set of ranks, the same count on every member (they make them in one order)
_made: dict[tuple[int, ...], int] = {}


def private_group(process_group: dist.ProcessGroup | None) -> PrivateGroup:
    """A new process group over the ranks of ``process_group`` (``None``: the default group), same
    backend and same timeout (:func:`~sparsecomm.transport.deadline.group_timeout`: the one the user
    gave ``init_process_group``, not torch's 30-minute default for new groups); only its members
    take part in creating it. The members first meet in the store
    (:func:`~sparsecomm.transport.deadline.meet`), so a rank that never makes the group (it
    registered no sparsecomm hook) is named after the timeout instead of a bare "Wait timeout"."""
    ranks = list(range(dist.get_world_size())) if process_group is None \
        else list(dist.get_process_group_ranks(process_group))
    timeout = group_timeout(process_group)
    key = tuple(ranks)
    count = _made.get(key, 0)
    _made[key] = count + 1
    meet(f"private_group/{zlib.crc32(repr(key).encode()):08x}/{count}", ranks, timeout,
         "create its SparseHookState (it registered no sparsecomm hook, or made its hook states in another "
         "order than the other ranks)")
    whole = len(ranks) == dist.get_world_size()
    group = dist.new_group(ranks=ranks, backend=dist.get_backend(process_group), use_local_synchronization=not whole,
                           timeout=timeout)
    assert group is not None  # this rank is a member
    return PrivateGroup(group, releasable=whole)


def hidden_seconds(intervals: list[tuple[float, float]], backward_end: float) -> float:
    """Seconds of the ``(start, end)`` intervals before ``backward_end`` (the moment DDP handed over
    its last bucket: after it, backward has nothing left to compute and DDP only waits)."""
    return sum(max(0.0, min(end, backward_end) - start) for start, end in intervals)


class CommThread:
    """One daemon thread running submitted callables one after another, in submission order.

    ``fn`` must not raise (the hook catches its errors and fails the bucket's future instead); an
    exception escaping anyway is logged and the thread goes on with the next item.
    """

    def __init__(self, name: str = "sparsecomm-hook") -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))

    def close(self) -> None:
        """Finish the submitted work and stop the thread (from the thread itself: stop after the
        current item, without waiting for it)."""
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - keep serving later buckets; the caller fails the future
                log.exception("sparsecomm hook thread: unexpected error")
