"""The non-finite policy of the DDP hook and the synchronizer on the grouping engine: one policy for
every method the engine builds (sparse groups, the dense group, the warm-up), the rest of a step
short-circuited once a group overflowed, no state moved, and the hook's errors reaching backward() as
the library's own exception."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsecomm
from sparsecomm import run_workers
from sparsecomm.methods.checks import NonFiniteGradientError

NAN_STEPS = (0, 2)  # step 0 falls in the dense warm-up


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 1))


def _loss(model, step, rank):
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(10 * step + rank))
    loss = model(x).pow(2).mean()
    if step in NAN_STEPS and rank == 1:
        loss = loss * float("nan")
    return loss


def _hook_steps(overlap):
    rank = dist.get_rank()
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    state = sparsecomm.SparseHookState(None, "topk", density=0.1, dense_below=1000, dense_warmup_steps=1,
                                       overlap=overlap)
    ddp.register_comm_hook(state, sparsecomm.hook)
    steps = []
    for step in range(4):
        before = {k: v.clone() for k, v in state.residuals().items()}
        model.zero_grad()
        _loss(ddp, step, rank).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        kept = bool(before) and all(torch.equal(before[k], v) for k, v in state.residuals().items())
        stats = state.take_stats()
        steps.append((bool(torch.isnan(grads).all()), bool(torch.isfinite(grads).all()), kept,
                      stats.skipped, stats.calls))
    groups = state.engine.groups
    policies = {g.method.nonfinite for g in groups} | {state.engine._warmup_method.nonfinite}
    return steps, len(groups), sum(g.dense for g in groups), policies, state.state_dict()["nonfinite"]


@pytest.mark.parametrize("overlap", [True, False])
def test_every_group_of_the_hook_propagates_and_the_rest_of_the_step_makes_no_call(overlap):
    for steps, groups, dense, policies, saved in run_workers(2, _hook_steps, overlap, timeout=120):
        assert groups >= 3 and dense == 1       # several sparse groups and the dense group
        assert policies == {"propagate"} and saved == "propagate"
        for step, (all_nan, finite, kept, skipped, calls) in enumerate(steps):
            if step in NAN_STEPS:
                # NaN everywhere; the first call skipped, every later group short-circuited
                assert all_nan and skipped == 1 and calls == 1, (step, steps)
                assert kept or step == 0, (step, steps)  # no residual moved (none exist before step 1)
            else:
                assert finite and skipped == 0 and calls >= 2, (step, steps)


def _hook_error(overlap):
    rank = dist.get_rank()
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    state = sparsecomm.SparseHookState(None, "topk", density=0.1, nonfinite="error", overlap=overlap)
    ddp.register_comm_hook(state, sparsecomm.hook)
    _loss(ddp, 1, rank).backward()
    try:
        _loss(ddp, 2, rank).backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("overlap", [True, False])
def test_a_hook_error_reaches_backward_as_the_librarys_own_exception(overlap):
    for name, message in run_workers(2, _hook_error, overlap, timeout=60):
        assert name == NonFiniteGradientError.__name__, (name, message)
        assert message.startswith("topk: NaN/Inf in the gradient of rank 1"), message
        assert "Unable to cast" not in message and "earlier bucket" not in message


def _synchronizer_steps(policy):
    rank = dist.get_rank()
    model = _model()
    sync = sparsecomm.SparseSynchronizer(model, None, "topk", density=0.1, bucket_elements=5000, nonfinite=policy)
    out = []
    for step in range(4):
        if step == 2:
            sync.switch_method("topka", density=0.2)  # residuals carried to each bucket's next gradient
        before = [g.residual.clone() for g in sync.engine.groups]
        carried = len(sync.carry)
        model.zero_grad()
        _loss(model, step, rank).backward()
        stats = sync.synchronize()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        kept = all(torch.equal(b, g.residual) for b, g in zip(before, sync.engine.groups, strict=True))
        out.append((bool(torch.isnan(grads).all()), bool((grads == 0).all()), kept, stats.skipped, stats.calls,
                    carried, len(sync.carry)))
    return out, len(sync.engine.groups), sync.nonfinite


@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_the_synchronizer_short_circuits_its_buckets_and_keeps_the_carry_of_a_dropped_step(policy):
    for steps, buckets, nonfinite in run_workers(2, _synchronizer_steps, policy, timeout=60):
        assert buckets >= 3 and nonfinite == policy
        for step, (all_nan, all_zero, kept, skipped, calls, carried, left) in enumerate(steps):
            if step in NAN_STEPS:
                assert (all_nan if policy == "propagate" else all_zero) and kept, (step, steps)
                assert skipped == 1 and calls == 1, (step, steps)
                assert left == carried, (step, steps)  # a carried residual waits for the next step
            else:
                assert not all_nan and skipped == 0 and calls == buckets and left == 0, (step, steps)
        assert steps[3][5] == buckets  # the switch's residuals survived the dropped step 2 ...
        assert steps[3][6] == 0        # ... and reached the method at step 3


def test_the_synchronizer_refuses_nan_by_default():
    def run():
        model = _model()
        sync = sparsecomm.SparseSynchronizer(model, None, "topk", density=0.1)
        model.zero_grad()
        _loss(model, 0, dist.get_rank()).backward()
        try:
            sync.synchronize()
        except NonFiniteGradientError as exc:
            return sync.nonfinite, str(exc)
        return sync.nonfinite, "no error"

    for policy, message in run_workers(2, run, timeout=60):
        assert policy == "error" and "NaN/Inf in the gradient of rank 1" in message
