"""LARS (eq. 11 of Shi et al.): the update follows the formula, and with PTO (comm=) it equals the
update without PTO, for P = 1..4 and a number of layers no P > 1 divides."""

import pytest
import torch

from sparsecomm import LARS, Communicator, run_workers


def _params(count=13, seed=3):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 3, 3, 3), (8,), (16, 8, 3, 3), (16,), (10, 16), (10,), (5,)]
    return [torch.randn(shapes[i % len(shapes)], generator=gen).requires_grad_() for i in range(count)]


def _set_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=gen) if i != 4 else torch.zeros_like(p)  # one zero gradient


def test_one_step_follows_equation_11():
    params = _params(3)
    before = [p.detach().clone() for p in params]
    _set_grads(params, 0)
    lr, gamma, wd = 0.5, 0.02, 1e-3
    opt = LARS(params, lr=lr, momentum=0.0, weight_decay=wd, trust_coefficient=gamma, exclude=[params[1]])
    opt.step()
    for i, (p, w) in enumerate(zip(params, before, strict=True)):
        g = p.grad
        if i == 1:
            expected = w - lr * g
        else:
            rate = gamma * lr * w.norm() / (g.norm() + wd * w.norm())
            expected = w - rate * (g + wd * w)
        torch.testing.assert_close(p.detach(), expected)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="lr=0"):
        LARS(_params(1), lr=0)
    with pytest.raises(ValueError, match="trust_coefficient=-1"):
        LARS(_params(1), lr=0.1, trust_coefficient=-1)


def _lars_worker(steps):
    results = []
    for comm in (None, Communicator()):
        params = _params()
        opt = LARS(params, lr=0.1, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.01, exclude=[params[-1]],
                   comm=comm)
        for step in range(steps):
            _set_grads(params, step)
            opt.step()
        results.append([p.detach().clone() for p in params])
    return results


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_pto_gives_the_same_update(P):
    for rank, (plain, with_pto) in enumerate(run_workers(P, _lars_worker, 3, timeout=120)):
        for a, b in zip(plain, with_pto, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"rank {rank}, P={P}")
        assert any(not torch.equal(a, w) for a, w in zip(plain, _params(), strict=True))
