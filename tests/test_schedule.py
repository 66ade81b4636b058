"""Method schedules (Shi et al., section 5.6): a switch mid-run loses nothing and resumes exactly."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from sparsecomm_lab.training import TrainConfig, train
from torch import nn

from sparsecomm import run_workers
from sparsecomm.integration.schedule import MethodSchedule, ResidualCarry
from sparsecomm.integration.synchronizer import SparseSynchronizer


def test_parse_and_method_at():
    schedule = MethodSchedule.parse("hitopk", "3:torus2d, 5:dense")
    assert schedule.switches == ((3, "torus2d"), (5, "dense"))
    assert [schedule.method_at(e) for e in range(7)] == ["hitopk"] * 3 + ["torus2d"] * 2 + ["dense"] * 2
    assert schedule.methods == ["hitopk", "torus2d", "dense"]
    assert str(schedule) == "0:hitopk,3:torus2d,5:dense"
    assert MethodSchedule.parse("topka", None).method_at(9) == "topka"


@pytest.mark.parametrize("spec,match", [
    ("torus2d", "must read EPOCH:METHOD"),
    ("x:dense", "must read EPOCH:METHOD"),
    ("0:dense", "must be an integer >= 1"),
    ("3:dense,2:topka", "larger than the previous switch's"),
    ("2:nope", "unknown method 'nope'"),
])
def test_bad_schedule_is_named(spec, match):
    with pytest.raises(ValueError, match=match):
        MethodSchedule.parse("topka", spec)


def test_train_config_rejects_schedules_it_cannot_run():
    with pytest.raises(ValueError, match="switches at epoch 4, but the run has only epochs 0..1"):
        TrainConfig(method="topka", epochs=2, schedule="4:dense").validate()
    with pytest.raises(ValueError, match="torch DDP baseline"):
        TrainConfig(method="ddp", schedule="1:dense").validate()


def test_carry_adds_once_and_checks_shape():
    carry = ResidualCarry()
    carry.put("a", torch.ones(3))
    carry.put("a", torch.ones(3))
    carry.put("b", None)
    assert len(carry) == 1
    assert torch.equal(carry.flush_into("a", torch.zeros(3)), torch.full((3,), 2.0))
    assert torch.equal(carry.flush_into("a", torch.zeros(3)), torch.zeros(3))  # flushed once
    carry.put("a", torch.ones(2))
    with pytest.raises(ValueError, match="does not fit the gradient"):
        carry.flush_into("a", torch.zeros(3))


def _switching_run(first, second, steps_before, steps_after):
    """Fixed per-rank gradients through a synchronizer that switches method; returns what each rank put
    in, what came out, and what is still held (residuals and carried residuals)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    sync = SparseSynchronizer(model, None, first, bucket_elements=30, density=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    given, averaged = torch.zeros(0), torch.zeros(0)
    for step in range(steps_before + steps_after):
        if step == steps_before:
            sync.switch_method(second, **({"density": 0.2} if second != "dense" else {}))
        grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        sync.synchronize()
        flat_in = torch.cat([g.reshape(-1) for g in grads])
        flat_out = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        given = flat_in if step == 0 else given + flat_in
        averaged = flat_out if step == 0 else averaged + flat_out
    held = sum(float(m.residual.sum()) for m in sync.methods if m.residual is not None)
    held += sum(float(t.sum()) for t in sync.carry.waiting.values())
    return float(given.sum()), averaged, held, sync.method_name


@pytest.mark.parametrize("second", ["dense", "spardl"])
@pytest.mark.parametrize("P", [1, 3])
def test_switch_conserves_every_contribution(P, second):
    results = run_workers(P, _switching_run, "topka", second, 3, 2)
    total_in = sum(r[0] for r in results)
    out = results[0][1]
    assert all(torch.equal(r[1], out) for r in results)  # replicas agree across the switch
    assert all(r[3] == second for r in results)
    # Conservation: everything put in is either averaged out (P copies) or still held somewhere.
    assert P * float(out.sum()) + sum(r[2] for r in results) == pytest.approx(total_in, rel=1e-4, abs=1e-3)
    if second == "dense":
        assert all(r[2] == 0 for r in results)  # the dense method flushed every residual


def test_switch_to_unknown_method_leaves_synchronizer_unchanged():
    def body():
        model = nn.Linear(3, 2)
        sync = SparseSynchronizer(model, None, "topka", density=0.5)
        with pytest.raises(ValueError, match="unknown method"):
            sync.switch_method("nope")
        return sync.method_name

    assert run_workers(2, body) == ["topka", "topka"]


# constant lr: the first part of the resumed run is stopped by giving it fewer epochs
SMALL = TrainConfig(model="mlp", data="digits", workers=2, epochs=3, batch_size=32, density=0.05,
                    lr_schedule="constant", method="topka", schedule="2:dense", model_options={"hidden": [32]})


@pytest.mark.parametrize("sync", ["synchronizer", "ddp"])
def test_resume_across_a_switch_matches_uninterrupted(tmp_path, sync):
    config = dataclasses.replace(SMALL, sync=sync)
    straight = train(config, keep_params=True)
    assert straight["consistent"]
    ckpt = str(tmp_path / "ckpt")
    train(dataclasses.replace(config, epochs=2, schedule=None, checkpoint_dir=ckpt))  # stops before the switch
    resumed = train(dataclasses.replace(config, checkpoint_dir=ckpt, resume=True), keep_params=True)
    for rank in range(config.workers):
        for a, b in zip(straight["params"][rank], resumed["params"][rank], strict=True):
            assert torch.equal(a, b)
    assert straight["epochs"][-1]["density"] == 1.0  # the last epoch ran dense


class _Linear(nn.Module):
    """loss = <weight, c>: the gradient is exactly the c each rank chooses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(40))
        self.b = nn.Parameter(torch.zeros(25))

    def forward(self, ca: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        return (self.a * ca).sum() + (self.b * cb).sum()


def _hook_switching_run(steps_before, steps_after):
    from sparsecomm.integration.hook import SparseHookState, hook

    model = nn.parallel.DistributedDataParallel(_Linear(), bucket_cap_mb=0.0001)
    state = SparseHookState(None, "topka", density=0.1)
    model.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    given, averaged = 0.0, torch.zeros(65)
    for step in range(steps_before + steps_after):
        if step == steps_before:
            state.switch_method("dense")
        ca, cb = torch.randn(40, generator=gen), torch.randn(25, generator=gen)
        model.zero_grad()
        model(ca, cb).backward()
        given += float(ca.sum() + cb.sum())
        averaged += torch.cat([model.module.a.grad, model.module.b.grad])
    state.close()
    held = sum(float(r.sum()) for r in state.residuals().values())
    return given, averaged, held + sum(float(t.sum()) for t in state.carry.waiting.values())


@pytest.mark.parametrize("P", [2, 3])
def test_hook_switch_conserves_every_contribution(P):
    results = run_workers(P, _hook_switching_run, 3, 2)
    assert all(torch.equal(r[1], results[0][1]) for r in results)
    assert all(r[2] == 0 for r in results)  # dense after the switch: nothing held anywhere
    assert P * float(results[0][1].sum()) == pytest.approx(sum(r[0] for r in results), rel=1e-4, abs=1e-3)


def test_cli_refuses_a_bad_schedule_before_workers(capsys):
    from sparsecomm.cli import main

    assert main(["train", "--method", "topka", "--schedule", "3:nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown method 'nope'" in err
