"""Per-rank training checkpoints that are written atomically and resumed only when every rank agrees.

* :func:`save_checkpoint` writes to a temporary file in the same directory, flushes and fsyncs it,
  renames it over the final path (``os.replace``, atomic on POSIX) and fsyncs the directory: a crash
  while writing leaves the previous checkpoint intact, never a torn file.
* Each checkpoint carries ``meta``: the method name, its options and the world size that wrote it
  (and anything else the caller adds); :func:`resume_checkpoint` compares them with the resuming run.
* :func:`resume_checkpoint` is collective: every rank loads its own file, then all ranks exchange
  (status, epoch, step) in one all-gather, so that a missing or unreadable file, a metadata mismatch
  (another method, other options, another world size) or ranks at different epochs or steps raise the
  same clear error on every rank, naming the ranks, instead of training on inconsistent state.

A world-size change is refused (residuals are per rank; redistributing them is not implemented).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resume_checkpoint", "checkpoint_path"]

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


def resume_checkpoint(directory: str, expect: dict[str, Any], group=None) -> dict[str, Any]:
    """Collective: load this rank's checkpoint from ``directory`` and check, on every rank, that all
    ranks loaded a matching checkpoint of the same ``epoch`` and ``step`` (keys of the saved state).

    Raises :class:`CheckpointError` on every rank otherwise, naming the ranks and the cause.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    path = checkpoint_path(directory, rank)
    status, saved, detail, written_by = _OK, None, "", -1
    try:
        saved = _read(path)
        meta = saved["meta"]
        written_by = int(meta.get("world_size", -1))
        mismatch = meta_mismatch(meta, expect)
        if mismatch:
            status, detail = _META, f"{path} was written by another run: {mismatch}"
    except FileNotFoundError:
        status, detail = _MISSING, f"{path} not found"
    except Exception as exc:  # a torn or foreign file: any unpickling error
        status, detail = _UNREADABLE, f"{path}: {type(exc).__name__}: {exc}"
    epoch = int(saved.get("epoch", -1)) if status == _OK and saved is not None else -1
    step = int(saved.get("step", -1)) if status == _OK and saved is not None else -1
    mine = torch.tensor([status, epoch, step, written_by], dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    rows = [[int(v) for v in t.tolist()] for t in table]
    bad = {code: [r for r, row in enumerate(rows) if row[0] == code] for code in _STATUS_TEXT}
    problems = [f"{_ranks(ranks)} {_STATUS_TEXT[code][len(ranks) > 1]}" for code, ranks in bad.items() if ranks]
    sizes = sorted({row[3] for row in rows if row[3] not in (-1, world)})
    if sizes:
        problems.append(f"checkpoints written by {' and '.join(map(str, sizes))} ranks, this run has {world} "
                        f"(a change of world size is not supported: each rank's residual is its own)")
    if problems:
        here = f" (here, rank {rank}: {detail})" if detail else ""
        raise CheckpointError(f"cannot resume from {directory}: {'; '.join(problems)}{here}")
    positions = {(row[1], row[2]) for row in rows}
    if len(positions) > 1:
        where = ", ".join(f"rank {r}: epoch {row[1]} step {row[2]}" for r, row in enumerate(rows))
        raise CheckpointError(f"cannot resume from {directory}: the ranks' checkpoints are from different "
                              f"points of training ({where}); every rank must resume from the same epoch and step")
    assert saved is not None
    return saved


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
