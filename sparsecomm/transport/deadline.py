"""Every wait has a deadline, and the ranks that outlive it are named on every other rank.

The rules (docs/reliability.md, "Hang detection"):

* **One timeout.** Every process group the library makes (the DDP hook's private group,
  :func:`sparsecomm.integration.overlap.private_group`) takes the timeout of the group it copies,
  i.e. the one the user gave ``init_process_group`` (``sparsecomm train --collective-timeout``):
  :func:`group_timeout`. torch's ``new_group`` would otherwise give it its own default of 30 minutes.
  (:meth:`~sparsecomm.transport.comm.Communicator.split` makes no group: its teams talk over the
  parent's.)
* **Name the rank.** gloo's timeout says only "Timed out waiting ... for recv", and in a chain of
  waits (rank 2 waits for rank 0, which waits for the stuck rank 3) the peer a rank waited for need
  not be the culprit. When a collective times out, :func:`explain_timeout` has the rank post
  ``timedout/<rank>`` in the process group's store, waits a few seconds for the others to do the
  same, and names the ranks that did not: every rank that timed out names the same ranks, under
  the local launcher and under torchrun alike (the store is the rendezvous store). When the store
  itself is gone (its host died: rank 0 under env://), nothing can be learnt from it, and every
  survivor raises the same error saying so instead of blaming the ranks it could not hear from.
  Steps that wait in the store itself (creating a process group) :func:`meet` first, so the rank
  that never came is named there too.
* **No desynchronization.** A rank whose method call fails *after* the agreement (the other ranks
  are already exchanging payload with it) posts ``failed/<rank>`` with its message
  (:func:`report_failure`); the others, left waiting, time out and name it with that message.
  The method then refuses further calls (:class:`ProtocolBroken`): a retry would pair with the
  others' pending messages (gloo aborts with "Received data size doesn't match expected size").
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["group_timeout", "is_peer_failure", "explain_timeout", "report_failure", "meet",
           "RankStalledError", "ProtocolBroken", "NAMING_GRACE"]

log = logging.getLogger(__name__)

#: Longest wait (seconds) for the other ranks to report their own timeout before naming the missing ones.
NAMING_GRACE = 5.0
_PREFIX = "sparsecomm/deadline"
# substrings of gloo's and NCCL's errors for a collective that timed out or lost a peer
_PEER_MARKERS = ("Timed out waiting", "timed out", "Timeout", "timeout", "Connection closed by peer",
                 "Connection reset by peer", "Broken pipe")


#: Incidents this process has explained so far: the store keys of incident i live under ``.../i/``, so a
#: later incident on the same store (another method or group after a caught error) does not read the
#: keys of an earlier one. The ranks count alike as long as they meet the same incidents in the same order.
_incident = 0


class RankStalledError(RuntimeError):
    """A collective timed out because ``ranks`` did not take part (stuck, frozen, dead, or failed
    mid-call); raised on every rank that was left waiting."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class ProtocolBroken(RuntimeError):
    """A method call failed after the ranks agreed to communicate: the ranks are out of step and the
    process group cannot be used again (restart the job, e.g. from a checkpoint)."""


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The timeout ``group`` (``None``: the default group) was created with, or ``None`` when the
    backend does not say (then torch's default applies)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except RuntimeError:  # no backend for this device type
            continue
        options = getattr(backend, "options", None)
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's "a collective timed out" or "a peer closed the connection" error."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, RankStalledError | ProtocolBroken) \
        and any(marker in str(exc) for marker in _PEER_MARKERS)


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError):
        return None


def _seconds(timeout: datetime.timedelta | None) -> str:
    return f"{timeout.total_seconds():g} s" if timeout is not None else "the process group's timeout"


def meet(point: str, members: Sequence[int], timeout: datetime.timedelta | None, what: str) -> None:
    """Wait until every rank of ``members`` (global ranks) has reached ``point`` (a name that is the
    same on every member and new for each meeting), at most ``timeout``; else raise
    :class:`RankStalledError` naming the members that did not arrive, which were to ``what``.

    For the steps that wait in the store, where the backend's own error names no rank: creating a
    process group waits there for every member's address, and says only "Wait timeout"."""
    store = _store()
    if store is None or len(members) <= 1:
        return
    keys = {rank: f"{_PREFIX}/meet/{point}/{rank}" for rank in members}
    store.set(keys[dist.get_rank()], "1")
    try:
        store.wait(list(keys.values()), timeout if timeout is not None else datetime.timedelta(minutes=30))
    except Exception as exc:  # noqa: BLE001 - the store's timeout, or a store that is gone
        try:
            missing = [rank for rank, key in keys.items() if not store.check([key])]
        except Exception:  # noqa: BLE001 - a dead store: the original error says what happened
            raise exc from None
        if not missing:
            raise
        raise RankStalledError(f"rank(s) {missing} did not {what} within {_seconds(timeout)}; rank(s) "
                               f"{sorted(set(members) - set(missing))} waited for them", missing) from exc


def _store_address() -> str:
    """Where the store of this job is said to live (``MASTER_ADDR:MASTER_PORT``), for messages."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{address}:{port}" if address and port else "its address is not in the environment"


def report_failure(message: str) -> None:
    """Tell the other ranks (through the store) that this rank's call failed mid-protocol."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_PREFIX}/{_incident}/failed/{dist.get_rank()}", message[:2000])
    except Exception:  # noqa: BLE001 - the store may be gone too; the others still time out
        log.debug("could not post the failure to the store", exc_info=True)


def explain_timeout(exc: BaseException, members: Sequence[int], grace: float = NAMING_GRACE) -> RankStalledError:
    """The error to raise instead of the backend's timeout or lost connection ``exc``: names the ranks of ``members``
    (global ranks of the communicator that timed out) that did not time out themselves within
    ``grace`` seconds, i.e. that never entered the collective, with the message of any that failed."""
    global _incident
    me, incident = dist.get_rank(), _incident
    _incident += 1
    prefix = f"{_PREFIX}/{incident}"
    seconds = _seconds(group_timeout())
    store = _store()
    if store is None:
        return RankStalledError(f"a collective timed out after {seconds} (no store to learn which rank "
                                f"was missing): {exc}", [])
    arrived: set[int] = set()
    failures: dict[int, str] = {}
    try:
        store.set(f"{prefix}/timedout/{me}", "1")
        end = time.monotonic() + grace
        while True:
            arrived = {r for r in members if store.check([f"{prefix}/timedout/{r}"])}
            if arrived == set(members) or time.monotonic() >= end:
                break
            time.sleep(0.05)
        for rank in members:
            key = f"{prefix}/failed/{rank}"
            if store.check([key]):
                failures[rank] = store.get(key).decode(errors="replace")
    except Exception as store_error:  # noqa: BLE001 - the store is gone: nothing can be learnt from it
        # Every survivor lands here alike (the store's host, rank 0 under env://, died, or its server
        # stopped), so every survivor raises the same words; what each one's backend said differs
        # (the peer addresses) and goes to the cause.
        log.debug("store unavailable while naming the stuck rank: %s", store_error)
        error = RankStalledError(
            f"a collective failed and the process group's store is unreachable ({_store_address()}): the rank "
            f"hosting the store (under env:// and torchrun's static rendezvous, rank 0) or the store's server "
            f"has died, so the ranks that stopped cannot be named; restart the job from its last checkpoint", [])
        error.__cause__ = exc
        return error
    missing = sorted(set(members) - arrived - {me})
    culprits = sorted(set(missing) | set(failures))
    waited = sorted(arrived)
    if not culprits:
        return RankStalledError(f"a collective timed out after {seconds}, but every rank timed out "
                                f"(ranks {waited}); no single rank is to blame: {exc}", [])
    parts = []
    for rank in culprits:
        if rank in failures:
            parts.append(f"rank {rank} failed mid-call ({failures[rank]})")
        else:
            parts.append(f"rank {rank} did not take part (stuck, frozen or dead)")
    return RankStalledError(f"rank(s) {culprits} stopped participating: {'; '.join(parts)}; rank(s) {waited} "
                            f"were left waiting (collective timeout {seconds})", culprits)
