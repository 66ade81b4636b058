"""Running a method's calls: everything around :meth:`~.base.Method.reduce` that is the same for every
method, so that a method implements its reduction and nothing else.

Per call, :class:`CallRunner`:

1. checks ``out=`` and refuses a method that an earlier call left out of step with its peers;
2. agrees with every rank on the call (:func:`.checks.check_call`): the same error on every rank for
   unusable input or ranks that disagree, the non-finite policy for NaN/Inf, all before anything is
   sent. A method with error feedback that accumulates (:meth:`~.base.Method.accumulate`) on a CPU
   gradient does that work first, into the residual store's spare buffer, so that its scan counts the
   NaN/Inf for the agreement (no pass of the agreement's own); its first message
   (:meth:`~.base.Method.first_message`) then travels in the agreement's messages where the backend
   allows (:mod:`..transport.control`), saving a round of messages; the spare becomes the residual once
   the ranks agreed (:class:`.residual.ResidualStore`), and the state the accumulation moved is put
   back if they did not;
3. calls ``reduce`` with the call's :class:`.output.Output`, which zeroes only what the previous call
   wrote into ``out=``;
4. fills ``method.stats``: the phases' seconds (:class:`.stats.PhaseTimer`), the metered bytes and
   rounds (the agreement's apart), the output's non-zeros;
5. turns a failure into what every rank can act on: a collective that timed out names the ranks that
   did not take part, and a failure after the agreement is posted for the others and leaves the
   method refusing further calls (:class:`~sparsecomm.transport.deadline.ProtocolBroken`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ..selection import NonFiniteInputError
from ..transport import control
from ..transport.comm import Communicator
from ..transport.control import BlockStep
from ..transport.deadline import ProtocolBroken, explain_timeout, is_peer_failure, report_failure
from .accumulation import Accumulated, AllGather, Exchanges, FirstMessage
from .checks import check_call, check_call_carrying, count_nonfinite, local_problem
from .output import Output, OutputRegions
from .residual import ResidualStore
from .stats import PHASES, PhaseTimer, Stats

__all__ = ["CallRunner"]


class Runnable(Protocol):
    """What the runner reads of a method (:class:`~.base.Method` has all of it)."""

    name: str
    comm: Communicator
    sparse: bool
    tracks_sent: bool
    stats: Stats
    step: int
    last_sent: torch.Tensor | None
    options: dict[str, Any]
    nonfinite: str

    @property
    def density(self) -> float | None: ...
    @property
    def residual(self) -> torch.Tensor | None: ...
    @property
    def accumulates(self) -> bool: ...
    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, layout: Any) -> Any: ...
    def first_message(self, acc: torch.Tensor, picked: Any) -> FirstMessage | None: ...
    def moved_by_accumulate(self) -> Iterable[Any]: ...
    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor: ...


class _Skipped(Exception):
    """The ranks agreed to skip the call (the non-finite policy); carries the figures."""

    def __init__(self, figures: dict[str, Any]) -> None:
        super().__init__("step skipped")
        self.figures = figures


class CallRunner:
    """Runs the calls of one method instance; holds what lasts between them: the residual store, where
    the last call wrote its output, and whether an earlier call broke the ranks' step."""

    def __init__(self, method: Runnable, method_names: Callable[[], list[str]]) -> None:
        # a weak reference: the method owns its runner, and a cycle between them would keep the
        # method's communicator (and its process group's threads and sockets) alive until the garbage
        # collector runs, after its owner closed it
        self.method: Runnable = weakref.proxy(method)
        self.method_names = method_names
        self.residuals = ResidualStore()
        self.regions = OutputRegions()
        self.times: dict[str, float] = {}
        self.running: list[PhaseTimer] = []  # the timers entered and not left, innermost last
        self.broken: str | None = None  # why an earlier call failed after the ranks agreed
        self.agreed = False  # this call is past its agreement: a failure now leaves the peers waiting
        self.entered = False  # this call entered its agreement (made after the method's local work)
        self.agreement: tuple[float, Any] | None = None  # (seconds, traffic) of that agreement

    def timer(self, phase: str) -> PhaseTimer:
        """Add the wall time of the ``with`` block to ``stats.time_<phase>``."""
        return PhaseTimer(self.times, phase, self.running)

    def __call__(self, grad: torch.Tensor, layout: Any, out: torch.Tensor | None) -> torch.Tensor:
        name = self.method.name
        if out is not None:
            _check_out(out, grad, name)
        if self.broken is not None:
            raise ProtocolBroken(f"{name}: an earlier call failed after the ranks agreed to communicate "
                                 f"({self.broken}); the ranks are out of step and this method cannot be "
                                 "called again: restart the job (e.g. from its last checkpoint)")
        try:
            return self._run(grad, layout, out)
        except Exception as exc:
            error = self._failure(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self.agreed = False

    # ------------------------------------------------------------------ one call
    def _run(self, grad: torch.Tensor, layout: Any, out: torch.Tensor | None) -> torch.Tensor:
        method, start = self.method, time.perf_counter()
        self.agreement, self.entered = None, False
        early = self._accumulates_first(grad, layout)
        if early:  # its agreement comes after its local work: let the peers' messages find their receives
            control.post_receives_ahead(method.comm)
        skip = None if early else self._check_first(grad, layout)
        self.agreed = skip is None and not early
        agreement_s = time.perf_counter() - start
        self.times = {}
        n = grad.numel()
        method.stats = Stats(n=n, selected=0 if method.sparse else n)
        if skip is not None:
            return self._skipped(grad, out, skip, agreement_s, start)
        if n == 0:  # the average of empty gradients is empty, on every method
            return self._empty(grad, out, start)
        mark = method.comm.meter.snapshot()
        output = Output(grad, out, self.regions, method.stats, layout, fresh=method.sparse)
        try:
            with method.comm.meter.phase(method.name):
                if method.accumulates:
                    output.accumulated = self._accumulate(grad, layout, early)
                result = method.reduce(grad, output)
        except _Skipped as skipped:
            assert self.agreement is not None
            return self._skipped(grad, out, skipped.figures, self.agreement[0], start)
        except Exception as exc:
            if early and not self.entered and not is_peer_failure(exc):
                self._tell_others(grad, layout, exc)  # the other ranks wait in the agreement
            raise
        result = output.finish(result)
        self._book(result, mark, agreement_s, start)
        method.step += 1
        return result

    def _check_first(self, grad: Any, layout: Any) -> dict[str, Any] | None:
        """The call's checks, made before anything else (:func:`.checks.check_call`)."""
        return check_call(self.method, grad, layout, self.method_names())

    def _accumulates_first(self, grad: Any, layout: Any) -> bool:
        """Whether this call accumulates before it agrees: a method that accumulates, on a CPU gradient
        that passes the local checks (a local problem is told to every rank by the agreement first). On
        other devices, where memory is scarcer and a pass cheaper, it agrees first and accumulates in
        place, keeping one residual buffer."""
        method = self.method
        return (method.accumulates and isinstance(grad, torch.Tensor) and grad.device.type == "cpu"
                and grad.numel() > 0 and local_problem(grad, layout, method.name, method.residual) is None)

    def _accumulate(self, grad: torch.Tensor, layout: Any, early: bool) -> Accumulated:
        """The method's accumulation and first message, and the agreement after them when ``early``
        (else the ranks agreed already, and the residual is updated in place)."""
        method = self.method
        if not early:
            acc = self.residuals.for_update(grad)
            with self.timer("select"):
                picked = method.accumulate(acc, grad, acc, layout)
            first = method.first_message(acc, picked)
            return Accumulated(acc, picked, None if first is None else first.send())
        kept = [(part, part.state_dict()) for part in method.moved_by_accumulate()]
        try:
            acc = self.residuals.spare_for(grad)
            nonfinite = 0
            try:
                with self.timer("select"):
                    picked = method.accumulate(self.residuals.peek(grad), grad, acc, layout)
            except NonFiniteInputError:  # the scan's sum is not finite: count (the rare path)
                picked, nonfinite = None, max(1, count_nonfinite(grad))
            first = None if nonfinite else method.first_message(acc, picked)
            replies = self._agree(grad, layout, nonfinite, first)
        except BaseException:
            for part, state in kept:  # a refused or skipped call leaves the method as it was
                part.load_state_dict(state)
            raise
        self.residuals.commit(acc)
        if first is not None and replies is _NOT_CARRIED:
            replies = first.send()
        return Accumulated(acc, picked, None if replies is _NOT_CARRIED else replies)

    def _agree(self, grad: torch.Tensor, layout: Any, nonfinite: int, first: FirstMessage | None) -> Any:
        """The call's agreement after the method's local work, carrying its first message where the
        backend allows. Returns what the message brought, or :data:`_NOT_CARRIED`; raises the
        agreement's error, or :class:`_Skipped`."""
        method, names = self.method, self.method_names()
        mark, start = method.comm.meter.snapshot(), time.perf_counter()
        self.entered = True  # from here on, every rank learns of a failure in the agreement
        carried = self._carrier(first)
        steps: list[BlockStep]
        if carried is None:
            skip = check_call(method, grad, layout, names, nonfinite=nonfinite)
            received, steps = None, []
        else:  # the agreement's messages are the method's first message: timed as its comm
            with self.timer("comm"):
                skip, received, steps = check_call_carrying(
                    method, grad, layout, names, nonfinite=nonfinite, block=carried.parts,
                    next_message=carried.next_message if isinstance(carried, Exchanges) else None)
        self.agreement = (0.0 if carried is not None and skip is None else time.perf_counter() - start,
                          method.comm.meter.since(mark))
        if skip is not None:
            raise _Skipped(skip)
        self.agreed = True
        if carried is None:
            return _NOT_CARRIED
        method.stats.extra["gathered_in_agreement" if isinstance(carried, AllGather) else "rode_agreement"] = 1
        self._book_carried(steps)
        assert received is not None  # the verdict lets a call go on only when every rank sent its message
        return carried.unpack(received)

    def _carrier(self, first: FirstMessage | None) -> AllGather | Exchanges | None:
        """``first`` when the agreement's messages can carry it on this communicator, else ``None``."""
        comm = self.method.comm
        if isinstance(first, AllGather) and control.carries_blocks(comm):
            return first
        if isinstance(first, Exchanges) and first.peers and control.carries_messages(comm, first.peers):
            return first
        return None

    def _book_carried(self, steps: list[BlockStep]) -> None:
        """Book the payload the agreement carried as the method's traffic: one round and one message
        each way per step, as if it had been sent on its own."""
        comm = self.method.comm
        for step in steps:
            comm.meter.record_round()
            comm.meter.record_send(step.sent, inter_node=comm.is_inter_node(step.dst))
            comm.meter.record_recv(step.recv, inter_node=comm.is_inter_node(step.src))

    # ------------------------------------------------------------------ results other than reduce's
    def _skipped(self, grad: torch.Tensor, out: torch.Tensor | None, figures: dict[str, Any], agreement_s: float,
                 start: float) -> torch.Tensor:
        """The result of a call the ranks agreed to skip (a non-finite gradient under ``"skip"`` or
        ``"propagate"``): nothing sent, residual, step and every other state unchanged."""
        method = self.method
        method.stats = stats = Stats(n=grad.numel(), selected=0 if method.sparse else grad.numel(), skipped=1)
        if method.tracks_sent:  # nothing sent: DGC masks nothing
            method.last_sent = torch.empty(0, dtype=torch.int64, device=grad.device)
        stats.extra.update(figures)
        stats.extra["time_agreement"] = agreement_s
        stats.time_total = time.perf_counter() - start
        if method.nonfinite == "propagate":  # as plain DDP's sum would: GradScaler sees it and skips
            return torch.full_like(grad, float("nan")) if out is None else out.fill_(float("nan"))
        return torch.zeros_like(grad) if out is None else out.zero_()

    def _empty(self, grad: torch.Tensor, out: torch.Tensor | None, start: float) -> torch.Tensor:
        method = self.method
        if method.tracks_sent:
            method.last_sent = torch.empty(0, dtype=torch.int64, device=grad.device)
        method.step += 1
        method.stats.time_total = time.perf_counter() - start
        return grad.new_zeros(0) if out is None else out

    def _book(self, result: torch.Tensor, mark: Any, agreement_s: float, start: float) -> None:
        """Fill the call's stats: traffic since ``mark`` less an agreement made inside the call, the
        output's non-zeros, the phases' seconds."""
        method = self.method
        stats, n = method.stats, result.numel()
        traffic = method.comm.meter.since(mark)
        if self.agreement is not None:  # made after the method's local work: booked apart, as when made first
            traffic = traffic.minus(self.agreement[1])
        if not method.sparse:
            stats.nnz_out = n  # a dense method sends and returns every element
        elif not stats.nnz_out:
            stats.nnz_out = int(torch.count_nonzero(result))
        if not stats.modelled_bytes:
            stats.bytes_sent, stats.bytes_recv = traffic.bytes_sent, traffic.bytes_recv
            stats.inter_node_bytes_sent = traffic.inter_node_bytes_sent
            stats.inter_node_bytes_recv = traffic.inter_node_bytes_recv
        stats.header_bytes = traffic.header_bytes_sent
        stats.rounds = traffic.rounds
        stats.time_total = time.perf_counter() - start
        stats.extra["time_agreement"] = agreement_s if self.agreement is None else self.agreement[0]
        for phase in PHASES:
            setattr(stats, f"time_{phase}", self.times.get(phase, 0.0))
        for phase, seconds in self.times.items():
            if phase not in PHASES:
                stats.extra[f"time_{phase}"] = seconds

    # ------------------------------------------------------------------ failures
    def _failure(self, exc: Exception) -> Exception:
        """What a failed call raises: a collective timeout becomes a :class:`RankStalledError` naming
        the ranks that did not take part; any failure after the agreement is posted for the other
        ranks (who are then left waiting) and the method refuses further calls."""
        if is_peer_failure(exc):
            self.broken = "a collective timed out or lost a peer"
            return explain_timeout(exc, self.method.comm.ranks)
        if self.agreed:
            self.broken = f"{type(exc).__name__}: {exc}"
            report_failure(self.broken)
        return exc

    def _tell_others(self, grad: torch.Tensor, layout: Any, exc: Exception) -> None:
        """A local failure before an agreement that comes after the method's local work: the agreement
        the other ranks are waiting in tells them, and every rank raises (this one from ``exc``)."""
        try:
            check_call(self.method, grad, layout, self.method_names(), failure=f"{type(exc).__name__}: {exc}")
        except Exception as told:  # noqa: BLE001 - the agreement's error, raised the same on every rank
            raise told from exc


_NOT_CARRIED = object()  # the agreement did not carry the first message: the method sends it


def _check_out(out: Any, grad: Any, name: str) -> None:
    """``out=`` must be a tensor like ``grad`` (shape, dtype, device) that does not overlap it."""
    if not isinstance(out, torch.Tensor) or not isinstance(grad, torch.Tensor):
        raise TypeError(f"{name}: out= must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device:
        raise ValueError(f"{name}: out= must match grad (shape {tuple(grad.shape)}, {grad.dtype}, {grad.device}), "
                         f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}")
    if out.numel() and out.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        raise ValueError(f"{name}: out= must not share memory with grad (the method reads grad while it writes out)")
