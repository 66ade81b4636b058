"""Progress output for the command line's long loops (training steps, benchmark configurations).

On a terminal a :mod:`tqdm` bar is drawn on stderr when tqdm (of ``sparsecomm[data]``) is installed;
otherwise (no tqdm, a log file, a pipe, CI) a plain line ``DESC: i/total [detail] (elapsed)`` is printed
on stderr, at most every ``interval`` seconds and at the end, so a long run is never silent and a log
stays short. Library code takes a progress callback and never prints: the commands create these
objects and pass them in.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

from sparsecomm.core.optional import available, require

__all__ = ["Progress", "progress_iter", "is_terminal"]

T = TypeVar("T")


def is_terminal(stream: TextIO) -> bool:
    """A terminal with a known width (a pseudo-terminal of 0 columns gets plain lines: a bar in 0
    columns is invisible)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """A counter to ``total`` named ``desc``: :meth:`update` after each unit of work, :meth:`close` at
    the end (or use it as a context manager). ``interval``: seconds between plain lines (0: every update)."""

    def __init__(self, total: int, desc: str, *, stream: TextIO | None = None, interval: float = 10.0,
                 bar: bool | None = None) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.stream = sys.stderr if stream is None else stream
        self.count = 0
        self.started = time.perf_counter()
        self._last_line = -math.inf if math.isfinite(interval) else self.started  # first update: a line
        self._bar: Any = None
        if (is_terminal(self.stream) and available("tqdm")) if bar is None else bar:
            tqdm = require("tqdm", "a progress bar").tqdm
            self._bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1, detail: str = "") -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            if detail:
                self._bar.set_postfix_str(detail, refresh=False)
            return
        now = time.perf_counter()
        if now - self._last_line >= self.interval or self.count >= self.total:
            self._last_line = now
            self.line(detail)

    def announce(self, what: str) -> None:
        """Say which unit of work starts now: the bar's postfix, or a plain line ``DESC: i/total what``."""
        if self._bar is not None:
            self._bar.set_postfix_str(what)
        else:
            print(f"{self.desc}: {self.count + 1}/{self.total} {what}", file=self.stream, flush=True)

    def line(self, detail: str = "") -> None:
        """Print the plain line now (no bar: the bar shows the same)."""
        extra = f" {detail}" if detail else ""
        print(f"{self.desc}: {self.count}/{self.total}{extra} ({time.perf_counter() - self.started:.0f} s)",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def progress_iter(items: Iterable[T], desc: str, label: Callable[[T], str] = str, *,
                  stream: TextIO | None = None) -> Iterator[T]:
    """Yield ``items``, announcing each before its work starts (``DESC: i/total label``): a bar on a
    terminal, one plain line per item otherwise (each item of a benchmark takes seconds or more)."""
    todo = list(items)
    with Progress(len(todo), desc, stream=stream, interval=math.inf) as progress:
        for item in todo:
            progress.announce(label(item))
            yield item
            progress.update()
