"""Multi-rank checkpoints that cannot be torn: every rank's file is written atomically, a step counts
only once every rank has written it, and a resume starts from the newest step every rank holds.

A data-parallel job keeps state on every rank that the others do not have (each rank's residuals,
its RNG), so a checkpoint is P files, and a job killed while they are written (``kill -9``, a node
lost, torchrun stopping the others) must never be left with ranks at different steps, nor with no
complete step at all. :class:`CheckpointManager` keeps three rules:

* **Atomic files.** A rank writes ``step-S/rank-R-of-P.pt`` to a temporary file in the same folder,
  flushes and fsyncs it, renames it into place (``os.replace``, atomic on POSIX) and fsyncs the
  folder: a file that exists is whole.
* **Commit when every rank has it.** After writing, the ranks exchange, in one all-gather, whether
  each wrote step S. Only when all did does each rank mark the step done (``rank-R-of-P.done``) and
  delete its older steps; until then its previous complete step stays. A rank that could not write
  makes every rank raise the same :class:`CheckpointError`, and the previous step is kept.
* **Resume from the newest common step.** :meth:`CheckpointManager.latest` gathers the steps each
  rank holds and takes the newest that every rank holds: a kill at any moment of a save (before,
  during or after any rank's write, between the ranks' writes, between the commit and the cleanup)
  leaves either the new step on every rank or the previous one on every rank. Leftovers of an
  unfinished save (a newer step some ranks hold, temporary files) are removed. A step that was
  committed (marked done) but lacks a rank's file is damage, not a torn save: an error on every rank
  naming the ranks, never a silent fresh start.

A step saved by a job of another size (on a folder every rank can read: a shared file system) is
found by :meth:`~CheckpointManager.latest` when it is complete (every old rank's file);
:meth:`~CheckpointManager.load_all` reads every old rank's state, which the hook's and the
synchronizer's ``load_state_dict`` take as a list to redistribute the residuals
(:mod:`sparsecomm.integration.world`)::

    manager = sparsecomm.CheckpointManager("ck")
    step = manager.latest()                  # collective; None: nothing saved yet
    if step is not None:
        if manager.world_size(step) == dist.get_world_size():
            saved = manager.load(step)       # this rank's own state
            hook_state.load_state_dict(saved["hook"])
        else:                                # another world size: every old rank's state
            states = manager.load_all(step)
            hook_state.load_state_dict([s["hook"] for s in states])
            saved = states[0]                # the replicas' model and optimizer
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    for step in range(...):
        ...
        manager.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "hook": hook_state.state_dict()})   # collective
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .consistency import gather

__all__ = ["CheckpointManager", "CheckpointError", "write_atomically"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RANK_FILE = re.compile(r"^rank-(\d{5})-of-(\d{5})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or resumed: raised with the same message on every rank, naming
    the ranks and the cause."""


def write_atomically(path: str, write: Any) -> None:
    """Create ``path`` whole or not at all: ``write(handle)`` fills a temporary file in the same folder,
    which is flushed, fsynced and renamed over ``path``; the folder is fsynced so that the rename
    itself survives a crash. On any error the temporary file is removed and ``path`` is unchanged."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class CheckpointManager:
    """Save and resume one state per rank, committed only when every rank has written it.

    Args:
        directory: the checkpoints' folder (made if missing; checked writable at once, before any
            work). Every rank may have its own (a local disk) unless the job's size changes: a job of
            another size reads every old rank's file, so the folder must then be shared.
        group: the process group of the ranks (``None``: the default group; without any process
            group, a job of one rank).
        keep: complete steps kept after a commit (>= 1: the newest, and as many before it).

    Every method but :meth:`world_size` is collective: call it on every rank.

    Raises:
        CheckpointError: ``directory`` cannot be made or written.
    """

    def __init__(self, directory: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None,
                 keep: int = 1) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an integer >= 1 (the complete steps kept)")
        self.directory = os.fspath(directory)
        self.group = group
        self.keep = keep
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe.", dir=self.directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"checkpoint folder {self.directory!r} is not writable: {exc.strerror or exc}") \
                from None

    # ------------------------------------------------------------------ the job and the files
    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def _gather(self, value: Any) -> list[Any]:
        return [value] if self.size == 1 else gather(value, self.group)

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:012d}")

    def path(self, step: int, rank: int | None = None, size: int | None = None) -> str:
        """The file of ``rank`` (default: this one) of a job of ``size`` ranks (default: this one) at
        ``step``."""
        rank = self.rank if rank is None else rank
        size = self.size if size is None else size
        return os.path.join(self._step_dir(step), f"rank-{rank:05d}-of-{size:05d}.pt")

    def _marker(self, step: int) -> str:
        return self.path(step)[:-len(".pt")] + ".done"

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names) if m)

    def _files(self, step: int) -> dict[int, set[int]]:
        """The rank files visible at ``step``: world size -> ranks."""
        found: dict[int, set[int]] = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self._step_dir(step)):
                m = _RANK_FILE.match(name)
                if m:
                    found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
        return found

    def world_size(self, step: int) -> int:
        """The size of the job that saved ``step``: this job's when this rank holds its own file, else
        that of the complete set of files it sees (not collective)."""
        files = self._files(step)
        if self.rank in files.get(self.size, set()):
            return self.size
        complete = [size for size, ranks in files.items() if ranks == set(range(size))]
        if not complete:
            raise CheckpointError(f"step {step} in {self.directory} holds no complete checkpoint")
        return max(complete)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Mapping[str, Any]) -> str:
        """Write this rank's ``state`` (anything ``torch.save`` takes) as ``step``, then commit the step
        once every rank has written it: mark it done and delete the older steps beyond ``keep``.
        Returns this rank's file.

        Raises:
            CheckpointError (on every rank): a rank could not write its file (the previous complete
                step is kept), or the ranks saved different steps.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be an integer >= 0")
        path = self.path(step)
        error = None
        try:
            os.makedirs(self._step_dir(step), exist_ok=True)
            record = {"step": step, "world": {"size": self.size, "rank": self.rank}, "state": dict(state)}
            write_atomically(path, lambda handle: torch.save(record, handle))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        rows = self._gather((step, error))
        failed = [r for r, (_, text) in enumerate(rows) if text is not None]
        steps = sorted({s for s, _ in rows})
        if failed or len(steps) > 1:
            with contextlib.suppress(OSError):
                if error is None:
                    os.unlink(path)  # an uncommitted step, never resumed: do not leave it behind
            previous = [s for s in self._steps() if s < step]
            kept = f"the previous checkpoint (step {previous[-1]}) is kept" if previous else "nothing was saved"
            if len(steps) > 1:
                where = ", ".join(f"rank {r}: step {s}" for r, (s, _) in enumerate(rows))
                raise CheckpointError(f"the ranks saved different steps ({where}); {kept}")
            details = "; ".join(f"rank {r}: {rows[r][1]}" for r in failed)
            raise CheckpointError(f"step {step} could not be saved in {self.directory}: {_ranks(failed)} could not "
                                  f"write {'its file' if len(failed) == 1 else 'their files'} ({details}); {kept}")
        write_atomically(self._marker(step), lambda handle: handle.write(b"committed\n"))
        self._prune(step)
        return path

    def _prune(self, newest: int) -> None:
        """Delete the steps before ``newest`` but the ``keep - 1`` newest committed ones, and every
        temporary file of this rank."""
        older = [s for s in self._steps() if s < newest]
        committed = [s for s in older if os.path.exists(self._marker(s))]
        spared = set(committed[len(committed) - (self.keep - 1):]) if self.keep > 1 else set()
        for step in older:
            if step not in spared:
                shutil.rmtree(self._step_dir(step), ignore_errors=True)

    # ------------------------------------------------------------------ resuming
    def latest(self) -> int | None:
        """The newest step every rank holds (collective; the same on every rank), or ``None`` when
        none was ever committed (a fresh start). Leftovers of an unfinished save are removed.

        Raises:
            CheckpointError (on every rank): a committed step lacks some rank's file (a damaged or
                foreign folder: starting afresh would overwrite it), the ranks see different complete
                steps of a job of another size, or only parts of such steps (a folder that is not
                shared).
        """
        own: set[int] = set()
        done: set[int] = set()
        other: set[int] = set()
        partial: set[int] = set()
        for step in self._steps():
            files = self._files(step)
            if self.rank in files.get(self.size, set()):
                own.add(step)
                if os.path.exists(self._marker(step)):
                    done.add(step)
            for size, ranks in files.items():
                if size != self.size:
                    (other if ranks == set(range(size)) else partial).add(step)
        rows = self._gather((sorted(own), sorted(done), sorted(other), sorted(partial)))
        common = set.intersection(*(set(row[0]) for row in rows))
        foreign = set.intersection(*(set(row[2]) for row in rows))
        if set.union(*(set(row[2]) for row in rows)) != foreign:
            views = "; ".join(f"rank {r}: {row[2]}" for r, row in enumerate(rows))
            raise CheckpointError(f"cannot resume from {self.directory}: the ranks see different complete steps of "
                                  f"a job of another size ({views}); a job of another size needs a folder every "
                                  "rank can read")
        committed = set.union(*(set(row[1]) for row in rows))
        lost = sorted(s for s in committed if s not in common and s > max(common | foreign, default=-1))
        if lost:
            step = lost[-1]
            missing = [r for r, row in enumerate(rows) if step not in row[0]]
            raise CheckpointError(f"cannot resume from {self.directory}: step {step} was committed but "
                                  f"{_ranks(missing)} {'has' if len(missing) == 1 else 'have'} no file of it "
                                  "(a damaged folder, or files of another job); restore the files, or remove "
                                  "the folder to start afresh")
        best = max(common | foreign, default=None)
        seen = sorted(set.union(*(set(row[3]) for row in rows)))
        if best is None and seen:
            raise CheckpointError(f"cannot resume from {self.directory}: it holds steps {seen} of a job of another "
                                  "size, but no rank sees every old rank's file of any of them; a job of another "
                                  "size needs a folder every rank can read (a shared file system)")
        self._clean(best)
        return best

    def _clean(self, resumed: int | None) -> None:
        """Remove this rank's files of steps after ``resumed`` (an unfinished save) and its temporary
        files."""
        for step in self._steps():
            folder = self._step_dir(step)
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(folder):
                    mine = name.startswith(f"rank-{self.rank:05d}-of-{self.size:05d}.")
                    if name.endswith(".tmp") and mine or (mine and (resumed is None or step > resumed)):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(folder, name))
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when empty

    def _read(self, path: str, step: int, map_location: Any, weights_only: bool) -> tuple[Any, str | None]:
        try:
            record = torch.load(path, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError:
            return None, f"{path} not found"
        except Exception as exc:  # noqa: BLE001 - a foreign or unreadable file: any unpickling error
            return None, f"{path}: {type(exc).__name__}: {exc}"
        if not isinstance(record, dict) or record.get("step") != step or "state" not in record:
            return None, f"{path} is not a checkpoint of step {step} written by CheckpointManager"
        return record, None

    def load(self, step: int | None = None, *, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
        """This rank's state of ``step`` (default: :meth:`latest`), saved by this rank of a job of this
        size (collective: any rank's failure is every rank's error). ``weights_only=False`` reads
        states holding other Python objects (only from a folder you trust)."""
        step = self._resolve(step)
        record, error = None, None
        if self.rank not in self._files(step).get(self.size, set()) and any(
                size != self.size and ranks == set(range(size)) for size, ranks in self._files(step).items()):
            error = (f"step {step} was saved by a job of {self.world_size(step)} ranks and this job has {self.size}: "
                     f"load_all({step}) gives every old rank's state, which SparseHookState.load_state_dict and "
                     "SparseSynchronizer.load_state_dict take as a list (the residuals are redistributed)")
        else:
            record, error = self._read(self.path(step), step, map_location, weights_only)
            if record is not None and record["world"] != {"size": self.size, "rank": self.rank}:
                error = f"{self.path(step)} records the world {record['world']}, not this rank's"
        self._verdict(error, step)
        assert record is not None
        return record["state"]

    def load_all(self, step: int | None = None, *, map_location: Any = "cpu",
                 weights_only: bool = True) -> list[dict[str, Any]]:
        """Every rank's state of ``step`` (default: :meth:`latest`) in the old ranks' order, for a job
        of another size (collective; every rank reads every file, so the folder must be shared)."""
        step = self._resolve(step)
        error = None
        states: list[dict[str, Any]] = []
        try:
            size = self.world_size(step)
        except CheckpointError as exc:
            size, error = 0, str(exc)
        for rank in range(size):
            record, error = self._read(self.path(step, rank, size), step, map_location, weights_only)
            if error is not None:
                break
            states.append(record["state"])
        self._verdict(error, step)
        return states

    def _resolve(self, step: int | None) -> int:
        if step is None:
            found = self.latest()
            if found is None:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return found
        return step

    def _verdict(self, error: str | None, step: int) -> None:
        rows = self._gather(error)
        failed = [r for r, text in enumerate(rows) if text is not None]
        if failed:
            details = "; ".join(f"rank {r}: {rows[r]}" for r in failed)
            raise CheckpointError(f"cannot load step {step} from {self.directory}: {details}")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep={self.keep})"
