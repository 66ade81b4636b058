"""Checkpoints (issue 16): atomic writes, metadata checked on load, and a collective resume that
raises the same clear error on every rank when the ranks' checkpoints do not match."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from sparsecomm_lab import checkpoint as ckpt
from sparsecomm_lab.checkpoint import (
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)

from sparsecomm import WorkerError, run_workers

META = {"method": "topk", "options": {"density": 0.1}, "world_size": 3}


def test_save_is_atomic_a_crash_while_writing_keeps_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "rank0.pt")
    save_checkpoint(path, {"epoch": 1, "x": torch.arange(4)}, META)

    def torn_save(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"epoch": 2}, META)
    assert load_checkpoint(path, META)["epoch"] == 1
    assert os.listdir(tmp_path) == ["rank0.pt"]  # no temporary file left behind


def test_load_checks_method_options_and_world_size(tmp_path):
    path = str(tmp_path / "rank0.pt")
    save_checkpoint(path, {"epoch": 1}, META)
    assert load_checkpoint(path, META)["meta"] == META
    with pytest.raises(CheckpointError, match=r"method='topk' in the checkpoint, 'spardl' in this run"):
        load_checkpoint(path, {**META, "method": "spardl"})
    with pytest.raises(CheckpointError, match=r"options=\{'density': 0.1\} in the checkpoint, \{'density': 0.2\}"):
        load_checkpoint(path, {**META, "options": {"density": 0.2}})
    with pytest.raises(CheckpointError, match=r"world_size=3 in the checkpoint, 4 in this run; resume with the"):
        load_checkpoint(path, {**META, "world_size": 4})
    torch.save({"epoch": 1}, path)
    with pytest.raises(CheckpointError, match="not a sparsecomm checkpoint"):
        load_checkpoint(path, META)


def _write(directory, epochs, world):
    rank = dist.get_rank()
    if epochs[rank] is not None:
        save_checkpoint(checkpoint_path(directory, rank), {"epoch": epochs[rank], "step": 10 * epochs[rank]},
                        {**META, "world_size": world})


def _resume(directory, world):
    try:
        return resume_checkpoint(directory, {**META, "world_size": world})["epoch"]
    except CheckpointError as exc:
        return str(exc)


def test_resume_agrees_when_every_rank_loaded_the_same_epoch(tmp_path):
    run_workers(3, _write, str(tmp_path), [2, 2, 2], 3, timeout=60)
    assert run_workers(3, _resume, str(tmp_path), 3, timeout=60) == [2, 2, 2]


def test_ranks_at_different_epochs_raise_the_same_error_everywhere(tmp_path):
    run_workers(3, _write, str(tmp_path), [2, 1, 2], 3, timeout=60)
    messages = run_workers(3, _resume, str(tmp_path), 3, timeout=60)
    assert len(set(messages)) == 1
    assert "different points of training (rank 0: epoch 2 step 20, rank 1: epoch 1 step 10, rank 2: epoch 2 step 20)" \
        in messages[0]


def test_a_missing_or_torn_file_is_named_on_every_rank(tmp_path):
    run_workers(3, _write, str(tmp_path), [1, None, 1], 3, timeout=60)
    messages = run_workers(3, _resume, str(tmp_path), 3, timeout=60)
    assert all("rank 1 has no checkpoint file" in m for m in messages)
    with open(checkpoint_path(str(tmp_path), 1), "wb") as handle:
        handle.write(b"torn")
    messages = run_workers(3, _resume, str(tmp_path), 3, timeout=60)
    assert all("rank 1 cannot read its checkpoint" in m for m in messages)


def test_a_world_size_change_is_a_clear_error_on_every_rank(tmp_path):
    run_workers(2, _write, str(tmp_path), [1, 1], 2, timeout=60)
    messages = run_workers(3, _resume, str(tmp_path), 3, timeout=60)
    assert all("rank 2 has no checkpoint file; ranks 0, 1 hold checkpoints of another run; checkpoints written "
               "by 2 ranks, this run has 3" in m for m in messages)
    assert "world_size=2 in the checkpoint, 3 in this run" in messages[0]


def test_training_resume_refuses_checkpoints_of_another_method(tmp_path):
    from sparsecomm_lab.training import TrainConfig, train

    config = TrainConfig(model="mlp", data="digits", method="topk", density=0.1, workers=2, epochs=1,
                         batch_size=64, model_options={"hidden": [16]}, checkpoint_dir=str(tmp_path), timeout=120)
    train(config)
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt", "rank1.pt"]
    with pytest.raises(WorkerError, match=r"method='topk' in the checkpoint, 'gtopk' in this run"):
        train(dataclasses.replace(config, method="gtopk", epochs=2, resume=True))


def _small_config(tmp_path, **changes):
    from sparsecomm_lab.training import TrainConfig

    config = TrainConfig(model="mlp", data="digits", method="topk", density=0.1, workers=3, epochs=1,
                         batch_size=64, model_options={"hidden": [16]}, checkpoint_dir=str(tmp_path), timeout=120)
    return dataclasses.replace(config, **changes)


def test_a_file_of_another_run_among_the_ranks_is_an_error_on_every_rank(tmp_path):
    """Issue 23, item 3: rank 2's file comes from a run with another seed; every rank raises the same
    error naming rank 2 and the differing field (before, the run went on with rank 2's model apart)."""
    import shutil

    from sparsecomm_lab.training import train

    train(_small_config(tmp_path / "a"))
    train(_small_config(tmp_path / "b", seed=1))
    shutil.copy(tmp_path / "b" / "rank2.pt", tmp_path / "a" / "rank2.pt")
    with pytest.raises(WorkerError, match=r"rank 2 holds a checkpoint of another run \(rank 2: .*rank2.pt was "
                                          r"written by another run: seed=1 in the checkpoint, 0 in this run\)"):
        train(_small_config(tmp_path / "a", epochs=2, resume=True))
    # without the run's configuration to compare with, the ranks' files are compared with each other
    messages = run_workers(3, _resume_messages, str(tmp_path / "a"), timeout=60)
    assert len(set(messages)) == 1, messages
    assert "rank 2 holds a checkpoint of another run than the others (seed=1 on rank 2, 0 on the others)" \
        in messages[0]
    with pytest.raises(WorkerError, match=r"batch_size=64 in the checkpoint, 32 in this run"):
        train(_small_config(tmp_path / "b", seed=1, epochs=2, resume=True, batch_size=32))


def _resume_messages(directory):
    try:
        return resume_checkpoint(directory, {})["epoch"]
    except CheckpointError as exc:
        return str(exc)


def test_a_changed_parameter_is_caught_by_the_checksum_on_every_rank(tmp_path):
    from sparsecomm_lab.training import train

    train(_small_config(tmp_path))
    path = checkpoint_path(str(tmp_path), 1)
    saved = torch.load(path, weights_only=False)
    next(iter(saved["model"].values())).view(-1)[0] += 1.0
    torch.save(saved, path)
    messages = run_workers(3, _resume_messages, str(tmp_path), timeout=60)
    assert len(set(messages)) == 1, messages
    assert "rank 1 cannot read its checkpoint" in messages[0]
    assert "do not match the checksum recorded when it was written" in messages[0]


def test_resume_auto_starts_afresh_then_resumes_exactly(tmp_path):
    from sparsecomm_lab.training import train

    fresh = train(_small_config(tmp_path / "auto", epochs=1, resume="auto"), keep_params=True)
    assert len(fresh["epochs"]) == 1
    resumed = train(_small_config(tmp_path / "auto", epochs=2, resume="auto"), keep_params=True)
    straight = train(_small_config(tmp_path / "straight", epochs=2), keep_params=True)
    assert len(resumed["epochs"]) == 2 and resumed["consistent"]
    for mine, theirs in zip(resumed["params"], straight["params"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    os.remove(checkpoint_path(str(tmp_path / "auto"), 0))
    with pytest.raises(WorkerError, match="rank 0 has no checkpoint file while the others do"):
        train(_small_config(tmp_path / "auto", epochs=3, resume="auto"))
