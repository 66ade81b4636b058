"""sparsecomm.CheckpointManager: atomic per-rank files, a step committed only when every rank has written
it, and a resume from the newest step every rank holds, whatever moment of a save a kill -9 hit."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

import sparsecomm.integration.checkpoint as ck
from sparsecomm import CheckpointError, CheckpointManager, WorkerError, run_workers

P = 3


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Make this process die (SIGKILL) at ``point`` of its next save."""
    if point == "before_write":  # the other ranks write theirs: the kill falls between the ranks' writes
        ck.write_atomically = lambda path, write: _die()
    elif point == "mid_write":  # half a file written, not yet renamed into place
        def torn(obj, handle):
            handle.write(b"half a checkpoint")
            handle.flush()
            _die()
        ck.torch.save = torn
    elif point == "before_commit":  # this rank's file is whole, the ranks have not exchanged yet
        ck.gather = lambda value, group=None: _die()
    elif point == "after_marker":  # committed and marked, the older step not yet deleted
        ck.CheckpointManager._prune = lambda self, newest: _die()
    elif point == "mid_prune":
        ck.shutil.rmtree = lambda *args, **kwargs: _die()


def _save(directory: str, point: str | None, victim: int) -> None:
    manager = CheckpointManager(directory)
    rank = dist.get_rank()
    for step in (1, 2):
        if step == 2 and point is not None and rank == victim:
            _arm(point)
        manager.save(step, {"step": step, "rank": rank, "x": torch.full((4,), float(10 * step + rank))})


def _resume(directory: str):
    manager = CheckpointManager(directory)
    step = manager.latest()
    if step is None:
        return None
    state = manager.load(step)
    leftovers = sorted(name for folder in os.listdir(directory)
                       for name in os.listdir(os.path.join(directory, folder)) if name.endswith(".tmp"))
    return step, state["step"], state["rank"], float(state["x"][0]), leftovers


@pytest.mark.parametrize("point, victim", [
    ("before_write", 1),   # between the ranks' writes
    ("mid_write", 2),
    ("after_marker", 1),
    pytest.param("before_commit", 0, marks=pytest.mark.slow),
    pytest.param("mid_prune", 2, marks=pytest.mark.slow),
])
def test_a_kill_at_any_moment_of_a_save_leaves_every_rank_at_the_same_step(tmp_path, point, victim):
    with pytest.raises(WorkerError, match=f"rank {victim}"):
        run_workers(P, _save, str(tmp_path), point, victim, timeout=60, stall_timeout=20)
    resumed = run_workers(P, _resume, str(tmp_path), timeout=60)
    steps = {r[0] for r in resumed}
    assert len(steps) == 1, resumed
    step = steps.pop()
    for rank, (_, saved_step, saved_rank, x, leftovers) in enumerate(resumed):
        assert (saved_step, saved_rank, x) == (step, rank, 10.0 * step + rank)
        assert leftovers == []
    if point in ("before_write", "mid_write"):
        assert step == 1  # the victim never wrote step 2: step 1 was kept on every rank
    if point in ("after_marker", "mid_prune"):
        assert step == 2  # every rank had written step 2 before the commit


def test_an_unfinished_first_save_starts_afresh_but_a_lost_committed_file_is_an_error(tmp_path):
    with pytest.raises(WorkerError):
        run_workers(P, _save_first_only, str(tmp_path), timeout=60, stall_timeout=20)
    assert run_workers(P, _resume, str(tmp_path), timeout=60) == [None] * P
    assert os.listdir(tmp_path) == []  # the uncommitted files are gone
    run_workers(P, _save, str(tmp_path), None, 0, timeout=60)
    os.remove(os.path.join(tmp_path, "step-000000000002", "rank-00001-of-00003.pt"))
    messages = run_workers(P, _resume_message, str(tmp_path), timeout=60)
    assert len(set(messages)) == 1
    assert "step 2 was committed but rank 1 has no file of it" in messages[0]


def _save_first_only(directory: str) -> None:
    if dist.get_rank() == 1:
        _arm("before_write")
    CheckpointManager(directory).save(1, {"step": 1})


def _resume_message(directory: str) -> str:
    try:
        CheckpointManager(directory).latest()
        return "resumed"
    except CheckpointError as exc:
        return str(exc)


def _save_failing(directory: str) -> str:
    manager = CheckpointManager(directory)
    manager.save(1, {"x": 1})
    if dist.get_rank() == 2:
        def full(obj, handle):
            raise OSError(28, "No space left on device")
        ck.torch.save = full
    try:
        manager.save(2, {"x": 2})
        return "saved"
    except CheckpointError as exc:
        return f"{exc} | latest {manager.latest()}"


def test_a_rank_that_cannot_write_is_an_error_on_every_rank_and_keeps_the_previous_step(tmp_path):
    messages = run_workers(P, _save_failing, str(tmp_path), timeout=60)
    assert len(set(messages)) == 1, messages
    assert "step 2 could not be saved" in messages[0]
    assert "rank 2 could not write its file (rank 2: OSError: [Errno 28] No space left on device)" in messages[0]
    assert "the previous checkpoint (step 1) is kept | latest 1" in messages[0]


def test_keep_and_a_job_of_another_size_reads_every_old_rank(tmp_path):
    def save(directory):
        manager = CheckpointManager(directory, keep=2)
        for step in (1, 2, 3):
            manager.save(step, {"rank": dist.get_rank(), "step": step})
        return sorted(os.listdir(directory))

    assert run_workers(P, save, str(tmp_path), timeout=60)[0] == ["step-000000000002", "step-000000000003"]

    def load(directory):
        manager = CheckpointManager(directory)
        step = manager.latest()
        message = None
        try:
            manager.load(step)
        except CheckpointError as exc:
            message = str(exc)
        return step, manager.world_size(step), [s["rank"] for s in manager.load_all(step)], message

    for step, size, ranks, message in run_workers(2, load, str(tmp_path), timeout=60):
        assert (step, size, ranks) == (3, P, [0, 1, 2])
        assert "step 3 was saved by a job of 3 ranks and this job has 2: load_all(3)" in message
    # a folder that is not shared: no rank sees every old rank's file; never a silent fresh start
    for step in (2, 3):
        os.remove(os.path.join(tmp_path, f"step-{step:012d}", "rank-00002-of-00003.pt"))
    messages = run_workers(2, _resume_message, str(tmp_path), timeout=60)
    assert len(set(messages)) == 1
    assert "it holds steps [2, 3] of a job of another size, but no rank sees every old rank's file" in messages[0]


def test_an_unwritable_folder_is_refused_at_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        CheckpointManager(blocker / "ck")
    with pytest.raises(ValueError, match="keep=0 must be an integer >= 1"):
        CheckpointManager(tmp_path, keep=0)
