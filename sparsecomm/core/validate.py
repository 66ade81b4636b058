"""Argument checks shared by every layer: each raises ``ValueError`` naming the argument, the value
and the rule it broke, e.g. ``teams=0 must be an integer >= 1``; an option a component does not take
raises :class:`UnknownOptionError` naming the component and listing the options it takes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["is_int", "is_number", "check_int", "check_number", "check_fraction", "check_choice",
           "UnknownOptionError", "check_options", "keyword_options"]


def is_int(value: Any) -> bool:
    """True for a Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a finite ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False) -> Any:
    """``value`` is an integer (not a bool) within ``[minimum, maximum]``; returns it."""
    if value is None and allow_none:
        return value
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be {_int_rule(minimum, maximum)}{' or None' if allow_none else ''}")
    return value


def check_number(name: str, value: Any, minimum: float | None = None, *, strict: bool = False,
                 allow_none: bool = False) -> Any:
    """``value`` is a finite real number (not a bool), ``>= minimum`` (``> minimum`` when ``strict``)."""
    if value is None and allow_none:
        return value
    ok = is_number(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name}={value!r} must be a finite number{bound}{' or None' if allow_none else ''}")
    return value


def check_fraction(name: str, value: Any, *, allow_zero: bool = False, allow_one: bool = True) -> float:
    """``value`` is a number in (0, 1] (bounds adjustable); returns it as a float."""
    ok = is_number(value)
    if ok:
        ok = (value >= 0 if allow_zero else value > 0) and (value <= 1 if allow_one else value < 1)
    if not ok:
        interval = f"{'[' if allow_zero else '('}0, 1{']' if allow_one else ')'}"
        raise ValueError(f"{name}={value!r} must be a number in {interval}")
    return float(value)


def check_choice(name: str, value: Any, choices: Any) -> Any:
    """``value`` is one of ``choices``; returns it."""
    if value not in tuple(choices):
        raise ValueError(f"{name}={value!r} must be one of {', '.join(repr(c) for c in choices)}")
    return value


def _int_rule(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


class UnknownOptionError(TypeError):
    """An option a component does not take (a ``TypeError``, as Python's unexpected keyword argument)."""


def check_options(component: str, given: Iterable[str], valid: Iterable[str], *, more: str = "") -> None:
    """Raise :class:`UnknownOptionError` ``"spardl: unknown option 'x'; valid options: density, teams, sag"``
    when ``given`` holds a name outside ``valid``; ``more`` follows the list (e.g. a selector's options)."""
    valid = list(valid)
    unknown = [name for name in given if name not in valid]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise UnknownOptionError(f"{component}: unknown option{plural} {', '.join(map(repr, unknown))}; "
                                 f"valid options: {', '.join(valid) if valid else 'none'}{more}")


def keyword_options(function: Callable[..., Any], skip: Iterable[str] = ("self", "comm")) -> tuple[list[str], bool]:
    """The names ``function`` takes as keywords (in order, ``skip`` left out) and whether it takes
    ``**more`` besides."""
    parameters = inspect.signature(function).parameters.values()
    names = [p.name for p in parameters if p.name not in skip
             and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
