"""``sparsecomm train`` killed (SIGKILL) at a moment of an epoch's checkpoint, then resumed with
``--resume auto`` (the fault table of docs/reliability.md and tests/test_torn_checkpoint.py).

The kill hits one rank (the victim) while the epoch's checkpoint is written, at one of
:data:`POINTS`; the local launcher then kills the other ranks, as torchrun's agent stops them. The run
is started again with ``resume="auto"`` and must resume with every rank at the same epoch and end
bit-identical to a run that was never killed.

The forked ranks inherit a wrapper of the library's ``write_atomically`` (every checkpoint file goes
through it) that kills the victim at the chosen point of the chosen epoch.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any

import torch

import sparsecomm.integration.checkpoint as ck
from sparsecomm import CheckpointManager, WorkerError, run_workers

#: where the victim dies, within its save of the epoch: before writing its file (the other ranks write
#: theirs: the kill falls between the ranks' writes), halfway through its file, and after marking the
#: epoch committed (before the previous epoch is deleted)
POINTS = ("before_write", "mid_write", "after_commit")


def _config(directory: str, **changes: Any):
    from sparsecomm_lab.training import TrainConfig

    config = TrainConfig(model="mlp", data="digits", method="topk", density=0.1, workers=3, epochs=3, batch_size=64,
                         model_options={"hidden": [16]}, checkpoint_dir=directory, resume="auto", timeout=300,
                         collective_timeout=20)
    return dataclasses.replace(config, **changes)


def _armed(point: str, victim: int, epoch: int):
    real = ck.write_atomically
    folder = f"step-{epoch:012d}"

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def write_atomically(path: str, write) -> None:
        mine = os.environ.get("RANK") == str(victim) and folder in path
        if mine and point == "before_write" and path.endswith(".pt"):
            die()
        if mine and point == "mid_write" and path.endswith(".pt"):
            def torn(handle) -> None:
                handle.write(b"half a checkpoint")
                handle.flush()
                die()
            real(path, torn)
        real(path, write)
        if mine and point == "after_commit" and path.endswith(".done"):
            die()

    return write_atomically


def run_case(directory: str, point: str, victim: int = 1, epoch: int = 2) -> dict[str, Any]:
    """Kill ``victim`` at ``point`` of epoch ``epoch``'s checkpoint, resume, and compare with the
    uninterrupted run (trained in ``directory``/straight). Returns what happened."""
    from sparsecomm_lab.training import train

    killed = os.path.join(directory, "killed")
    real = ck.write_atomically
    ck.write_atomically = _armed(point, victim, epoch)
    try:
        train(_config(killed))
        died = "not killed"
    except WorkerError as exc:
        died = str(exc).splitlines()[0]
    finally:
        ck.write_atomically = real
    held = sorted(name for name in os.listdir(killed) if name.startswith("step-"))
    steps = run_workers(3, _latest, killed, timeout=120)  # what --resume auto finds, on every rank
    resumed = train(_config(killed), keep_params=True)
    straight = train(_config(os.path.join(directory, "straight")), keep_params=True)
    equal = all(torch.equal(a, b) for mine, theirs in zip(resumed["params"], straight["params"], strict=True)
                for a, b in zip(mine, theirs, strict=True))
    return {"died": died, "held": held, "resumed_from": steps, "resumed_epochs": len(resumed["epochs"]),
            "consistent": resumed["consistent"], "equal_to_uninterrupted": equal}


def _latest(directory: str) -> int | None:
    return CheckpointManager(directory).latest()
