"""The method interface: a flat local gradient in, the averaged global gradient out.

A method (a *reducer*) is built inside a worker with :func:`sparsecomm.make_method`. Calling it on
this rank's flat gradient bucket returns the average over ranks of what the method communicates,
identical on every rank, and leaves in :attr:`Method.stats` what the call cost and selected.
Methods with error feedback keep what they did not send in :attr:`Method.residual`.

Subclasses implement :meth:`Method.reduce`; the base class validates input collectively (so bad
input raises on every rank instead of hanging one), times phases and reads the traffic meter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch

from ..core.buffers import long_lived_empty, long_lived_zeros
from ..core.registry import Registry
from ..core.validate import check_fraction
from ..selection import NonFiniteInputError
from ..selection.base import Selector
from ..selection.scan import Scratch
from ..transport.comm import BlockStep, Communicator
from ..transport.deadline import ProtocolBroken, explain_timeout, is_peer_failure, report_failure
from ..transport.merge import GroupMask, Stale, average_blocks_into, average_into, clear
from .agreement import (
    NONFINITE_POLICIES,
    AgreementError,
    NonFiniteGradientError,
    check_call,
    check_call_gathering,
    count_nonfinite,
    local_problem,
)
from .stats import PHASES, Stats

__all__ = ["Method", "Layout", "METHODS", "register_method", "selection_count", "check_density", "AgreementError",
           "NonFiniteGradientError", "NONFINITE_POLICIES"]

Layout = Sequence[tuple[int, int]] | None
"""Optional (offset, numel) of each layer packed in the flat gradient, in order."""


class PhaseTimer:
    """``with method.timer(phase):``: adds the block's wall time to ``times[phase]``. Nested blocks are
    exclusive: while an inner block runs (SparDL's selections inside the agreement whose messages
    carry them, timed as the comm), the outer one's clock stops, so every second is booked once.
    A plain class, not a ``contextlib.contextmanager`` generator: a call enters a dozen of them, and
    at n = 1M with four workers on two cores every microsecond of a rank's CPU between messages
    delays its peers."""

    __slots__ = ("times", "phase", "start", "running")

    def __init__(self, times: dict[str, float], phase: str, running: list[PhaseTimer]) -> None:
        self.times, self.phase, self.running = times, phase, running

    def __enter__(self) -> None:
        now = time.perf_counter()
        if self.running:
            self.running[-1].stop(now)
        self.running.append(self)
        self.start = now

    def __exit__(self, *exc: object) -> None:
        now = time.perf_counter()
        self.running.pop()
        self.stop(now)
        if self.running:
            self.running[-1].start = now

    def stop(self, now: float) -> None:
        """Book the time since the block (re)started."""
        self.times[self.phase] = self.times.get(self.phase, 0.0) + now - self.start


class Method:
    """Base class of every synchronization method.

    Args:
        comm: the communicator to use; ``None`` builds one over the default process group.
        density: for sparse methods, the fraction of elements each rank selects,
            ``k = ceil(density * n)``; must lie in (0, 1]. Dense methods take none.
    """

    name: str = "method"
    #: True when the method keeps an error-feedback residual of length n.
    has_residual: bool = False
    #: True when the method takes ``density``.
    sparse: bool = False
    #: True when every call sets :attr:`last_sent` (needed by DGC momentum masking).
    tracks_sent: bool = False
    #: For methods whose result is an estimate (a sketch): options under which it is exact, so that
    #: density 1 with them returns the dense average (DESIGN invariant 3). Empty for exact methods.
    exact_options: dict[str, Any] = {}
    #: True when :meth:`reduce` makes the call's agreement itself on CPU tensors (:meth:`agree`,
    #: through :meth:`accumulate_and_agree`), after its local work on the gradient and before its
    #: first message, so that the agreement's non-finite count comes from that work (the selection's
    #: scan) instead of a pass of its own. Such a method changes no state before :meth:`agree`
    #: returns: it accumulates into :meth:`spare_residual` (one more gradient-sized buffer) and
    #: adopts it with :meth:`commit_residual` once the ranks agreed. On other devices, where memory
    #: is scarcer and a pass cheaper, and for every other method, the base class agrees before
    #: :meth:`reduce` is called (and :meth:`accumulate_and_agree` adds in place).
    agrees_in_reduce: bool = False

    def __init__(self, comm: Communicator | None = None, *, density: float | None = None) -> None:
        self.comm = comm if comm is not None else Communicator()
        self._density = check_density(self.name, self.sparse, density)
        self.residual: torch.Tensor | None = None
        #: local int64 indices whose accumulated value this rank sent in the last call (None when
        #: the method does not track them); DGC momentum masking uses it.
        self.last_sent: torch.Tensor | None = None
        self.step = 0
        self.stats = Stats()
        #: the options ``make_method`` built this method with (checked equal on every rank per call)
        self.options: dict[str, Any] = {}
        self._nonfinite = "error"
        self._times: dict[str, float] = {}
        self._running_timers: list[PhaseTimer] = []  # the timers entered and not left, innermost last
        self._call_out: torch.Tensor | None = None   # this call's out= tensor (None: a fresh result)
        #: without out=: the fresh result, allocated as the call begins (see :meth:`_fresh_output`)
        self._fresh_out: torch.Tensor | None = None
        #: where this method last wrote its ``out=`` tensor (None: unknown, zero it all)
        self._out_support: torch.Tensor | GroupMask | None = None
        self._out_mark: tuple[int, int] | None = None
        #: the second residual buffer of a method that agrees in reduce (see :meth:`spare_residual`)
        self._spare: torch.Tensor | None = None
        #: (seconds, traffic) of this call's agreement when reduce made it (:meth:`agree`)
        self._agreement: tuple[float, Any] | None = None
        self._agreement_entered = False
        self._scratch = Scratch()  # the fused scan's buffers (accumulate_and_agree)
        #: why an earlier call failed after the ranks agreed (the ranks are out of step), or None
        self._broken: str | None = None

    # ------------------------------------------------------------------ density
    @property
    def density(self) -> float | None:
        """The fraction of elements each rank selects (``None`` for a dense method)."""
        return self._density

    @density.setter
    def density(self, density: float) -> None:
        self.set_density(density)

    def set_density(self, density: float) -> None:
        """Select ``ceil(density * n)`` elements from the next call on (e.g. DGC's density warm-up,
        :func:`sparsecomm.integration.dgc.density_schedule`); same rule as at construction. Every
        rank must set the same density before the same call (the call's agreement checks it)."""
        self._density = check_density(self.name, self.sparse, density)

    # ------------------------------------------------------------------ to implement
    def reduce(self, grad: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Return the average over ranks of the communicated gradient (subclasses implement)."""
        raise NotImplementedError

    def extra_state(self) -> dict[str, Any]:
        """Method-specific state to checkpoint besides residual and step."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"method {self.name!r} has no extra state, got keys {sorted(state)}")

    @classmethod
    def topk_blocks(cls, P: int, n: int, scan: bool = True, **options: Any) -> list[int]:
        """The sizes of the blocks one rank selects from by a top-k of its own, per call, besides the
        selection its accumulation's scan makes (``scan``: the compiled CPU kernel selects while it
        accumulates). The simulator costs how their number and sizes change with P
        (:func:`~sparsecomm.simulator.model.block_topk_seconds`). Empty for a method whose selection
        is one pass over the gradient at any P (the default)."""
        return []

    # ------------------------------------------------------------------ helpers for subclasses
    def k(self, n: int) -> int:
        """Number of elements to select out of n: ceil(density * n), at least 1 when n > 0."""
        assert self.density is not None
        return selection_count(self.density, n)

    def timer(self, phase: str) -> PhaseTimer:
        """Add the wall time of the ``with`` block to ``stats.time_<phase>``."""
        return PhaseTimer(self._times, phase, self._running_timers)

    def residual_for(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's residual, created as zeros like ``grad`` on first use (or when n changes)."""
        if not _fits(self.residual, grad):
            self.residual = long_lived_zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        assert self.residual is not None
        return self.residual

    def residual_like(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's residual when it fits ``grad`` (shape, dtype, device), else zeros like ``grad``
        that are not kept: what a method reads before the agreement, changing no state (unlike
        :meth:`residual_for`, which replaces a residual that does not fit)."""
        return self.residual if _fits(self.residual, grad) else torch.zeros_like(grad)

    def spare_residual(self, grad: torch.Tensor) -> torch.Tensor:
        """A second buffer like ``grad`` (reused across calls) for a method that agrees in
        :meth:`reduce`: it writes ``acc = residual + grad`` there, in the selection's scan, so the
        residual is still intact when the ranks decide to skip the step or raise; once they agreed,
        :meth:`commit_residual` makes it the residual. Error feedback then keeps two length-n buffers
        instead of one (docs/memory.md)."""
        spare = self._spare
        if not _fits(spare, grad) \
                or (self.residual is not None and spare.data_ptr() == self.residual.data_ptr()):
            self._spare = spare = long_lived_empty(grad.shape, dtype=grad.dtype, device=grad.device)
        return spare

    def accumulate_and_agree(self, grad: torch.Tensor, layout: Layout,
                             select: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Error feedback's ``acc = residual + grad`` and the call's agreement, for a method that
        agrees in :meth:`reduce` (:attr:`agrees_in_reduce`), before its first message.

        ``acc`` is written to :meth:`spare_residual` in one pass that also tells whether ``grad`` is
        finite: ``select(residual, grad, acc)`` (a selector's fused scan, e.g.
        ``selector.accumulate(residual, grad, k, dest=acc)``, which raises
        :class:`~sparsecomm.selection.NonFiniteInputError` on a non-finite sum), or without
        ``select`` the fused scan alone (:meth:`~sparsecomm.selection.scan.Scratch.scan` with no
        candidates; elsewhere than on the CPU kernel an addition and a count). Then :meth:`agree`
        with that verdict (nothing is sent before; a skipped step returns through it with the
        residual untouched), then ``acc`` becomes the residual (:meth:`commit_residual`).
        Returns (``acc``, ``select``'s result or ``None``).

        When the base class agreed before :meth:`reduce` (a method called on a CUDA tensor), the
        addition is made in place instead (``select(residual, grad, residual)``) and nothing is agreed
        here: the residual and the output are then the only gradient-sized buffers."""
        selected: torch.Tensor | None = None
        if self._agreed:
            residual = self.residual_for(grad)
            with self.timer("select" if select is not None else "residual"):
                if select is not None:
                    selected = select(residual, grad, residual)
                else:
                    residual.add_(grad)
            return residual, selected
        acc, selected, nonfinite = self.accumulate_to_spare(grad, select)
        self.agree(grad, layout, nonfinite)
        self.commit_residual(acc)
        return acc, selected

    def accumulate_to_spare(self, grad: torch.Tensor,
                            select: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The local half of :meth:`accumulate_and_agree`: ``acc = residual + grad`` written to
        :meth:`spare_residual` by ``select``'s fused scan (or the scan alone), the residual untouched.
        Returns (``acc``, ``select``'s result, or ``None`` when the gradient is not finite, the
        gradient's NaN/Inf count). The caller agrees next and then :meth:`commit_residual`."""
        residual = self.residual_like(grad)  # not replaced before the agreement: a refused call keeps it
        acc = self.spare_residual(grad)
        selected: torch.Tensor | None = None
        nonfinite = 0
        with self.timer("select" if select is not None else "residual"):
            try:
                if select is not None:
                    selected = select(residual, grad, acc)
                elif self._scratch.uses_compiled(residual, grad, acc):
                    self._scratch.scan(residual, math.inf, name=self.name, check_finite=True, addend=grad, dest=acc)
                else:
                    torch.add(residual, grad, out=acc)
                    nonfinite = count_nonfinite(grad)
            except NonFiniteInputError:  # the scan's sum of |acc| is not finite: count (the rare path)
                nonfinite = max(1, count_nonfinite(grad))
        return acc, selected, nonfinite

    def accumulate_select_and_agree(self, grad: torch.Tensor, layout: Layout, selector: Selector,
                                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`accumulate_and_agree` with ``selector``'s fused scan picking ``k`` entries
        (:meth:`~sparsecomm.selection.base.Selector.accumulate`): returns (``acc``, the selected indices)."""
        acc, selected = self.accumulate_and_agree(
            grad, layout, lambda residual, g, dest: selector.accumulate(residual, g, k, dest=dest))
        assert selected is not None
        return acc, selected

    def commit_residual(self, acc: torch.Tensor) -> None:
        """Make ``acc`` (the :meth:`spare_residual` buffer) the residual; the old residual becomes
        the next call's spare buffer."""
        self.residual, self._spare = acc, self.residual

    def agree(self, grad: torch.Tensor, layout: Layout, nonfinite: int, *, gathers: bool = False,
              block: Sequence[torch.Tensor] | None = None,
              ride: Callable[[int, list[torch.Tensor]], Sequence[torch.Tensor]] | None = None
              ) -> tuple[list[torch.Tensor] | None, list[BlockStep]]:
        """The call's agreement (:func:`.agreement.check_call`), made by a method whose
        :attr:`agrees_in_reduce` is set, once per call, after its local work on ``grad`` and before
        it sends anything; ``nonfinite``: the NaN/Inf elements that work found in ``grad`` (0 when
        none; any positive number when there are some). Raises the agreement's error on every rank;
        a step skipped by the non-finite policy leaves :meth:`reduce` by an internal exception that
        :meth:`__call__` turns into the policy's result. Its header bytes and rounds are not the
        method's traffic (they are booked apart, as when the base class agrees first).

        ``gathers``: the method sends its first message, an all-gather of ``block`` (this rank's
        payload, ``None`` when it has none, e.g. a non-finite gradient), inside the agreement's own
        messages (only where ``self.comm.gathers_in_agreement``; see
        :func:`.agreement.check_call_gathering`). Returns every rank's block (``uint8``, rank order)
        and the payload moved per step, which the method books as its own traffic
        (:meth:`book_gathered`); ``(None, [])`` without ``gathers``. Such a call's
        ``stats.extra["gathered_in_agreement"]`` is 1 and its ``time_agreement`` 0 (its time is
        ``time_comm``). With ``ride`` as well, the method's messages follow the agreement's schedule
        and go in its steps, ``block`` first (:meth:`ride_in_agreement`; the call's
        ``stats.extra["rode_agreement"]`` is 1 instead)."""
        if self._agreement is not None:
            raise RuntimeError(f"{self.name}: agree() called twice in one call (a method bug)")
        mark, start = self.comm.meter.snapshot(), time.perf_counter()
        self._agreement_entered = True  # from here on, every rank learns of a failure in the agreement
        skip, gathered, steps = check_call_gathering(self, grad, layout, METHODS.names(), nonfinite=nonfinite,
                                                     gathers=gathers, block=block, ride=ride)
        # an agreement that carried the method's all-gather is the method's communication: its time is
        # the method's (time_comm), not an agreement's of its own
        elapsed = 0.0 if gathers and skip is None else time.perf_counter() - start
        self._agreement = (elapsed, self.comm.meter.since(mark))
        if skip is not None:
            raise _SkippedCall(skip)
        self._agreed = True
        if gathers:
            self.stats.extra["rode_agreement" if ride is not None else "gathered_in_agreement"] = 1
        return gathered, steps

    def gather_in_agreement(self, grad: torch.Tensor, layout: Layout, nonfinite: int, acc: torch.Tensor,
                            block: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """The call's agreement carrying its all-gather of ``block`` (:meth:`agree` with ``gathers``,
        timed as the comm), after which ``acc`` (:meth:`accumulate_to_spare`'s) becomes the residual
        and the payload is booked as this method's traffic (:meth:`book_gathered`). Returns every
        rank's block (``uint8``, rank order); raises or skips the call as :meth:`agree` does."""
        with self.timer("comm"):
            blocks, steps = self.agree(grad, layout, nonfinite, gathers=True, block=block)
        assert blocks is not None  # the verdict lets a call go on only when every rank sent its block
        self.commit_residual(acc)
        self.book_gathered(steps)
        return blocks

    def ride_in_agreement(self, grad: torch.Tensor, layout: Layout, nonfinite: int, acc: torch.Tensor,
                          payload: Sequence[torch.Tensor] | None,
                          produce: Callable[[int, list[torch.Tensor]], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The call's agreement carrying the method's messages, whose schedule is the agreement's (P a
        power of two, where ``self.comm.rides_in_agreement``: step D = P/2, ..., 1 sends to rank
        r + D and receives from r - D): ``payload`` in the first step, then ``produce(step, received)``'s,
        called only on messages from ranks that agree so far (:meth:`agree` with ``gathers`` and
        ``ride``). Afterwards ``acc`` becomes the residual and each step is booked as this method's
        message (one round each). Returns the last step's received tensors (``uint8`` views, valid
        until the communicator's next agreement or ``prepost_agreement``); raises or skips the call
        as :meth:`agree` does. Not timed here: the caller times the steps as its messages."""
        received, steps = self.agree(grad, layout, nonfinite, gathers=True, block=payload, ride=produce)
        assert received is not None  # the verdict lets a call go on only when every rank sent its messages
        self.commit_residual(acc)
        self.book_gathered(steps)
        return received

    def book_gathered(self, steps: Sequence[BlockStep]) -> None:
        """Book the payload an all-gather inside the agreement moved (:meth:`agree` with ``gathers``)
        as this method's traffic: one round and one message each way per step, as if it had been sent
        on its own."""
        meter = self.comm.meter
        for step in steps:
            meter.record_round()
            meter.record_send(step.sent, inter_node=self.comm.is_inter_node(step.dst))
            meter.record_recv(step.recv, inter_node=self.comm.is_inter_node(step.src))

    # ------------------------------------------------------------------ the output tensor
    def output_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The zero tensor shaped like ``like`` that this call decompresses into and returns.

        Without ``out=`` it is a fresh tensor the caller owns. With ``method(grad, out=buf)`` it is
        ``buf``, zeroed: in full, or, when ``buf`` is the tensor this method filled on its previous
        call and nobody wrote into it since (same storage, same ``_version``), only where that call
        wrote (see :meth:`output_written`), so a sparse call costs O(k) here instead of a length-n
        write. That is the zero-allocation path of the DDP hook and the synchronizer. Methods that
        decompress received chunks use :meth:`output_average` instead, which zeroes and writes in one
        sweep.
        """
        out = self._call_out
        if out is None:
            return self._fresh_output(like).zero_()
        clear(out, self._stale(out))
        self._out_support = None  # until the method says where it wrote: a full zero next time
        return out

    def output_average(self, like: torch.Tensor, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                       divisor: int, *, keep_sign: bool = False) -> torch.Tensor:
        """This call's output tensor (as :meth:`output_buffer`'s) made the average of the chunks
        (``indices[c]``, ``values[c]``; each chunk's indices sorted for the C path) and zero elsewhere:
        :func:`~sparsecomm.transport.merge.average_into`, which zeroes the entries of the previous call
        and writes this one's in one ordered sweep, divided by ``divisor`` on the way (``keep_sign``: each
        entry's sum starts from its first value, as an assignment ``out[i] = v / divisor`` does, instead
        of from ``+0.0``). Records where it wrote for the next call and, where the merge counted them,
        ``stats.nnz_out``."""
        return self._write_output(like, lambda out, stale: average_into(out, indices, values, divisor, stale=stale,
                                                                         keep_sign=keep_sign))

    def output_average_blocks(self, like: torch.Tensor, blocks: torch.Tensor, block_size: int, values: torch.Tensor,
                              divisor: int, *, keep_sign: bool = False) -> torch.Tensor:
        """:meth:`output_average` for a result made of whole blocks (OmniReduce, S2 Reducer): element
        ``blocks[b] * block_size + j`` (below n) becomes ``values[b, j] / divisor``, every other element
        zero (``blocks``: increasing ids; ``values``: ``len(blocks) * block_size`` values). Written by
        :func:`~sparsecomm.transport.merge.average_blocks_into`, which touches only those blocks and the
        last call's groups, never building the index of every element; the same bits, records and
        ``stats.nnz_out`` as :meth:`output_average` given those indices."""
        return self._write_output(like, lambda out, stale: average_blocks_into(
            out, blocks, block_size, values, divisor, stale=stale, keep_sign=keep_sign))

    def _write_output(self, like: torch.Tensor,
                      write: Callable[[torch.Tensor, Stale], tuple[torch.Tensor | GroupMask, int | None]]
                      ) -> torch.Tensor:
        """This call's output tensor (the caller's ``out=``, else a fresh one) written by
        ``write(out, stale)``, which zeroes ``stale`` (where ``out`` may be non-zero) and returns (where
        it wrote, the non-zero results or ``None``); records both for the next call and the stats."""
        out = self._call_out
        stale: Stale = "all"
        if out is None:
            out = self._fresh_output(like)
        else:
            stale = self._stale(out)
        self._out_support = None  # until the write succeeds
        written, nonzero = write(out, stale)
        if self._call_out is not None:
            self._out_support = written
        if nonzero is not None:  # else the base class counts the non-zeros of the result
            self.stats.nnz_out = nonzero
        return out

    def _fresh_output(self, like: torch.Tensor) -> torch.Tensor:
        """A new tensor shaped like ``like`` for the caller to own (contents undefined): the one
        :meth:`__call__` allocated as the call began, where it matches, else a new one. Allocated
        before the call's temporaries, a large output tends to get the pages the allocator still
        holds from the caller's last result; allocated after them, fresh pages that fault on the
        first write (docs/memory.md, "Output into out=")."""
        fresh, self._fresh_out = self._fresh_out, None
        if fresh is None or fresh.shape != like.shape or fresh.dtype != like.dtype or fresh.device != like.device:
            return torch.empty_like(like)
        return fresh

    def _stale(self, out: torch.Tensor) -> Stale:
        """Where ``out`` (this call's ``out=`` tensor) may be non-zero: where this method's previous call
        wrote, if ``out`` is that call's result untouched since, else anywhere."""
        if self._out_support is not None and self._out_mark == (out.data_ptr(), out._version):
            return self._out_support
        return "all"

    def output_copy(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` copied into this call's output tensor (for dense methods that reduce in place)."""
        out = self._call_out
        if out is None:
            return grad.clone()
        self._out_support = None
        return out.copy_(grad)

    def output_written(self, indices: torch.Tensor | None) -> None:
        """Record the entries written into :meth:`output_buffer`'s tensor (int64 indices; repeats are
        fine); ``None`` means anywhere, and the next call zeroes the whole ``out=`` tensor."""
        self._out_support = None if indices is None or self._call_out is None else indices.to(torch.int64)

    # ------------------------------------------------------------------ the call
    def __call__(self, grad: torch.Tensor, layout: Layout = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Average ``grad`` (this rank's 1-D float gradient) over all ranks with this method.

        Returns a new tensor the caller owns; with ``out=buf`` (torch's convention) the result is
        written into ``buf`` (same shape, dtype and device as ``grad``, not overlapping it) and ``buf``
        is returned, without allocating a length-n tensor.

        Every call first agrees with the other ranks on what they are about to do
        (:meth:`_validate`); on a disagreement or a non-finite input every rank raises the same
        error (or, with ``nonfinite="skip"``, skips the step) before anything is sent, with the
        residual, the step and every other state unchanged, so the call can be retried.
        """
        if out is not None:
            _check_out(out, grad, self.name)
        if self._broken is not None:
            raise ProtocolBroken(f"{self.name}: an earlier call failed after the ranks agreed to communicate "
                                 f"({self._broken}); the ranks are out of step and this method cannot be "
                                 "called again: restart the job (e.g. from its last checkpoint)")
        try:
            return self._call(grad, layout, out)
        except Exception as exc:
            error = self._deadline_error(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self._agreed = False

    def _deadline_error(self, exc: Exception) -> Exception:
        """What a failed call raises: a collective timeout becomes a :class:`RankStalledError` naming
        the ranks that did not take part; any failure after the agreement is posted for the other
        ranks (who are then left waiting) and the method refuses further calls."""
        if is_peer_failure(exc):
            self._broken = "a collective timed out or lost a peer"
            return explain_timeout(exc, self.comm.ranks)
        if self._agreed:
            self._broken = f"{type(exc).__name__}: {exc}"
            report_failure(self._broken)
        return exc

    _agreed = False  # set while a call runs past its agreement

    def _call(self, grad: torch.Tensor, layout: Layout, out: torch.Tensor | None) -> torch.Tensor:
        start = time.perf_counter()
        self._agreed = False
        self._agreement = None
        self._agreement_entered = False
        # a method that agrees in reduce does so after its local work, on input that passed the local
        # checks; anything else (or a local problem, which the agreement tells every rank) agrees first
        deferred = (self.agrees_in_reduce and isinstance(grad, torch.Tensor) and grad.device.type == "cpu"
                    and grad.numel() > 0 and local_problem(grad, layout, self.name, self.residual) is None)
        if deferred:  # its agreement comes after the local work: let the peers' messages find their receives
            self.comm.prepost_agreement()
        skip = None if deferred else self._validate(grad, layout)
        self._agreed = skip is None and not deferred
        agreed = time.perf_counter()
        self._times = {}
        n = grad.numel()
        self.stats = Stats(n=n, selected=0 if self.sparse else n)
        if skip is not None:
            return self._skipped(grad, out, skip, agreed - start, start)
        if n == 0:  # nothing to reduce: the average of empty gradients is empty, on every method
            if self.tracks_sent:
                self.last_sent = torch.empty(0, dtype=torch.int64, device=grad.device)
            self.step += 1
            self.stats.time_total = time.perf_counter() - start
            return grad.new_zeros(0) if out is None else out
        mark = self.comm.meter.snapshot()
        self._call_out = out
        # a sparse method's new result is allocated now, before the call's temporaries (_fresh_output)
        self._fresh_out = torch.empty_like(grad) if out is None and self.sparse else None
        try:
            with self.comm.meter.phase(self.name):
                result = self.reduce(grad, layout)
        except _SkippedCall as skipped:
            assert self._agreement is not None
            return self._skipped(grad, out, skipped.figures, self._agreement[0], start)
        except Exception as exc:
            if deferred and not self._agreement_entered and not is_peer_failure(exc):
                self._tell_others(grad, layout, exc)  # the other ranks wait in the agreement
            raise
        finally:
            self._call_out = self._fresh_out = None
        if deferred and self._agreement is None:
            raise RuntimeError(f"{self.name}: reduce() returned without calling agree() (a method bug)")
        if out is None:
            if result.data_ptr() == grad.data_ptr():  # a method that reduced in place: not the caller's
                result = result.clone()
        elif result is not out:  # a method that does not decompress into output_buffer()
            out.copy_(result)
            self._out_support = None
            result = out
        self._out_mark = None if out is None else (out.data_ptr(), out._version)
        traffic = self.comm.meter.since(mark)
        if self._agreement is not None:  # made inside reduce: booked apart, as when made first
            traffic = traffic.minus(self._agreement[1])
        stats = self.stats
        if not self.sparse:
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
        stats.extra["time_agreement"] = agreed - start if self._agreement is None else self._agreement[0]
        for phase in PHASES:
            setattr(stats, f"time_{phase}", self._times.get(phase, 0.0))
        for phase, seconds in self._times.items():
            if phase not in PHASES:
                stats.extra[f"time_{phase}"] = seconds
        self.step += 1
        return result

    def _skipped(self, grad: torch.Tensor, out: torch.Tensor | None, skip: dict[str, Any], agreement_s: float,
                 start: float) -> torch.Tensor:
        """The result of a call the ranks agreed to skip (a non-finite gradient under ``"skip"`` or
        ``"propagate"``): nothing sent, residual, step and every other state unchanged."""
        self.stats = Stats(n=grad.numel(), selected=0 if self.sparse else grad.numel())
        if self.tracks_sent:  # nothing sent: DGC masks nothing
            self.last_sent = torch.empty(0, dtype=torch.int64, device=grad.device)
        self.stats.skipped = 1
        self.stats.extra.update(skip)
        self.stats.extra["time_agreement"] = agreement_s
        self.stats.time_total = time.perf_counter() - start
        if self.nonfinite == "propagate":  # as plain DDP's sum would: GradScaler sees it and skips
            return torch.full_like(grad, float("nan")) if out is None else out.fill_(float("nan"))
        return torch.zeros_like(grad) if out is None else out.zero_()

    def _tell_others(self, grad: torch.Tensor, layout: Layout, exc: Exception) -> None:
        """A local failure before the agreement of a method that agrees in reduce: the agreement
        the other ranks are waiting in tells them, and every rank raises (this one from ``exc``)."""
        try:
            check_call(self, grad, layout, METHODS.names(), failure=f"{type(exc).__name__}: {exc}")
        except Exception as told:  # noqa: BLE001 - the agreement's error, raised the same on every rank
            raise told from exc

    def _validate(self, grad: Any, layout: Layout) -> dict[str, Any] | None:
        """Check ``grad`` locally, then agree with every rank on the call (:func:`.agreement.check_call`:
        one header all-reduce). Raises the same error on every rank when a rank's input is unusable,
        the ranks disagree, or (policy ``"error"``) a rank's gradient holds NaN/Inf. Returns ``None``
        to go on, or the figures of a step skipped for non-finite input."""
        return check_call(self, grad, layout, METHODS.names())

    @property
    def nonfinite(self) -> str:
        """What a call does when a rank's gradient holds NaN/Inf: ``"error"`` (default) raises on
        every rank, ``"skip"`` skips the step on every rank (returns zeros, ``stats.skipped = 1``),
        ``"propagate"`` returns NaN everywhere on every rank without communicating
        (``stats.skipped = 1``), as plain DDP's all-reduce passes an overflow on, so that
        ``torch.amp.GradScaler`` skips the optimizer step and lowers its scale (the DDP hook's
        default). In every case residual, step and every other state stay unchanged."""
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: str) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={policy!r} must be one of {NONFINITE_POLICIES}")
        self._nonfinite = policy

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Residual, step and method-specific state; enough to resume without losing a residual."""
        return {"name": self.name, "step": self.step,
                "residual": None if self.residual is None else self.residual.clone(),
                "extra": self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state_dict of method {state.get('name')!r} cannot load into {self.name!r}")
        self.step = int(state["step"])
        self.residual = None if state["residual"] is None else state["residual"].clone()
        self.load_extra_state(state.get("extra", {}))

    def __repr__(self) -> str:
        dens = "" if self.density is None else f", density={self.density:g}"
        return f"{type(self).__name__}(P={self.comm.size}{dens})"


def _fits(buffer: torch.Tensor | None, like: torch.Tensor) -> TypeGuard[torch.Tensor]:
    """Whether ``buffer`` can stand for a tensor like ``like``: same shape, dtype and device."""
    return buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype \
        and buffer.device == like.device


class _SkippedCall(Exception):
    """Raised by :meth:`Method.agree` inside ``reduce`` when the ranks agreed to skip the step."""

    def __init__(self, figures: dict[str, Any]) -> None:
        super().__init__("step skipped")
        self.figures = figures


def check_density(method: str, sparse: bool, density: Any) -> float | None:
    """The one rule for ``density``: a sparse method needs one in (0, 1], a dense method takes none.
    Returns it as a float (``None`` for a dense method)."""
    if not sparse:
        if density is not None:
            raise ValueError(f"method {method!r} is dense and takes no density (got {density!r})")
        return None
    if density is None:
        raise ValueError(f"method {method!r} needs density= (a fraction in (0, 1])")
    try:
        return check_fraction("density", density)
    except ValueError as exc:
        raise ValueError(f"method {method!r}: {exc}") from None


def _check_out(out: Any, grad: Any, name: str) -> None:
    """``out=`` must be a tensor like ``grad`` (shape, dtype, device) that does not overlap it."""
    if not isinstance(out, torch.Tensor) or not isinstance(grad, torch.Tensor):
        raise TypeError(f"{name}: out= must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device:
        raise ValueError(f"{name}: out= must match grad (shape {tuple(grad.shape)}, {grad.dtype}, {grad.device}), "
                         f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}")
    if out.numel() and out.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        raise ValueError(f"{name}: out= must not share memory with grad (the method reads grad while it writes out)")


def selection_count(density: float, n: int) -> int:
    """k for ``density`` over n elements: ceil(density * n), at least 1 when n > 0, at most n."""
    return min(n, max(1 if n else 0, math.ceil(density * n)))


#: Every method class by name (``@register_method("name")`` adds one).
METHODS: Registry[type[Method]] = Registry("method")


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator registering a :class:`Method` subclass under ``name`` (sets ``cls.name``)."""
    return METHODS.register(name)
