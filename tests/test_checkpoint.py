"""The training harness's checkpoints (``sparsecomm train --checkpoint-dir``, sparsecomm_lab.checkpoint):
the run's identity checked on resume, on every rank with the same message, on top of the library's
CheckpointManager (tests/test_checkpoint_manager.py)."""

import dataclasses
import os

import pytest
import torch

from sparsecomm import CheckpointManager, WorkerError, run_workers


def _small_config(tmp_path, **changes):
    from sparsecomm_lab.training import TrainConfig

    config = TrainConfig(model="mlp", data="digits", method="topk", density=0.1, workers=3, epochs=1,
                         batch_size=64, model_options={"hidden": [16]}, checkpoint_dir=str(tmp_path), timeout=120)
    return dataclasses.replace(config, **changes)


def _file(directory, epoch, rank, world=3):
    return os.path.join(str(directory), f"step-{epoch:012d}", f"rank-{rank:05d}-of-{world:05d}.pt")


def _resume_messages(directory):
    from sparsecomm_lab import checkpoint

    try:
        return checkpoint.resume(CheckpointManager(directory), {}, required=True).state["epoch"]
    except checkpoint.CheckpointError as exc:
        return str(exc)


def test_training_resume_refuses_checkpoints_of_another_method(tmp_path):
    from sparsecomm_lab.training import train

    config = _small_config(tmp_path, workers=2)
    train(config)
    assert sorted(os.listdir(tmp_path / "step-000000000001")) == [
        "rank-00000-of-00002.done", "rank-00000-of-00002.pt", "rank-00001-of-00002.done", "rank-00001-of-00002.pt"]
    with pytest.raises(WorkerError, match=r"method='topk' in the checkpoint, 'gtopk' in this run"):
        train(dataclasses.replace(config, method="gtopk", epochs=2, resume=True))


def test_a_file_of_another_run_among_the_ranks_is_an_error_on_every_rank(tmp_path):
    """Rank 2's file comes from a run with another seed; every rank raises the same error naming rank 2
    and the differing field."""
    import shutil

    from sparsecomm_lab.training import train

    train(_small_config(tmp_path / "a"))
    train(_small_config(tmp_path / "b", seed=1))
    shutil.copy(_file(tmp_path / "b", 1, 2), _file(tmp_path / "a", 1, 2))
    with pytest.raises(WorkerError, match=r"rank 2: the checkpoint was written by another run: seed=1 in the "
                                          r"checkpoint, 0 in this run"):
        train(_small_config(tmp_path / "a", epochs=2, resume=True))
    # without the run's configuration to compare with, the ranks' files are compared with each other
    messages = run_workers(3, _resume_messages, str(tmp_path / "a"), timeout=60)
    assert len(set(messages)) == 1, messages
    assert "rank 2 holds a checkpoint of another run than the others (seed=1 on rank 2, 0 on the others)" \
        in messages[0]
    with pytest.raises(WorkerError, match=r"batch_size=64 in the checkpoint, 32 in this run"):
        train(_small_config(tmp_path / "b", seed=1, epochs=2, resume=True, batch_size=32))


def test_a_changed_parameter_is_caught_by_the_checksum_on_every_rank(tmp_path):
    from sparsecomm_lab.training import train

    train(_small_config(tmp_path))
    path = _file(tmp_path, 1, 1)
    saved = torch.load(path, weights_only=False)
    next(iter(saved["state"]["model"].values())).view(-1)[0] += 1.0
    torch.save(saved, path)
    messages = run_workers(3, _resume_messages, str(tmp_path), timeout=60)
    assert len(set(messages)) == 1, messages
    assert "rank 1: its parameters do not match the checksum recorded when it was written" in messages[0]


def test_resume_auto_starts_afresh_then_resumes_exactly(tmp_path):
    from sparsecomm_lab.training import train

    fresh = train(_small_config(tmp_path / "auto", epochs=1, resume="auto"), keep_params=True)
    assert len(fresh["epochs"]) == 1
    resumed = train(_small_config(tmp_path / "auto", epochs=2, resume="auto"), keep_params=True)
    straight = train(_small_config(tmp_path / "straight", epochs=2), keep_params=True)
    assert len(resumed["epochs"]) == 2 and resumed["consistent"]
    for mine, theirs in zip(resumed["params"], straight["params"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    os.remove(_file(tmp_path / "auto", 2, 0))  # a committed epoch that lost a rank's file: damage
    with pytest.raises(WorkerError, match=r"step 2 was committed but rank 0 has no file of it"):
        train(_small_config(tmp_path / "auto", epochs=3, resume="auto"))


def test_resume_without_a_checkpoint_is_an_error_and_auto_starts_afresh(tmp_path):
    from sparsecomm_lab.training import train

    with pytest.raises(WorkerError, match=r"cannot resume: no complete checkpoint in"):
        train(_small_config(tmp_path, workers=2, resume=True))


@pytest.mark.slow
def test_a_run_resumes_in_a_job_of_another_size_with_the_residuals_redistributed(tmp_path):
    from sparsecomm_lab.training import train

    train(_small_config(tmp_path, workers=3, epochs=1))
    old = [torch.load(_file(tmp_path, 1, r), weights_only=False)["state"]["sync"] for r in range(3)]
    resumed = train(_small_config(tmp_path, workers=2, epochs=2, resume=True), keep_params=True)
    assert len(resumed["epochs"]) == 2 and resumed["consistent"]
    assert sorted(os.listdir(tmp_path)) == ["step-000000000002"]  # the old job's files went with the commit
    new = [torch.load(_file(tmp_path, 2, r, world=2), weights_only=False)["state"]["sync"] for r in range(2)]
    assert all(s["world"]["size"] == 2 for s in new) and all(s["iter"] > o["iter"] for s in new for o in old)
