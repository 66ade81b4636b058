"""A method resolved once: its name and options, checked when the spec is made.

Everything that configures a method (the DDP hook state, the synchronizer, schedules, the training
harness, calibration, fault campaigns) holds a :class:`MethodSpec` instead of a name string and a loose
options dict. A name with options is turned into a spec once, where it enters the library
(:meth:`MethodSpec.of`); from then on the class, whether the method is sparse, and the validity of
its options are known, and the spec builds the method on a communicator (:meth:`MethodSpec.build`)
and travels in checkpoints as a plain dict (:meth:`MethodSpec.to_dict` / :meth:`MethodSpec.from_dict`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..transport.comm import Communicator
from .base import NONFINITE_POLICIES, Method, check_density
from .catalog import check_method_options, method_class

__all__ = ["MethodSpec", "method_spec", "option_names", "COMMON_OPTIONS"]

#: Options every method takes besides its own keyword arguments (handled by :meth:`MethodSpec.build`).
COMMON_OPTIONS = ("nonfinite",)


def _load_class(name: Any) -> type[Method]:
    if not isinstance(name, str):
        raise TypeError(f"method must be a name (str) or a MethodSpec, got {type(name).__name__}")
    return method_class(name)


def _keyword_options(cls: type[Method]) -> tuple[list[str], bool]:
    """The keyword arguments of ``cls``'s constructor, and whether it passes others on (``**``)."""
    parameters = inspect.signature(cls.__init__).parameters
    names = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def option_names(name: str) -> tuple[list[str], bool]:
    """The options method ``name`` takes itself (its keyword arguments, then :data:`COMMON_OPTIONS`),
    and whether it passes other options on (to its selector, which checks them)."""
    own, passes_on = _keyword_options(_load_class(name))
    return [*own, *COMMON_OPTIONS], passes_on


@dataclass(frozen=True, eq=False)
class MethodSpec:
    """A synchronization method by name with its options, validated once.

    Args:
        name: a name from :func:`sparsecomm.available_methods`.
        options: the method's keyword arguments (``density`` for a sparse method, in (0, 1]), plus
            ``nonfinite`` (``"error"`` or ``"skip"``, :attr:`Method.nonfinite`).

    Raises:
        ValueError: an unknown method (listing the available ones), a density outside (0, 1], a
            sparse method without density or a dense one with one, a bad ``nonfinite``.
        TypeError: an unknown option (naming the method and listing its valid options).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cls = _load_class(self.name)
        if not isinstance(self.options, Mapping):
            raise TypeError(f"method {self.name!r}: options must be a mapping, got {type(self.options).__name__}")
        options = dict(self.options)
        check_method_options(self.name, options)
        density = check_density(self.name, cls.sparse, options.get("density"))
        if density is not None:
            options["density"] = density
        if options.get("nonfinite", "error") not in NONFINITE_POLICIES:
            raise ValueError(f"method {self.name!r}: nonfinite={options['nonfinite']!r} must be one of "
                             f"{NONFINITE_POLICIES}")
        object.__setattr__(self, "options", MappingProxyType(options))
        object.__setattr__(self, "_cls", cls)

    # ------------------------------------------------------------------ making one
    @classmethod
    def of(cls, method: MethodSpec | str, options: Mapping[str, Any] | None = None) -> MethodSpec:
        """``method`` as a spec: a spec as it is, or a name with ``options``."""
        if isinstance(method, MethodSpec):
            if options:
                raise TypeError(f"method {method.name!r} is given as a MethodSpec: put the options "
                                f"{sorted(options)} in the spec, not beside it")
            return method
        return cls(method, dict(options or {}))

    @classmethod
    def at_density(cls, name: str, density: float, **options: Any) -> MethodSpec:
        """Method ``name`` selecting ``density`` when it is sparse (a dense method ignores it)."""
        if _load_class(name).sparse:
            options["density"] = density
        return cls(name, options)

    def replace(self, **options: Any) -> MethodSpec:
        """This spec with ``options`` changed (``None`` removes one)."""
        merged = {**self.options, **options}
        return MethodSpec(self.name, {key: value for key, value in merged.items() if value is not None})

    # ------------------------------------------------------------------ what it knows
    @property
    def cls(self) -> type[Method]:
        """The registered class of the method."""
        return self._cls  # type: ignore[attr-defined]

    @property
    def sparse(self) -> bool:
        """True when the method selects a fraction ``density`` of the elements."""
        return self.cls.sparse

    @property
    def density(self) -> float | None:
        """The density of a sparse method, ``None`` for a dense one."""
        return self.options.get("density")

    def build(self, comm: Communicator | None = None) -> Method:
        """The method over ``comm`` (default: all ranks of the default process group)."""
        options = dict(self.options)
        nonfinite = options.pop("nonfinite", "error")
        try:
            method = self.cls(comm, **options)
        except TypeError as exc:  # an option passed on (e.g. to a selector) that nobody takes
            valid, _ = _keyword_options(self.cls)
            raise TypeError(f"method {self.name!r}: {exc} (its own options: "
                            f"{', '.join([*valid, *COMMON_OPTIONS])})") from None
        method.nonfinite = nonfinite
        method.options = options
        return method

    # ------------------------------------------------------------------ checkpoints and printing
    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., "options": {...}}``: plain values, for checkpoints and JSON."""
        return {"name": self.name, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> MethodSpec:
        return cls(saved["name"], dict(saved.get("options", {})))

    def label(self) -> str:
        """A short label: ``spardl@0.01``, ``dense``."""
        return self.name if self.density is None else f"{self.name}@{self.density:g}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MethodSpec):
            return NotImplemented
        return self.name == other.name and dict(self.options) == dict(other.options)

    def __hash__(self) -> int:
        return hash((self.name, repr(sorted(self.options.items()))))

    def __reduce__(self) -> tuple[Any, ...]:
        return (MethodSpec, (self.name, dict(self.options)))

    def __repr__(self) -> str:
        return f"MethodSpec({self.name!r}, {dict(self.options)!r})"


def method_spec(method: MethodSpec | str, **options: Any) -> MethodSpec:
    """``MethodSpec.of(method, options)``: a name with options, or a spec, as a spec."""
    return MethodSpec.of(method, options)
