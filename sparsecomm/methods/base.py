"""The method interface: a flat local gradient in, the averaged global gradient out.

A method (a *reducer*) is built inside a worker with :func:`sparsecomm.make_method`. Calling it on
this rank's flat gradient bucket returns the average over ranks of what the method communicates,
identical on every rank, and leaves in :attr:`Method.stats` what the call cost and selected.
Methods with error feedback keep what they did not send in :attr:`Method.residual`.

Subclasses implement :meth:`Method.reduce`; the base class validates input collectively (so bad
input raises on every rank instead of hanging one), times phases and reads the traffic meter.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..blocks.selectors import NonFiniteInputError
from ..core.registry import Registry
from ..core.validate import check_fraction
from ..transport.agreement import Agreement, AgreementError, agree
from ..transport.comm import Communicator
from ..transport.deadline import ProtocolBroken, explain_timeout, is_peer_failure, report_failure
from ..transport.disagreement import describe_options, gather_texts, options_text
from .stats import PHASES, Stats

__all__ = ["Method", "Layout", "METHODS", "register_method", "selection_count", "AgreementError",
           "NonFiniteGradientError", "NONFINITE_POLICIES"]

log = logging.getLogger(__name__)

Layout = Sequence[tuple[int, int]] | None
"""Optional (offset, numel) of each layer packed in the flat gradient, in order."""

#: What a call does when a rank's gradient holds NaN/Inf (see :attr:`Method.nonfinite`).
NONFINITE_POLICIES = ("error", "skip", "propagate")


class NonFiniteGradientError(NonFiniteInputError, AgreementError):
    """A rank's gradient holds NaN/Inf: raised on every rank, before anything is sent."""


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

    def __init__(self, comm: Communicator | None = None, *, density: float | None = None) -> None:
        self.comm = comm if comm is not None else Communicator()
        if self.sparse:
            if density is None:
                raise ValueError(f"method {self.name!r} needs density= (a fraction in (0, 1])")
            check_fraction("density", density)
        elif density is not None:
            raise ValueError(f"method {self.name!r} is dense and takes no density (got {density!r})")
        self.density = None if density is None else float(density)
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
        #: why an earlier call failed after the ranks agreed (the ranks are out of step), or None
        self._broken: str | None = None

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

    # ------------------------------------------------------------------ helpers for subclasses
    def k(self, n: int) -> int:
        """Number of elements to select out of n: ceil(density * n), at least 1 when n > 0."""
        assert self.density is not None
        return selection_count(self.density, n)

    @contextlib.contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` block to ``stats.time_<phase>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[phase] = self._times.get(phase, 0.0) + time.perf_counter() - start

    def residual_for(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's residual, created as zeros like ``grad`` on first use (or when n changes)."""
        if self.residual is None or self.residual.shape != grad.shape or self.residual.dtype != grad.dtype \
                or self.residual.device != grad.device:
            self.residual = torch.zeros_like(grad)
        return self.residual

    # ------------------------------------------------------------------ the reused output buffer
    #: Return the method's reused output buffer (valid until the next call) instead of a fresh tensor.
    #: Set it to False on an instance to get a fresh tensor from every call (one more length-n
    #: allocation per call). The DDP hook and the synchronizer copy the result out before the next call.
    reuse_output: bool = True
    _out: torch.Tensor | None = None
    _out_support: torch.Tensor | None = None

    def output_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A zero tensor shaped like ``like`` to decompress into, kept between calls.

        The buffer is allocated once per (n, dtype, device); on later calls only the entries written
        by the previous call (see :meth:`output_written`) are zeroed again, so a sparse call costs
        O(k) here instead of a length-n allocation (page faults) and a full write. The returned tensor
        is the method's output, valid until the next call: callers that keep it must clone it, and
        must not write into it (the next call zeroes only the entries the method wrote). With
        ``reuse_output = False`` a fresh zero tensor is returned instead.
        """
        buf = self._out
        if not self.reuse_output:
            self._out = self._out_support = None
            return torch.zeros_like(like)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            self._out = buf = torch.zeros_like(like)
        elif self._out_support is None:
            buf.zero_()
        else:
            buf.index_fill_(0, self._out_support, 0)
        self._out_support = None  # until the method says where it wrote: a full zero next time
        return buf

    def output_written(self, indices: torch.Tensor | None) -> None:
        """Record the entries written into :meth:`output_buffer`'s tensor (int64 indices; repeats are
        fine); ``None`` means anywhere, and the next call zeroes the whole buffer."""
        self._out_support = None if indices is None or not self.reuse_output else indices.to(torch.int64)

    # ------------------------------------------------------------------ the call
    def __call__(self, grad: torch.Tensor, layout: Layout = None) -> torch.Tensor:
        """Average ``grad`` (this rank's 1-D float gradient) over all ranks with this method.

        Every call first agrees with the other ranks on what they are about to do
        (:meth:`_validate`); on a disagreement or a non-finite input every rank raises the same
        error (or, with ``nonfinite="skip"``, skips the step) before anything is sent, with the
        residual, the step and every other state unchanged, so the call can be retried.
        """
        if self._broken is not None:
            raise ProtocolBroken(f"{self.name}: an earlier call failed after the ranks agreed to communicate "
                                 f"({self._broken}); the ranks are out of step and this method cannot be "
                                 "called again: restart the job (e.g. from its last checkpoint)")
        try:
            return self._call(grad, layout)
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

    def _call(self, grad: torch.Tensor, layout: Layout) -> torch.Tensor:
        start = time.perf_counter()
        self._agreed = False
        skip = self._validate(grad, layout)
        self._agreed = skip is None
        agreed = time.perf_counter()
        self._times = {}
        n = grad.numel()
        self.stats = Stats(n=n, selected=0 if self.sparse else n)
        if self.tracks_sent and (skip is not None or n == 0):  # nothing sent: DGC masks nothing
            self.last_sent = torch.empty(0, dtype=torch.int64, device=grad.device)
        if skip is not None:
            self.stats.skipped = 1
            self.stats.extra.update(skip)
            self.stats.extra["time_agreement"] = agreed - start
            self.stats.time_total = time.perf_counter() - start
            if self.nonfinite == "propagate":  # as plain DDP's sum would: GradScaler sees it and skips
                return torch.full_like(grad, float("nan"))
            return torch.zeros_like(grad)
        if n == 0:  # nothing to reduce: the average of empty gradients is empty, on every method
            self.step += 1
            self.stats.time_total = time.perf_counter() - start
            return grad.new_zeros(0)
        mark = self.comm.meter.snapshot()
        with self.comm.meter.phase(self.name):
            out = self.reduce(grad, layout)
        traffic = self.comm.meter.since(mark)
        stats = self.stats
        if not self.sparse:
            stats.nnz_out = n  # a dense method sends and returns every element
        elif not stats.nnz_out:
            stats.nnz_out = int(torch.count_nonzero(out))
        if not stats.modelled_bytes:
            stats.bytes_sent, stats.bytes_recv = traffic.bytes_sent, traffic.bytes_recv
            stats.inter_node_bytes_sent = traffic.inter_node_bytes_sent
            stats.inter_node_bytes_recv = traffic.inter_node_bytes_recv
        stats.header_bytes = traffic.header_bytes_sent
        stats.rounds = traffic.rounds
        stats.time_total = time.perf_counter() - start
        stats.extra["time_agreement"] = agreed - start
        for phase in PHASES:
            setattr(stats, f"time_{phase}", self._times.get(phase, 0.0))
        for phase, seconds in self._times.items():
            if phase not in PHASES:
                stats.extra[f"time_{phase}"] = seconds
        self.step += 1
        return out

    def _validate(self, grad: Any, layout: Layout) -> dict[str, Any] | None:
        """Check ``grad`` locally, then agree with every rank on the call (one header all-reduce,
        :func:`sparsecomm.transport.agreement.agree`). Raises the same error on every rank when a
        rank's input is unusable, the ranks disagree, or (policy ``"error"``) a rank's gradient holds
        NaN/Inf. Returns ``None`` to go on, or the figures of a step skipped for non-finite input."""
        problem = _local_problem(grad, layout, self.name, self.residual)
        tensor = isinstance(grad, torch.Tensor)
        try:
            header = self._header(grad, layout, problem)
        except Exception as exc:  # noqa: BLE001 - any local failure is told to every rank in the agreement
            problem = (9, RuntimeError, f"{self.name}: reading the gradient failed: {type(exc).__name__}: {exc}")
            header = self._header(grad, layout, problem)
        with self.comm.meter.phase("agreement"):
            verdict = agree(self.comm, header, zero=("input", "nonfinite"),
                            device=grad.device if tensor and not grad.is_meta else None)
        if verdict is None:
            return None
        bad_input = verdict.nonzero_ranks("input")
        if bad_input:
            if problem is not None:
                raise problem[1](f"{problem[2]} (input rejected on {_ranks_text(bad_input)}; nothing was sent)")
            raise AgreementError(f"{self.name}: {_ranks_text(bad_input)} passed an unusable gradient "
                                 f"({', '.join(_PROBLEMS[c][1] for c in sorted(set(verdict.column('input'))) if c)});"
                                 f" nothing was sent", bad_input, "input")
        mismatched = [name for name in verdict.mismatched() if name != "nonfinite"]
        if mismatched:
            odd = sorted({r for name in mismatched for r in verdict.outliers(name)[1]})
            details = "; ".join(
                f"{_LABELS[name]} ({self._describe_mismatch(name, grad, layout)})" if name in _NO_CRC
                else f"{_LABELS[name]} ({_range(verdict, name)}{verdict.describe(name, _SHOW.get(name, str))})"
                for name in mismatched)
            hints = "".join(_HINTS[name] for name in mismatched if name in _HINTS)
            raise AgreementError(
                f"{self.name}: {details}. Every rank must call the same method on the same kind of gradient; "
                f"nothing was sent and the state is unchanged.{hints}", odd, mismatched[0])
        bad = verdict.nonzero_ranks("nonfinite")
        counts = ", ".join(f"rank {r}: {verdict.column('nonfinite')[r]}" for r in bad)
        if self.nonfinite == "propagate":
            log.info("%s: step %d not communicated: NaN/Inf in the gradient of %s (%s); NaN returned on every "
                     "rank", self.name, self.step, _ranks_text(bad), counts)
            return {"skipped_reason": "nonfinite", "nonfinite_ranks": bad}
        if self.nonfinite == "skip":
            log.warning("%s: step %d skipped on every rank: NaN/Inf in the gradient of %s (%s)",
                        self.name, self.step, _ranks_text(bad), counts)
            return {"skipped_reason": "nonfinite", "nonfinite_ranks": bad}
        raise NonFiniteGradientError(
            f"{self.name}: NaN/Inf in the gradient of {_ranks_text(bad)} ({counts} non-finite elements); "
            f"raised on every rank before anything was sent, residual and step unchanged "
            f"(make_method(..., nonfinite='skip') skips such steps instead)", bad, "nonfinite")

    def _describe_mismatch(self, name: str, grad: Any, layout: Layout) -> str:
        """What differs in field ``name`` (``options``, ``layout``), named, not as CRCs: every rank
        sends its value as text (error path only, :mod:`..transport.disagreement`)."""
        device = grad.device if isinstance(grad, torch.Tensor) and not grad.is_meta else None
        if name == "options":
            plain = {k: v for k, v in self.options.items() if isinstance(v, str | int | float | bool | type(None))}
            return describe_options(gather_texts(self.comm, options_text(plain), device))
        spans = [] if layout is None else [[int(o), int(m)] for o, m in layout]
        texts = gather_texts(self.comm, options_text({"layout": spans}), device)
        return describe_options(texts).replace("option 'layout' differs: ", "")

    def _header(self, grad: Any, layout: Layout, problem: tuple | None) -> dict[str, int]:
        """This rank's description of the call, as int64 fields (see :mod:`..transport.agreement`)."""
        if problem is not None:
            return {"input": problem[0], **dict.fromkeys(_HEADER_FIELDS, 0)}
        n = grad.numel()
        return {"input": 0, "n": n, "dtype": _dtype_code(grad.dtype), "density": _float_bits(self.density),
                "step": self.step, "method": zlib.crc32(self.name.encode()), "options": self._options_hash(),
                "layout": 0 if layout is None else _layout_hash(layout), "nonfinite": _count_nonfinite(grad)}

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

    def _options_hash(self) -> int:
        """CRC-32 of the options ``make_method`` recorded (plain values only), 0 without."""
        if not self.options:
            return 0
        plain = sorted((k, v) for k, v in self.options.items() if isinstance(v, str | int | float | bool | type(None)))
        return zlib.crc32(repr(plain).encode())

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


def _check_layout(layout: Layout, n: int, name: str) -> list[tuple[int, int]]:
    spans = [(int(o), int(m)) for o, m in layout]  # type: ignore[union-attr]
    end = 0
    for offset, numel in spans:
        if offset < end or numel < 0 or offset + numel > n:
            raise ValueError(f"{name}: layout entry (offset={offset}, numel={numel}) must be in order, "
                             f"non-overlapping and inside [0, n={n})")
        end = offset + numel
    return spans


# The header of a call (after its first field, "input": 0 or the code of a local problem).
_HEADER_FIELDS = ("n", "dtype", "density", "step", "method", "options", "layout", "nonfinite")

# code -> (exception type on the offending rank, short cause for the other ranks)
_PROBLEMS: dict[int, tuple[type[Exception], str]] = {
    1: (TypeError, "not a torch.Tensor"), 2: (ValueError, "not 1-D"), 3: (TypeError, "not floating-point"),
    4: (ValueError, "bad layout"), 5: (ValueError, "requires grad"), 6: (ValueError, "meta tensor"),
    7: (TypeError, "not a dense (strided) tensor"), 8: (ValueError, "not on the residual's device"),
    9: (RuntimeError, "gradient could not be read")}

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _local_problem(grad: Any, layout: Layout, name: str,
                   residual: torch.Tensor | None = None) -> tuple[int, type[Exception], str] | None:
    """(code, exception type, message) of what makes ``grad`` / ``layout`` unusable here, or None.

    Everything that could make this rank fail on its own once the payload exchange has begun is
    checked here, before the agreement, so that the other ranks learn it there instead of waiting
    for a rank that left the protocol (issue 23, item 5)."""
    if not isinstance(grad, torch.Tensor):
        return 1, TypeError, f"{name}: grad must be a torch.Tensor, got {type(grad).__name__}"
    if grad.layout != torch.strided:
        return 7, TypeError, (f"{name}: grad must be a dense (strided) tensor, got layout {grad.layout} "
                              "(sparse gradients go through sparsecomm.integration.embedding)")
    if grad.is_meta:
        return 6, ValueError, f"{name}: grad is a meta tensor (it has no data to communicate)"
    if grad.requires_grad:
        return 5, ValueError, (f"{name}: grad must not require grad (got a tensor with requires_grad=True); "
                               "pass grad.detach()")
    if residual is not None and residual.device != grad.device:
        return 8, ValueError, (f"{name}: grad is on {grad.device}, the method's residual on {residual.device}; "
                               "keep every call of a method instance on one device")
    if grad.dim() != 1:
        return 2, ValueError, f"{name}: grad must be a 1-D (flat) tensor, got shape {tuple(grad.shape)}"
    if not grad.is_floating_point():
        return 3, TypeError, f"{name}: grad must be a floating-point tensor, got dtype {grad.dtype}"
    if layout is not None:
        try:
            _check_layout(layout, grad.numel(), name)
        except (ValueError, TypeError) as exc:
            return 4, ValueError, str(exc)
    return None


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else zlib.crc32(str(dtype).encode())


def _float_bits(value: float | None) -> int:
    """The IEEE-754 bits of ``value`` as an int64 (0 for None): equal bits, equal floats."""
    return 0 if value is None else int(struct.unpack("<q", struct.pack("<d", float(value)))[0])


def _layout_hash(layout: Layout) -> int:
    spans = [int(v) for span in layout for v in span]  # type: ignore[union-attr]
    return zlib.crc32(struct.pack(f"<{len(spans)}q", *spans))


def _count_nonfinite(grad: torch.Tensor) -> int:
    """NaN/Inf elements of ``grad``. One sum decides in the common case: a finite sum means every
    element is finite; only a non-finite sum (NaN/Inf, or an overflow) pays for the exact count."""
    if grad.numel() == 0 or math.isfinite(float(grad.sum())):
        return 0
    return int(grad.numel() - int(torch.isfinite(grad).sum()))


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _show_dtype(code: int) -> str:
    return str(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else f"<dtype crc {code}>"


def _show_density(bits: int) -> str:
    return "None" if bits == 0 else f"{struct.unpack('<d', struct.pack('<q', bits))[0]:g}"


# fields whose header value is a CRC: the message names what differs instead (_describe_mismatch)
_NO_CRC = ("options", "layout")

_LABELS = {"n": "gradient length differs across ranks", "dtype": "gradient dtype differs across ranks",
           "density": "density differs across ranks", "step": "step counter differs across ranks",
           "method": "method differs across ranks", "options": "method options differ across ranks",
           "layout": "layout differs across ranks"}


def _range(verdict: Agreement, name: str) -> str:
    """``"min 10, max 12; "`` for the counting fields, else ``""``."""
    if name not in ("n", "step"):
        return ""
    column = verdict.column(name)
    return f"min {min(column)}, max {max(column)}; "


def _show_method(code: int) -> str:
    names = {zlib.crc32(name.encode()): name for name in METHODS.names()}
    return names.get(code, f"<method crc {code}>")


_SHOW: dict[str, Callable[[int], str]] = {"dtype": _show_dtype, "density": _show_density, "method": _show_method}
_HINTS = {"step": " A differing step means a rank went on after an error the others did not see, or resumed "
                  "from another checkpoint.",
          "method": " Every rank must use the same method.",
          "options": " Every rank must build the method with the same options."}


def selection_count(density: float, n: int) -> int:
    """k for ``density`` over n elements: ceil(density * n), at least 1 when n > 0, at most n."""
    return min(n, max(1 if n else 0, math.ceil(density * n)))


#: Every method class by name (``@register_method("name")`` adds one).
METHODS: Registry[type[Method]] = Registry("method")


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator registering a :class:`Method` subclass under ``name`` (sets ``cls.name``)."""
    return METHODS.register(name)
