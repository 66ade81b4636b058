"""What every method call checks before anything is sent, locally and with every other rank.

:func:`check_call` (which the runner makes once per call, :mod:`.runner`) builds this rank's *header*
of the call (gradient length, dtype, density, step, method, options, layout, and the number of NaN/Inf
elements of the gradient), agrees on it with every rank in one small collective
(:func:`sparsecomm.transport.agreement.agree`: ceil(log2 P) messages of 16 H bytes, booked as header
bytes), and turns a disagreement into the same error on every rank, naming the offending ranks, or,
for a non-finite gradient, applies the non-finite policy. The transport module holds the collective;
this module holds what a method call puts in it and how a verdict is read.

The non-finite count costs one sum over the gradient per call (a finite sum means every element is
finite; only a non-finite sum pays for the exact count), unless the caller counted it already in the
method's accumulation scan. :func:`check_call_carrying` sends the call's first message inside the
agreement's messages (gloo and MPI: every control message has one self-describing frame, so a rank
with another n, dtype or method is still read); the header field ``carries`` makes ranks that would
not all do so disagree (docs/reliability.md, "The all-gather rides on the agreement").
"""

from __future__ import annotations

import logging
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..selection import NonFiniteInputError
from ..transport.agreement import (
    Agreement,
    AgreementError,
    agree_carrying,
    agree_gathering,
    describe_options,
    gather_texts,
    options_text,
)
from ..transport.control import BlockStep

__all__ = ["check_call", "check_call_carrying", "local_problem", "count_nonfinite", "AgreementError",
           "NonFiniteGradientError", "NONFINITE_POLICIES"]

log = logging.getLogger(__name__)

Layout = Sequence[tuple[int, int]] | None

#: What a call does when a rank's gradient holds NaN/Inf (see :attr:`Method.nonfinite`).
NONFINITE_POLICIES = ("error", "skip", "propagate")


class NonFiniteGradientError(NonFiniteInputError, AgreementError):
    """A rank's gradient holds NaN/Inf: raised on every rank, before anything is sent."""


def check_call(method: Any, grad: Any, layout: Layout, method_names: Iterable[str] = (), *,
               nonfinite: int | None = None, failure: str | None = None) -> dict[str, Any] | None:
    """Check ``grad`` locally, then agree with every rank of ``method.comm`` on the call (one header
    all-reduce). Raises the same error on every rank when a rank's input is unusable, the ranks
    disagree, or (policy ``"error"``) a rank's gradient holds NaN/Inf. Returns ``None`` to go on, or
    the figures of a step the non-finite policy skips. ``method_names``: the registered names, to
    name a differing method in the message.

    ``nonfinite``: the NaN/Inf elements of ``grad`` when the caller counted them already (in the
    method's accumulation scan; any positive number when there are some); ``None`` counts them here
    (:func:`count_nonfinite`, one sum over the gradient). ``failure``: this rank failed locally before
    the agreement (the message); every rank then raises."""
    return check_call_carrying(method, grad, layout, method_names, nonfinite=nonfinite, failure=failure)[0]


def check_call_carrying(method: Any, grad: Any, layout: Layout, method_names: Iterable[str] = (), *,
                        nonfinite: int | None = None, failure: str | None = None,
                        block: Sequence[torch.Tensor] | None = None,
                        next_message: Callable[[int, list[torch.Tensor]], Sequence[torch.Tensor]] | None = None
                        ) -> tuple[dict[str, Any] | None, list[torch.Tensor] | None, list[BlockStep]]:
    """:func:`check_call` whose messages carry the call's first message ``block`` (this rank's payload):
    all-gathered (:func:`~sparsecomm.transport.agreement.agree_gathering`), or, with ``next_message``,
    as the first of point-to-point messages that follow the agreement's own steps
    (:func:`~sparsecomm.transport.agreement.agree_carrying`: ``next_message(step, received)`` makes each
    later one, called only on messages from ranks that agree so far). Whether the call carries a
    message is a header field, so ranks that would not all do so disagree instead of misreading each
    other. Returns (as :func:`check_call`, every rank's block in rank order or the last step's
    received tensors, the payload moved per step); the tensors are there whenever the call goes on."""
    problem = local_problem(grad, layout, method.name, method.residual)
    if failure is not None:
        problem = (9, RuntimeError, f"{method.name}: {failure}")
    tensor = isinstance(grad, torch.Tensor)
    carries = block is not None
    try:
        header = _header(method, grad, layout, problem, nonfinite, carries)
    except Exception as exc:  # noqa: BLE001 - any local failure is told to every rank in the agreement
        problem = (9, RuntimeError, f"{method.name}: reading the gradient failed: {type(exc).__name__}: {exc}")
        header = _header(method, grad, layout, problem)
    payload = block if problem is None else None
    with method.comm.meter.phase("agreement"):
        if next_message is not None:
            verdict, received, steps = agree_carrying(method.comm, header, payload, next_message,
                                                      zero=("input", "nonfinite"))
        else:
            verdict, received, steps = agree_gathering(
                method.comm, header, payload, zero=("input", "nonfinite"),
                device=grad.device if tensor and not grad.is_meta else None)
    if verdict is None:
        if carries and received is None:
            raise RuntimeError(f"{method.name}: the ranks agreed but a rank sent no message (a method bug)")
        return None, received, steps
    return _refuse(method, grad, layout, problem, verdict, method_names), None, steps


def _refuse(method: Any, grad: Any, layout: Layout, problem: tuple | None, verdict: Agreement,
            method_names: Iterable[str]) -> dict[str, Any]:
    """Raise the same error on every rank for a verdict that stops the call, or return the figures
    of a step the non-finite policy skips."""
    bad_input = verdict.nonzero_ranks("input")
    if bad_input:
        if problem is not None:
            raise problem[1](f"{problem[2]} (input rejected on {_ranks_text(bad_input)}; nothing was applied)")
        codes = sorted(set(verdict.column("input")) - {0})
        what = "failed before sending" if codes == [9] else \
            f"passed an unusable gradient ({', '.join(_PROBLEMS[c][1] for c in codes)})"
        raise AgreementError(f"{method.name}: {_ranks_text(bad_input)} {what}; nothing was applied", bad_input, "input")
    bad = verdict.nonzero_ranks("nonfinite")
    # a rank whose gradient is not finite has no first message, so it cannot carry one: its "carries"
    # may differ, and its gradient is what to report
    mismatched = [name for name in verdict.mismatched() if name != "nonfinite" and not (name == "carries" and bad)]
    if mismatched:
        odd = sorted({r for name in mismatched for r in verdict.outliers(name)[1]})
        show = {**_SHOW, "method": _method_shower(method_names)}
        details = "; ".join(
            f"{_LABELS[name]} ({_describe_mismatch(method, name, grad, layout)})" if name in _NO_CRC
            else f"{_LABELS[name]} ({_range(verdict, name)}{verdict.describe(name, show.get(name, str))})"
            for name in mismatched)
        hints = "".join(_HINTS[name] for name in mismatched if name in _HINTS)
        raise AgreementError(
            f"{method.name}: {details}. Every rank must call the same method on the same kind of gradient; "
            f"nothing was applied and the state is unchanged.{hints}", odd, mismatched[0])
    counts = ", ".join(f"rank {r}: {verdict.column('nonfinite')[r]}" for r in bad)
    if method.nonfinite == "propagate":
        log.info("%s: step %d not communicated: NaN/Inf in the gradient of %s (%s); NaN returned on every "
                 "rank", method.name, method.step, _ranks_text(bad), counts)
        return {"skipped_reason": "nonfinite", "nonfinite_ranks": bad}
    if method.nonfinite == "skip":
        log.warning("%s: step %d skipped on every rank: NaN/Inf in the gradient of %s (%s)",
                    method.name, method.step, _ranks_text(bad), counts)
        return {"skipped_reason": "nonfinite", "nonfinite_ranks": bad}
    raise NonFiniteGradientError(
        f"{method.name}: NaN/Inf in the gradient of {_ranks_text(bad)} ({counts} non-finite elements); "
        f"raised on every rank before anything was applied, residual and step unchanged "
        f"(make_method(..., nonfinite='skip') skips such steps instead)", bad, "nonfinite")


def _describe_mismatch(method: Any, name: str, grad: Any, layout: Layout) -> str:
    """What differs in field ``name`` (``options``, ``layout``), named, not as CRCs: every rank sends
    its value as text (error path only, :func:`~sparsecomm.transport.agreement.gather_texts`)."""
    device = grad.device if isinstance(grad, torch.Tensor) and not grad.is_meta else None
    if name == "options":
        plain = {k: v for k, v in method.options.items() if isinstance(v, str | int | float | bool | type(None))}
        return describe_options(gather_texts(method.comm, options_text(plain), device))
    spans = [] if layout is None else [[int(o), int(m)] for o, m in layout]
    texts = gather_texts(method.comm, options_text({"layout": spans}), device)
    return describe_options(texts).replace("option 'layout' differs: ", "")


def _header(method: Any, grad: Any, layout: Layout, problem: tuple | None,
            nonfinite: int | None = None, carries: bool = False) -> dict[str, int]:
    """This rank's description of the call, as int64 fields (see :mod:`..transport.agreement`);
    ``nonfinite`` when counted already, else counted here; ``carries``: the agreement's messages carry
    the call's first message."""
    if problem is not None:
        return {"input": problem[0], **dict.fromkeys(_HEADER_FIELDS, 0)}
    n = grad.numel()
    return {"input": 0, "n": n, "dtype": _dtype_code(grad.dtype), "density": _float_bits(method.density),
            "step": method.step, "method": zlib.crc32(method.name.encode()), "options": _options_hash(method.options),
            "layout": 0 if layout is None else _layout_hash(layout),
            "nonfinite": count_nonfinite(grad) if nonfinite is None else nonfinite, "carries": int(carries)}


def _options_hash(options: dict[str, Any]) -> int:
    """CRC-32 of the options ``make_method`` recorded (plain values only), 0 without."""
    if not options:
        return 0
    plain = sorted((k, v) for k, v in options.items() if isinstance(v, str | int | float | bool | type(None)))
    return zlib.crc32(repr(plain).encode())


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
_HEADER_FIELDS = ("n", "dtype", "density", "step", "method", "options", "layout", "nonfinite", "carries")

# code -> (exception type on the offending rank, short cause for the other ranks)
_PROBLEMS: dict[int, tuple[type[Exception], str]] = {
    1: (TypeError, "not a torch.Tensor"), 2: (ValueError, "not 1-D"), 3: (TypeError, "not floating-point"),
    4: (ValueError, "bad layout"), 5: (ValueError, "requires grad"), 6: (ValueError, "meta tensor"),
    7: (TypeError, "not a dense (strided) tensor"), 8: (ValueError, "not on the residual's device"),
    9: (RuntimeError, "failed before sending")}

# fields whose header value is a CRC: the message names what differs instead (_describe_mismatch)
_NO_CRC = ("options", "layout")

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def local_problem(grad: Any, layout: Layout, name: str,
                   residual: torch.Tensor | None = None) -> tuple[int, type[Exception], str] | None:
    """(code, exception type, message) of what makes ``grad`` / ``layout`` unusable here, or None.

    Everything that could make this rank fail on its own once the payload exchange has begun is
    checked here, before the agreement, so that the other ranks learn it there instead of waiting
    for a rank that left the protocol."""
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


def count_nonfinite(grad: torch.Tensor) -> int:
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


_LABELS = {"n": "gradient length differs across ranks", "dtype": "gradient dtype differs across ranks",
           "density": "density differs across ranks", "step": "step counter differs across ranks",
           "method": "method differs across ranks", "options": "method options differ across ranks",
           "layout": "layout differs across ranks",
           "carries": "whether the agreement carries the first message differs across ranks"}


def _range(verdict: Agreement, name: str) -> str:
    """``"min 10, max 12; "`` for the counting fields, else ``""``."""
    if name not in ("n", "step"):
        return ""
    column = verdict.column(name)
    return f"min {min(column)}, max {max(column)}; "


def _method_shower(method_names: Iterable[str]) -> Callable[[int], str]:
    """Formats a method field (a CRC-32 of the name) as the registered name it stands for."""
    names = {zlib.crc32(name.encode()): name for name in method_names}
    return lambda code: names.get(code, f"<method crc {code}>")


_SHOW: dict[str, Callable[[int], str]] = {"dtype": _show_dtype, "density": _show_density}
_HINTS = {"step": " A differing step means a rank went on after an error the others did not see, or resumed "
                  "from another checkpoint.",
          "method": " Every rank must use the same method.",
          "options": " Every rank must build the method with the same options.",
          "carries": " The agreement carries a method's first message only for a gradient on the CPU: every rank "
                     "must pass its gradient on the same kind of device."}
