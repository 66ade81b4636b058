"""GradScaler under the sparse hook follows plain DDP (issue 23, item 1): the hook's default
non-finite policy ("propagate") gives every rank a non-finite result when any rank overflows, so
GradScaler skips the step and halves its scale; nothing is sent and no state moves."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsecomm
from sparsecomm import run_workers

OVERFLOW_STEPS = (1, 3, 4)


def _scale_trajectory(method, steps=6):
    """Scale after each step and whether each rank's replicas stayed finite and equal."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = None
    if method != "ddp":
        options = {"density": 0.1} if method != "dense" else {}
        state = sparsecomm.SparseHookState(None, method, **options)
        ddp.register_comm_hook(state, sparsecomm.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1000)
    scales, residuals_kept = [], []
    for step in range(steps):
        x = torch.randn(8, 20, generator=torch.Generator().manual_seed(step * 10 + rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(x).float().pow(2).mean()
        if step in OVERFLOW_STEPS and rank == dist.get_world_size() - 1:
            loss = loss * float("inf")  # an fp16 overflow on one rank
        before = None if state is None else {k: v.clone() for k, v in state.residuals().items()}
        weights = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if step in OVERFLOW_STEPS:
            moved = any(not torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))
            kept = before is None or all(torch.equal(before[k], v) for k, v in state.residuals().items())
            residuals_kept.append((not moved) and kept)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return scales, residuals_kept, params


@pytest.mark.parametrize("method", ["topk", "spardl", "dense"])
def test_gradscaler_scale_under_the_hook_follows_plain_ddp(method):
    reference = run_workers(2, _scale_trajectory, "ddp", timeout=120)
    results = run_workers(2, _scale_trajectory, method, timeout=120)
    expected = reference[0][0]
    assert [expected[s] for s in OVERFLOW_STEPS] == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13]
    for scales, kept, params in results:
        assert scales == expected
        assert all(kept), kept  # no weight moved (momentum, weight decay included), residuals untouched
        assert torch.isfinite(params).all()
    assert torch.equal(results[0][2], results[1][2])


def _synchronizer_momentum(policy):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(30, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0)
    sync = sparsecomm.SparseSynchronizer(model, optimizer, "topk", density=0.2, momentum_correction=0.9,
                                         nonfinite=policy)
    out = []
    for step in range(3):
        loss = model(torch.randn(4, 30, generator=torch.Generator().manual_seed(step + rank))).pow(2).mean()
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        optimizer.zero_grad()
        loss.backward()
        velocity = sync.corrections[0].velocity
        before = None if velocity is None else velocity.clone()
        sync.synchronize()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        out.append((bool(torch.isnan(grads).all()), before is None or torch.equal(before, sync.corrections[0].velocity),
                    bool(torch.isfinite(sync.corrections[0].velocity).all())))
    return out


def test_the_synchronizers_momentum_buffer_is_never_poisoned():
    for steps in run_workers(2, _synchronizer_momentum, "propagate", timeout=60):
        assert steps[1] == (True, True, True)          # NaN result, velocity as before the step, finite
        assert steps[2][0] is False and steps[2][2]     # the next step trains normally
        assert not steps[0][0]
