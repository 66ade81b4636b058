"""AdamW under the synchronizer with the second moment frozen after the dense warm-up
(sparsecomm.integration.adam): the algorithm at density 1, the invariants at P = 1..8, exact resume."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparsecomm import run_workers
from sparsecomm.integration.synchronizer import SparseSynchronizer

WARMUP = 3
STEPS = 7
LR, BETAS, EPS, DECAY = 0.01, (0.9, 0.95), 1e-8, 0.1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=gen), torch.randint(3, (5,), generator=gen)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)


def _train(method, options, steps=STEPS, state=None, start=0, sync_options=None):
    """Train with the frozen-variance synchronizer; returns the parameters after each step and the
    states (synchronizer, optimizer, model) after the last."""
    torch.set_num_threads(1)
    model = _model()
    opt = _optimizer(model)
    sync = SparseSynchronizer(model, opt, method, dense_warmup_steps=WARMUP, bucket_elements=40,
                              freeze_adam_variance=True, **(sync_options or {}), **options)
    if state is not None:
        model.load_state_dict(torch.load(io.BytesIO(state[2])))
        opt.load_state_dict(torch.load(io.BytesIO(state[1])))
        sync.load_state_dict(torch.load(io.BytesIO(state[0]), weights_only=False))
    history = []
    for step in range(start, steps):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        sync.step()
        history.append([p.detach().clone() for p in model.parameters()])
    saved = []
    for obj in (sync.state_dict(), opt.state_dict(), model.state_dict()):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        saved.append(buffer.getvalue())
    return history, saved


def _reference(P, masked=False):
    """The algorithm in one process: AdamW on the averaged gradient for WARMUP steps, then AdamW's
    step with the second moment frozen at its value after step WARMUP (``masked``: after the freeze
    no momentum and no bias correction, as momentum correction's masking leaves at density 1)."""
    model = _model()
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    history = []
    for step in range(STEPS):
        grads = []
        for rank in range(P):
            model.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                g = sum(gr[i] for gr in grads) / P
                t = step + 1
                if masked and step >= WARMUP:
                    m[i] = torch.zeros_like(p)
                m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
                if step < WARMUP:
                    v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
                decay = DECAY if p.dim() >= 1 else 0.0
                p.mul_(1 - LR * decay)
                v_hat = v[i] / (1 - BETAS[1] ** min(t, WARMUP))
                corrected = m[i] if masked and step >= WARMUP else m[i] / (1 - BETAS[0] ** t)
                p.sub_(LR * corrected / (v_hat.sqrt() + EPS))
        history.append([p.detach().clone() for p in params])
    return history


@pytest.mark.parametrize("P", [1, 3])
def test_at_density_one_it_is_adamw_with_the_second_moment_frozen_after_the_warmup(P):
    results = run_workers(P, _train, "dense", {})
    reference = _reference(P)
    for step, expected in enumerate(reference):
        for rank in range(P):
            for got, want in zip(results[rank][0][step], expected, strict=True):
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (step, rank)


@pytest.mark.parametrize("P", [1, 3])
def test_with_momentum_correction_at_density_one_the_masking_leaves_no_momentum(P):
    results = run_workers(P, _train, "topka", {"density": 1.0}, STEPS, None, 0, {"momentum_correction": BETAS[0]})
    reference = _reference(P, masked=True)
    for step, expected in enumerate(reference):
        for got, want in zip(results[0][0][step], expected, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), step


#: the synchronizer's AdamW recipes: frozen variance alone, and with momentum correction (the recommended)
RECIPES = {"frozen": {}, "frozen+corrected": {"momentum_correction": BETAS[0]}}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("P", range(1, 9))
def test_replicas_stay_identical_and_the_sparse_run_moves_every_parameter(P, recipe):
    results = run_workers(P, _train, "topka", {"density": 0.1}, STEPS, None, 0, RECIPES[recipe])
    for step in range(STEPS):
        for rank in range(1, P):
            assert all(torch.equal(a, b) for a, b in zip(results[rank][0][step], results[0][0][step], strict=True))
    first, last = results[0][0][WARMUP - 1], results[0][0][-1]
    assert any(not torch.equal(a, b) for a, b in zip(first, last, strict=True))


def _resume_check(method, options, sync_options):
    full, _ = _train(method, options, sync_options=sync_options)
    _, saved = _train(method, options, steps=WARMUP + 2, sync_options=sync_options)
    resumed, _ = _train(method, options, state=saved, start=WARMUP + 2, sync_options=sync_options)
    return full[WARMUP + 2:], resumed


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("P", [1, 3, 5])
def test_resume_after_the_freeze_is_exact(P, recipe):
    for full, resumed in run_workers(P, _resume_check, "topka", {"density": 0.2}, RECIPES[recipe]):
        for a, b in zip(full, resumed, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _construct(optimizer, options):
    model = nn.Linear(3, 2)
    try:
        SparseSynchronizer(model, optimizer(model.parameters()), "topka", density=0.5, **options)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("optimizer, options, needle", [
    (lambda p: torch.optim.SGD(p, lr=0.1), {"dense_warmup_steps": 2}, "needs torch.optim.Adam or AdamW"),
    (lambda p: torch.optim.AdamW(p), {}, "dense_warmup_steps >= 1"),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), {"dense_warmup_steps": 2}, "amsgrad"),
    (lambda p: torch.optim.Adam(p, weight_decay=0.1), {"dense_warmup_steps": 2}, "weight_decay=0"),
    (lambda p: torch.optim.AdamW(p), {"dense_warmup_steps": 2, "momentum_correction": 0.5}, "give its beta1"),
])
def test_bad_combinations_are_refused_at_construction(optimizer, options, needle):
    (message,) = run_workers(1, _construct, optimizer, {"freeze_adam_variance": True, **options})
    assert message is not None and needle in message


def test_an_element_without_a_gradient_in_the_warmup_takes_its_parameters_median_moment():
    """An embedding row no warm-up batch touched has v = 0: its frozen scale is the median element's
    of its parameter, not 1 / eps (whose first step would throw the row far away)."""
    from sparsecomm.integration.adam import FrozenVarianceAdam

    param = nn.Parameter(torch.zeros(5))
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS)
    param.grad = torch.tensor([1.0, 0.0, 3.0, 0.0, 2.0])
    opt.step()
    frozen = FrozenVarianceAdam(opt, [param])
    frozen.freeze()
    scale = frozen._scales[0]
    assert torch.allclose(scale[[0, 2, 4]], 1 / (torch.tensor([1.0, 3.0, 2.0]) + EPS))
    assert torch.allclose(scale[[1, 3]], torch.full((2,), 1 / (2.0 + EPS)))  # the median of 1, 2, 3
    resumed = FrozenVarianceAdam(opt, [param])
    resumed.load_state_dict(frozen.state_dict())
    assert torch.equal(resumed._scales[0], scale)
