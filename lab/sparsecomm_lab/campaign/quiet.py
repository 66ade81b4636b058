"""The quiet-machine rule of timed runs: a run starts only below a load threshold, and one that
started above it is redone (its record keeps the load it started at)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparsecomm_lab.training import TrainConfig

__all__ = ["QuietPolicy", "add_quiet_arguments", "quiet_policy", "train_quietly"]


@dataclass
class QuietPolicy:
    """When the machine counts as quiet enough for a timed run: the 1-minute load average at most
    ``max_load_per_core`` per core (0.75: 1.5 on 2 cores). Before a run, :meth:`wait` polls the
    load every ``poll_s`` seconds for up to ``max_wait_s`` and returns the load the run starts at;
    a run that started above the threshold is redone, up to ``redo`` times (the last attempt is
    kept, its record saying so). ``loadavg`` and ``sleep`` are the system's (replaceable in tests)."""

    max_load_per_core: float = 0.75
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else (os.cpu_count() or 1))
    max_wait_s: float = 300.0
    poll_s: float = 5.0
    redo: int = 2
    loadavg: Callable[[], float] = field(default=lambda: os.getloadavg()[0])
    sleep: Callable[[float], None] = field(default=time.sleep)

    def __post_init__(self) -> None:
        if not self.max_load_per_core > 0:
            raise ValueError(f"max_load_per_core={self.max_load_per_core} must be > 0")
        if self.redo < 0 or self.max_wait_s < 0:
            raise ValueError(f"redo={self.redo} and max_wait_s={self.max_wait_s} must be >= 0")

    @property
    def threshold(self) -> float:
        return self.max_load_per_core * self.cores

    def wait(self, announce: Callable[[float], None] | None = None) -> tuple[float, float]:
        """(load average the run starts at, seconds waited for it); ``announce(load)`` is called once
        when the wait begins, so that a long wait is never silent."""
        waited, load = 0.0, self.loadavg()
        if announce is not None and load > self.threshold and self.max_wait_s > 0:
            announce(load)
        while load > self.threshold and waited < self.max_wait_s:
            step = min(self.poll_s, self.max_wait_s - waited)
            self.sleep(step)
            waited += step
            load = self.loadavg()
        return load, waited


def add_quiet_arguments(parser: Any, max_wait: float = 300.0, redo: int = 2) -> None:
    """The quiet-machine options of the commands that time training runs (``bench time_to_accuracy``
    and ``demo``): ``--max-load-per-core``, ``--max-wait``, ``--redo`` (:func:`quiet_policy` reads
    them), with the command's defaults for the last two."""
    parser.add_argument("--max-load-per-core", type=float, default=0.75,
                        help="quiet machine: the 1-minute load average before a run at most this times the "
                        "cores (default %(default)s: 1.5 on 2 cores); 0 disables the check")
    parser.add_argument("--max-wait", type=float, default=max_wait,
                        help="seconds to wait for a quiet machine before a run (default %(default)s)")
    parser.add_argument("--redo", type=int, default=redo,
                        help="times a run started above the load threshold is redone (default %(default)s)")


def quiet_policy(args: Any) -> QuietPolicy | None:
    """The :class:`QuietPolicy` of :func:`add_quiet_arguments`'s options (``None``: the check is off)."""
    if args.max_load_per_core == 0:
        return None
    return QuietPolicy(max_load_per_core=args.max_load_per_core, max_wait_s=args.max_wait, redo=args.redo)


def train_quietly(config: TrainConfig, trainer: Callable[[TrainConfig], dict[str, Any]],
                   quiet: QuietPolicy | None, echo: Callable[[str], None]) -> dict[str, Any]:
    """``trainer(config)``, under ``quiet``: waited for, redone when it started on a busy machine;
    the record's ``load`` says the load before each attempt and the threshold."""
    if quiet is None:
        return trainer(config)
    loads: list[float] = []
    def announce(load: float) -> None:
        echo(f"    load average {load:.2f} > {quiet.threshold:g} ({quiet.max_load_per_core:g} x {quiet.cores} cores): "
             f"waiting up to {quiet.max_wait_s:.0f} s for a quiet machine (--max-load-per-core 0 skips the wait)")

    for attempt in range(quiet.redo + 1):
        load, waited = quiet.wait(announce)
        loads.append(load)
        record = trainer(config)
        if load <= quiet.threshold:
            break
        echo(f"    load average {load:.2f} > {quiet.threshold:g} ({quiet.max_load_per_core:g} x {quiet.cores} cores) "
             f"before the run (waited {waited:.0f} s): " + ("redone" if attempt < quiet.redo else "kept, marked busy"))
    record["load"] = {"before": loads[-1], "attempts": loads, "threshold": quiet.threshold,
                      "quiet": loads[-1] <= quiet.threshold}
    return record
