"""Replicas that start alike: the model and the configuration agreed across ranks in one small collective
before any work, one error on every rank naming the first difference, and the replicas' checksums after
the work."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparsecomm import ConfigMismatchError, SparseSynchronizer, check_same_config, replica_checksums, run_workers


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4)]
    if dist.get_rank() == 1 and kind == "extra_layer":
        layers += [nn.ReLU(), nn.Linear(4, 4)]
    if dist.get_rank() == 1 and kind == "same_numel":  # 600 + 30 + 120 + 4 elements, other shapes
        layers = [nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 6)]
    return nn.Sequential(*layers)


def _build_synchronizer(kind: str):
    start = time.monotonic()
    try:
        SparseSynchronizer(_model(kind), None, "topk", density=0.1)
        return "built", time.monotonic() - start
    except ConfigMismatchError as exc:
        return str(exc), time.monotonic() - start


@pytest.mark.parametrize("kind, expected", [
    ("extra_layer", "the ranks' models differ at tensor 4: rank 1 has '4.weight' (4, 4) float32, ranks 0, 2 have "
                    "none (it has 4 tensors)"),
    ("same_numel", "the ranks' models differ at tensor 0: rank 1 has '0.weight' (20, 30) float32, ranks 0, 2 have "
                   "'0.weight' (30, 20) float32"),
])
def test_a_model_that_differs_across_ranks_is_one_error_on_every_rank_before_any_broadcast(kind, expected):
    results = run_workers(3, _build_synchronizer, kind, timeout=60, stall_timeout=20)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    assert messages.pop().startswith(expected)
    assert max(seconds for _, seconds in results) < 15  # no timeout involved: one agreement, then the gather


def _agree_config(changes: dict):
    config = {"lr": 0.1, "epochs": 3, "batch_size": 32, "optimizer": {"name": "sgd", "momentum": 0.9}, "seed": 0}
    config.update(changes.get(dist.get_rank(), {}))
    try:
        check_same_config(config, what="training configuration")
        return "agreed"
    except ConfigMismatchError as exc:
        return str(exc), exc.ranks


def test_check_same_config_names_the_first_difference_on_every_rank():
    assert run_workers(3, _agree_config, {}, timeout=60) == ["agreed"] * 3
    results = run_workers(3, _agree_config, {1: {"lr": 0.2, "epochs": 4}}, timeout=60)
    assert len(set(map(str, results))) == 1
    message, ranks = results[0]
    assert message == ("the ranks' training configurations differ: lr: rank 1 has 0.2, ranks 0, 2 have 0.1 (and 1 "
                       "more: epochs); every rank must run with the same training configuration")
    assert ranks == [1]
    message, _ = run_workers(2, _agree_config, {1: {"optimizer": {"name": "sgd", "momentum": 0.0}}}, timeout=60)[0]
    assert 'optimizer: rank 1 has {"momentum": 0.0, "name": "sgd"}, rank 0 has {"momentum": 0.9, "name": "sgd"}' \
        in message


def _checksums(differ: bool):
    model = _model("")
    if differ and dist.get_rank() == 2:
        with torch.no_grad():
            model[0].weight[0, 0] += 1
    return replica_checksums(model)


def test_replica_checksums_tell_equal_replicas_from_drifted_ones():
    equal = run_workers(3, _checksums, False, timeout=60)
    assert all(row == equal[0] for row in equal) and len(set(equal[0])) == 1
    drifted = run_workers(3, _checksums, True, timeout=60)[0]
    assert drifted[0] == drifted[1] != drifted[2]


def _train_with_lr(lrs):
    from sparsecomm_lab.data import load_dataset
    from sparsecomm_lab.training import TrainConfig, train_worker

    config = TrainConfig(model="mlp", data="digits", method="topk", density=0.1, workers=3, epochs=1, batch_size=64,
                         lr=lrs[dist.get_rank()], model_options={"hidden": [16]})
    try:
        return train_worker(config, load_dataset("digits", seed=0))["consistent"]
    except ConfigMismatchError as exc:
        return str(exc)


def test_sparsecomm_train_agrees_on_its_configuration_before_the_first_step():
    messages = run_workers(3, _train_with_lr, [0.1, 0.2, 0.1], timeout=120)
    assert len(set(messages)) == 1
    assert messages[0].startswith("the ranks' training configurations differ: lr: rank 1 has 0.2, ranks 0, 2 have 0.1")
    # (an equal configuration trains, and its record says consistent: tests/test_checkpoint.py)


@pytest.mark.slow
def test_the_record_says_inconsistent_when_the_replicas_drift():
    from sparsecomm_lab.training import TrainConfig, train

    record = train(TrainConfig(model="mlp", data="digits", method="nosync", workers=2, epochs=1, batch_size=64,
                               model_options={"hidden": [16]}))
    assert record["consistent"] is False  # the floor exchanges nothing: the replicas drift apart


def test_the_checksum_covers_zero_dimensional_buffers():
    from sparsecomm.integration.consistency import parameter_checksum

    model = torch.nn.BatchNorm1d(3)  # its num_batches_tracked is a 0-dim integer buffer
    before = parameter_checksum(model)
    model.num_batches_tracked += 1
    assert parameter_checksum(model) != before
