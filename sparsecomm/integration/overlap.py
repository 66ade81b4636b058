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
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..transport.deadline import group_timeout

__all__ = ["CommThread", "hidden_seconds", "private_group"]

log = logging.getLogger(__name__)


def private_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group over the ranks of ``process_group`` (``None``: the default group), same
    backend and same timeout (:func:`~sparsecomm.transport.deadline.group_timeout`: the one the user
    gave ``init_process_group``, not torch's 30-minute default for new groups); only its members
    take part in creating it."""
    ranks = list(range(dist.get_world_size())) if process_group is None \
        else list(dist.get_process_group_ranks(process_group))
    group = dist.new_group(ranks=ranks, backend=dist.get_backend(process_group), use_local_synchronization=True,
                           timeout=group_timeout(process_group))
    assert group is not None  # this rank is a member
    return group


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
        """Finish the submitted work and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
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
