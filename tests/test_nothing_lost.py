"""Nothing lost across a resume: a checkpoint restores every rank's residuals exactly, and gradient
mass is conserved across the resume.

A job stopped by a fault (a killed, stuck or frozen rank; see tests/faultsuite/fault_table.py) goes
on from its last checkpoint. Here the checkpoint is the synchronizer's ``state_dict`` written to bytes
and read back into a fresh synchronizer, as the training harness does. Checked on every rank, P = 3:

* the restored residuals equal the saved ones, bit for bit;
* the first step after the resume averages what the uninterrupted run averages, bit for bit;
* conservation over that step: sum over ranks of (gradient + residual restored) equals
  P x average + sum over ranks of the new residuals.
"""

import copy
import io

import pytest
import torch
from torch import nn

from sparsecomm import run_workers


def _residuals(sync) -> list[torch.Tensor]:
    residuals = sync.engine.residuals()
    return [residuals[pid].detach().clone() for pid in sorted(residuals)]


def _set_grads(model: nn.Module, seed: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    grads = []
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        grads.append(p.grad.detach().clone().reshape(-1))
    return grads


def _worker(method: str) -> dict:
    import torch.distributed as dist

    from sparsecomm import SparseSynchronizer

    rank, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    sync = SparseSynchronizer(model, None, method, density=0.1, bucket_elements=300)
    for step in range(3):
        _set_grads(model, step, rank)
        sync.synchronize()
    saved = io.BytesIO()
    torch.save(sync.state_dict(), saved)
    before = _residuals(sync)

    resumed_model = copy.deepcopy(model)
    resumed = SparseSynchronizer(resumed_model, None, method, density=0.1, bucket_elements=300,
                                 broadcast_parameters=False)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    grads = _set_grads(resumed_model, 3, rank)
    restored = _residuals(resumed) if resumed.engine.plan is not None else None
    resumed.synchronize()
    _set_grads(model, 3, rank)
    sync.synchronize()
    after = _residuals(resumed)

    averaged = torch.cat([p.grad.reshape(-1) for p in resumed_model.parameters()])
    uninterrupted = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    given = (torch.cat(grads).double() + torch.cat(before).double())
    kept = torch.cat(after).double()
    for tensor in (given, kept):
        dist.all_reduce(tensor)
    return {"before": before, "restored": restored, "same_step": torch.equal(averaged, uninterrupted),
            "conservation_error": float((given - (P * averaged.double() + kept)).abs().max()),
            "scale": float(given.abs().max())}


@pytest.mark.parametrize("method", ["topka", "spardl", "exdyna"])
def test_a_resume_restores_every_residual_and_conserves(method):
    for rank, result in enumerate(run_workers(3, _worker, method, timeout=120)):
        if result["restored"] is not None:
            assert len(result["restored"]) == len(result["before"])
            assert all(torch.equal(a, b) for a, b in zip(result["restored"], result["before"], strict=True)), \
                f"{method}, rank {rank}: a restored residual differs from the saved one"
        assert any(float(r.abs().sum()) > 0 for r in result["before"]), "the test saved no residual at all"
        assert result["same_step"], f"{method}, rank {rank}: the step after the resume differs from the uninterrupted"
        assert result["conservation_error"] <= 1e-5 * max(1.0, result["scale"]), \
            f"{method}, rank {rank}: conservation broken across the resume ({result['conservation_error']:g})"
