"""Per-rank training checkpoints that are written atomically and resumed only when every rank agrees.

* :func:`save_checkpoint` writes to a temporary file in the same directory, flushes and fsyncs it,
  renames it over the final path (``os.replace``, atomic on POSIX) and fsyncs the directory: a crash
  while writing leaves the previous checkpoint intact, never a torn file.
* Each checkpoint carries ``meta``: the method name, its options and the world size that wrote it
  (and anything else the caller adds); :func:`resume_checkpoint` compares them with the resuming run.
* :func:`resume_checkpoint` is collective: every rank loads its own file, then all ranks exchange
  (status, epoch, step, meta, parameter checksum) in one all-gather, so that a missing or unreadable
  file, a metadata mismatch (another method, other options, another seed, batch size or world size),
  a file of another run among the ranks' files, ranks at different epochs or steps, or replicas whose
  parameters differ raise the same clear error on every rank, naming the ranks and the differing
  field, instead of training on inconsistent state.
* :func:`checkpoints_present` decides ``--resume auto`` collectively.

A world-size change is refused (residuals are per rank; redistributing them is not implemented).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resume_checkpoint", "checkpoint_path",
           "checkpoints_present", "parameter_checksum"]

# status codes exchanged by resume_checkpoint
_OK, _MISSING, _UNREADABLE, _META = 0, 1, 2, 3
_STATUS_TEXT = {_MISSING: ("has no checkpoint file", "have no checkpoint file"),
                _UNREADABLE: ("cannot read its checkpoint", "cannot read their checkpoints"),
                _META: ("holds a checkpoint of another run", "hold checkpoints of another run")}


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed (raised on every rank, naming the ranks and the cause)."""


def checkpoint_path(directory: str, rank: int) -> str:
    """The file of ``rank`` in ``directory``."""
    return os.path.join(directory, f"rank{rank}.pt")


def save_checkpoint(path: str, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write ``{"meta": meta, **state}`` to ``path`` atomically (temporary file, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save({"meta": dict(meta), **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str, expect: dict[str, Any]) -> dict[str, Any]:
    """Read the checkpoint at ``path``; ``CheckpointError`` unless its ``meta`` matches ``expect``
    on every key of ``expect`` (local: see :func:`resume_checkpoint` for the collective version)."""
    saved = _read(path)
    problems = meta_mismatch(saved["meta"], expect)
    if problems:
        raise CheckpointError(f"{path} was written by another run: {problems}")
    return saved


def _read(path: str) -> dict[str, Any]:
    saved = torch.load(path, weights_only=False)
    if not isinstance(saved, dict) or not isinstance(saved.get("meta"), dict):
        raise CheckpointError(f"{path} is not a sparsecomm checkpoint (no 'meta'; written by an older version?)")
    return saved


def meta_mismatch(meta: dict[str, Any], expect: dict[str, Any]) -> str:
    """``""`` when ``meta`` agrees with ``expect`` on every key of ``expect``, else what differs."""
    diffs = [f"{key}={meta.get(key)!r} in the checkpoint, {value!r} in this run"
             for key, value in expect.items() if meta.get(key) != value]
    if "world_size" in expect and meta.get("world_size") != expect["world_size"]:
        diffs.append("resume with the world size that wrote the checkpoint")
    return "; ".join(diffs)


def parameter_checksum(state: dict[str, Any]) -> int:
    """CRC-32 of the bytes of every tensor in ``state`` (a model's ``state_dict``), in key order: equal
    replicas give equal checksums on every rank and every machine of the same byte order."""
    crc = 0
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            crc = zlib.crc32(key.encode(), crc)
            crc = zlib.crc32(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def checkpoints_present(directory: str, group=None) -> bool:
    """Collective (``--resume auto``): True when every rank has its checkpoint file in ``directory``,
    False when none has; a partial set raises :class:`CheckpointError` on every rank (it comes from
    another run or a damaged directory, and starting afresh would overwrite it)."""
    here = os.path.exists(checkpoint_path(directory, dist.get_rank(group)))
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, here, group=group)
    if all(flags):
        return True
    if not any(flags):
        return False
    missing = [r for r, present in enumerate(flags) if not present]
    raise CheckpointError(f"cannot resume from {directory}: {_ranks(missing)} "
                          f"{'has' if len(missing) == 1 else 'have'} no checkpoint file while the others do; "
                          "remove the directory to start afresh, or restore the missing files")


def resume_checkpoint(directory: str, expect: dict[str, Any], group=None) -> dict[str, Any]:
    """Collective: load this rank's checkpoint from ``directory`` and check, on every rank, that all
    ranks loaded a checkpoint of this run (``meta`` matches ``expect``), of the same run as each other
    (equal ``meta``), of the same ``epoch`` and ``step``, and with equal replicas (the parameter
    checksum recorded in ``meta["param_checksum"]`` matches the saved ``model`` and is equal on every
    rank).

    Raises :class:`CheckpointError` with the same message on every rank otherwise, naming the ranks
    and the cause.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    path = checkpoint_path(directory, rank)
    status, saved, detail, written_by = _OK, None, "", -1
    meta: dict[str, Any] = {}
    checksum = None
    try:
        saved = _read(path)
        meta = saved["meta"]
        written_by = int(meta.get("world_size", -1))
        mismatch = meta_mismatch(meta, expect)
        if mismatch:
            status, detail = _META, f"{path} was written by another run: {mismatch}"
        elif "param_checksum" in meta and isinstance(saved.get("model"), dict):
            checksum = parameter_checksum(saved["model"])
            if checksum != meta["param_checksum"]:
                status, detail = _UNREADABLE, (f"{path}: its parameters do not match the checksum recorded "
                                               "when it was written (a damaged or altered file)")
    except FileNotFoundError:
        status, detail = _MISSING, f"{path} not found"
    except Exception as exc:  # a torn or foreign file: any unpickling error
        status, detail = _UNREADABLE, f"{path}: {type(exc).__name__}: {exc}"
    epoch = int(saved.get("epoch", -1)) if status == _OK and saved is not None else -1
    step = int(saved.get("step", -1)) if status == _OK and saved is not None else -1
    identity = {k: v for k, v in meta.items() if k != "param_checksum"} if status == _OK else None
    mine = (status, epoch, step, written_by, detail, identity, checksum)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, mine, group=group)
    bad = {code: [r for r, row in enumerate(rows) if row[0] == code] for code in _STATUS_TEXT}
    problems = [f"{_ranks(ranks)} {_STATUS_TEXT[code][len(ranks) > 1]}" for code, ranks in bad.items() if ranks]
    sizes = sorted({row[3] for row in rows if row[3] not in (-1, world)})
    if sizes:
        problems.append(f"checkpoints written by {' and '.join(map(str, sizes))} ranks, this run has {world} "
                        f"(a change of world size is not supported: each rank's residual is its own)")
    if problems:
        details = "; ".join(f"rank {r}: {row[4]}" for r, row in enumerate(rows) if row[4])
        raise CheckpointError(f"cannot resume from {directory}: {'; '.join(problems)}"
                              + (f" ({details})" if details else ""))
    positions = {(row[1], row[2]) for row in rows}
    if len(positions) > 1:
        where = ", ".join(f"rank {r}: epoch {row[1]} step {row[2]}" for r, row in enumerate(rows))
        raise CheckpointError(f"cannot resume from {directory}: the ranks' checkpoints are from different "
                              f"points of training ({where}); every rank must resume from the same epoch and step")
    odd, fields = _outliers([row[5] for row in rows])
    if odd:
        raise CheckpointError(f"cannot resume from {directory}: {_ranks(odd)} "
                              f"{'holds a checkpoint' if len(odd) == 1 else 'hold checkpoints'} of another run than "
                              f"the others ({'; '.join(fields)}); every rank must resume from the same run")
    odd, _ = _outliers([{"checksum": row[6]} for row in rows])
    if odd:
        raise CheckpointError(f"cannot resume from {directory}: the parameters saved by {_ranks(odd)} differ from "
                              "the other ranks' (parameter checksums differ; replicas must be equal)")
    assert saved is not None
    return saved


def _outliers(values: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
    """The ranks whose dict differs from the one most ranks hold (a tie goes to rank 0's), and, for
    each differing key, ``key: rank r has ..., the others ...``."""
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
