"""A name -> object registry: the one mechanism behind the method, selector and cost-formula tables.

::

    METHODS = Registry("method")

    @METHODS.register("spardl")
    class SparDL: ...

    METHODS.get("spardl")      # the class; an unknown name raises ValueError listing the known ones
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry", "UnknownNameError"]

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that no entry of a :class:`Registry` carries."""


class Registry(Generic[T]):
    """Entries registered under unique names; ``kind`` names them in error messages ("method")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its target under ``name``; a class also gets ``name`` as attribute."""

        def wrap(entry: T) -> T:
            self.add(name, entry)
            if isinstance(entry, type):
                entry.name = name  # type: ignore[attr-defined]
            return entry

        return wrap

    def add(self, name: str, entry: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        known = self._entries.get(name)
        if known is not None and known is not entry:
            raise ValueError(f"{self.kind} name {name!r} is already registered by {_label(known)}")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        """The entry called ``name``; raises :class:`UnknownNameError` listing the known names."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


def _label(entry: object) -> str:
    return getattr(entry, "__qualname__", None) or repr(entry)
