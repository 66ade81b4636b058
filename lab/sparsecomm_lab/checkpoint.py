"""The training harness's checkpoints: the library's :class:`~sparsecomm.CheckpointManager` (atomic
per-rank files, a step committed only when every rank has written it, resume from the newest step
every rank holds), with the run's identity on top.

* Each checkpoint carries ``meta``: what the resuming run must match (method, options, model, data,
  seed, batch size, world size; :func:`sparsecomm_lab.training` builds it) and the CRC-32 of the saved
  parameters (:func:`sparsecomm.integration.consistency.parameter_checksum`).
* :func:`resume` is collective: every rank reads its file (or, after a change of world size, every
  old rank's), then all ranks exchange (problem, meta, parameter checksum) in one all-gather, so that
  another run's checkpoint, files of different runs among the ranks, a file whose parameters do not
  match their checksum, or replicas whose parameters differ raise the same :class:`CheckpointError` on
  every rank, naming the ranks and the differing field.
* A change of world size resumes when the method keeps its state in the library's hook or
  synchronizer: their ``load_state_dict`` takes every old rank's state and redistributes the
  residuals, conserving their sum; the replicas' model and optimizer come from old rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsecomm.integration.checkpoint import CheckpointError, CheckpointManager
from sparsecomm.integration.consistency import gather, parameter_checksum

__all__ = ["CheckpointError", "CheckpointManager", "Resumed", "save", "resume", "meta_mismatch",
           "parameter_checksum"]


@dataclass
class Resumed:
    """A checkpoint read on every rank: ``step`` (the manager's: epochs completed), ``state`` (this
    rank's own, or old rank 0's after a change of world size), ``states`` (every old rank's after a
    change of world size, else ``[state]``), ``resized``."""

    step: int
    state: dict[str, Any]
    states: list[dict[str, Any]]
    resized: bool


def save(manager: CheckpointManager, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Collective: save ``state`` (with ``state["model"]``, the replica's ``state_dict``) as ``step``,
    with ``meta`` and the parameters' checksum."""
    manager.save(step, {"meta": {**meta, "param_checksum": parameter_checksum(state["model"])}, **state})


def meta_mismatch(meta: dict[str, Any], expect: dict[str, Any]) -> str:
    """``""`` when ``meta`` agrees with ``expect`` on every key of ``expect``, else what differs."""
    return "; ".join(f"{key}={meta.get(key)!r} in the checkpoint, {value!r} in this run"
                     for key, value in expect.items() if meta.get(key) != value)


def resume(manager: CheckpointManager, expect: dict[str, Any], *, required: bool) -> Resumed | None:
    """Collective: the newest checkpoint every rank holds, checked on every rank against ``expect``
    (its ``world_size`` only when the job's size is unchanged), against each other (the same run)
    and against the recorded parameter checksums (equal replicas, undamaged files). ``None`` when
    there is none and not ``required`` (``--resume auto`` on a first launch).

    Raises:
        CheckpointError: on every rank, with the same message.
    """
    step = manager.latest()
    if step is None:
        if required:
            raise CheckpointError(f"cannot resume: no complete checkpoint in {manager.directory}")
        return None
    resized = manager.world_size(step) != manager.size
    states = manager.load_all(step, weights_only=False) if resized else [manager.load(step, weights_only=False)]
    state = states[0]
    problem, checksum = "", None
    meta = state.get("meta") if isinstance(state.get("meta"), dict) else None
    if meta is None:
        problem = "its checkpoint is not one of sparsecomm train (no 'meta')"
    else:
        wanted = {k: v for k, v in expect.items() if not (resized and k == "world_size")}
        mismatch = meta_mismatch(meta, wanted)
        if mismatch:
            problem = f"the checkpoint was written by another run: {mismatch}"
        elif isinstance(state.get("model"), dict):
            checksum = parameter_checksum(state["model"])
            if checksum != meta.get("param_checksum"):
                problem = ("its parameters do not match the checksum recorded when it was written "
                           "(a damaged or altered file)")
    identity = None if meta is None else {k: v for k, v in meta.items() if k != "param_checksum"}
    rows = gather((problem, identity, checksum), manager.group)
    bad = [(r, row[0]) for r, row in enumerate(rows) if row[0]]
    where = f"cannot resume from {manager.directory} (step {step})"
    if bad:
        raise CheckpointError(f"{where}: " + "; ".join(f"rank {r}: {text}" for r, text in bad))
    odd, fields = _outliers([row[1] for row in rows])
    if odd:
        raise CheckpointError(f"{where}: {_ranks(odd)} {'holds a checkpoint' if len(odd) == 1 else 'hold checkpoints'} "
                              f"of another run than the others ({'; '.join(fields)}); every rank must resume from "
                              "the same run")
    odd, _ = _outliers([{"checksum": row[2]} for row in rows])
    if odd:
        raise CheckpointError(f"{where}: the parameters saved by {_ranks(odd)} differ from the other ranks' "
                              "(parameter checksums differ; replicas must be equal)")
    return Resumed(step, state, states, resized)


def _outliers(values: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
    """The ranks whose dict differs from the one most ranks hold (a tie goes to rank 0's), and, for
    each differing key, ``key=... on rank r, ... on the others``."""
    reprs = [repr(sorted(v.items())) for v in values]
    majority = max(reprs, key=lambda r: (reprs.count(r), -reprs.index(r)))
    odd = [r for r, text in enumerate(reprs) if text != majority]
    if not odd:
        return [], []
    common = values[reprs.index(majority)]
    fields = []
    for key in sorted({k for v in values for k in v}):
        for r in odd:
            if values[r].get(key) != common.get(key):
                fields.append(f"{key}={values[r].get(key)!r} on rank {r}, {common.get(key)!r} on the others")
    return odd, fields


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))

