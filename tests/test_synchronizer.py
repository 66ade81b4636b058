"""SparseSynchronizer: the average gradient without DDP, the DGC options, clear errors."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparsecomm import available_methods, run_workers
from sparsecomm.integration.synchronizer import SparseSynchronizer
from sparsecomm.methods import method_class

SPARSE = [m for m in available_methods() if method_class(m).sparse]


def _model():
    torch.manual_seed(dist.get_rank())  # different on purpose: the synchronizer broadcasts rank 0's
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))


def _grads(method, options, sync_options):
    model = _model()
    sync = SparseSynchronizer(model, None, method, bucket_elements=20, **sync_options, **options)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 6, generator=gen), torch.randint(2, (4,), generator=gen)
    nn.functional.cross_entropy(model(x), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    stats = sync.synchronize()
    return local, [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()], \
        stats, len(sync.buckets)


@pytest.mark.parametrize("method,options", [("dense", {})] + [(m, {"density": 1.0, **method_class(m).exact_options})
                                            for m in SPARSE])
def test_synchronized_gradient_is_the_average(method, options):
    results = run_workers(3, _grads, method, options, {})
    assert results[0][4] > 1  # several buckets
    for _local, synced, params, stats, _ in results:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][2], strict=False))  # broadcast from rank 0
        for i, g in enumerate(synced):
            mean = sum(r[0][i] for r in results) / 3
            assert torch.allclose(g, mean, atol=1e-6)
            assert torch.equal(g, results[0][1][i])  # bit for bit on every rank
        assert stats["n"] == sum(p.numel() for p in params)


def test_local_clipping_scales_threshold_by_inverse_sqrt_p():
    results = run_workers(4, _grads, "dense", {}, {"clip_norm": 1e-3})
    # Each rank's gradient is clipped to 1e-3 / sqrt(4) before averaging: the average's norm is at most that.
    norm = torch.sqrt(sum((g ** 2).sum() for g in results[0][1]))
    assert norm <= 1e-3 / 2 + 1e-9


def _construct(method, optimizer_momentum, sync_options):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=optimizer_momentum)
    try:
        SparseSynchronizer(model, opt, method, **sync_options)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("method,momentum,options,needle", [
    ("nope", 0.0, {}, "unknown method"),
    ("dense", 0.0, {"clip_norm": -1.0}, "clip_norm"),
    ("dense", 0.0, {"bucket_elements": 0}, "bucket_elements"),
    ("topka", 0.9, {"density": 0.1, "momentum_correction": 0.9}, "momentum=0"),
    ("dense", 0.0, {"momentum_correction": 0.9}, "last_sent"),
    ("topka", 0.0, {"density": 0.1, "momentum_correction": 1.5}, "momentum=1.5"),
])
def test_bad_options_raise_at_construction(method, momentum, options, needle):
    if method == "topka" and "topka" not in available_methods():
        pytest.skip("topka not registered")
    error = run_workers(1, _construct, method, momentum, options)[0]
    assert error is not None and needle in error


def _momentum_corrected_training(P_unused):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    sync = SparseSynchronizer(model, opt, "topka", density=0.2, momentum_correction=0.9)
    for step in range(3):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        x, y = torch.randn(4, 6, generator=gen), torch.randint(2, (4,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        sync.step()
    velocity = sync.corrections[0].velocity
    sent = sync.methods[0].last_sent
    state = sync.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    return bool((velocity[sent] == 0).all()), params, "momentum_correction" in state


@pytest.mark.skipif("topka" not in available_methods(), reason="topka not registered")
def test_momentum_correction_masks_sent_entries_and_stays_consistent():
    results = run_workers(2, _momentum_corrected_training, 2)
    assert all(r[0] and r[2] for r in results)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=False))


def _momentum_corrected_at_full_density(P_unused):
    """Three steps of topka at density 1 with DGC momentum correction, and the same steps of plain SGD
    without momentum on the all-reduced gradient, from the same start."""
    torch.manual_seed(0)
    corrected, plain = _model_pair()
    opt = torch.optim.SGD(corrected.parameters(), lr=0.1, momentum=0.0)
    sync = SparseSynchronizer(corrected, opt, "topka", density=1.0, momentum_correction=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.0)
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        x, y = torch.randn(4, 6, generator=gen), torch.randint(2, (4,), generator=gen)
        for model, optimizer in ((corrected, opt), (plain, plain_opt)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        for p in plain.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        sync.step()
        plain_opt.step()
    return [p.detach() for p in corrected.parameters()], [p.detach() for p in plain.parameters()]


def _model_pair():
    first = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    second = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    second.load_state_dict(first.state_dict())
    return first, second


@pytest.mark.parametrize("P", [1, 3])
def test_momentum_correction_at_full_density_is_sgd_without_momentum(P):
    """DGC's momentum factor masking (Lin et al. 2018, section 3.2) zeroes the velocity wherever an
    entry was sent: an entry sent every step keeps no momentum. At density 1 every entry is sent
    every step, so the update is plain SGD on the average gradient. That is why momentum correction
    needs a larger lr than momentum SGD where entries are sent often (docs/training.md, the recipe)."""
    for corrected, plain in run_workers(P, _momentum_corrected_at_full_density, P):
        for a, b in zip(corrected, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _warmup_grads(dtype):
    model = _model()
    sync = SparseSynchronizer(model, None, "topka", density=0.1, dense_warmup_steps=2, dense_warmup_dtype=dtype)
    gen = torch.Generator().manual_seed(dist.get_rank())
    nn.functional.cross_entropy(model(torch.randn(4, 6, generator=gen)), torch.randint(2, (4,), generator=gen)
                                ).backward()
    local = [p.grad.clone() for p in model.parameters()]
    stats = sync.synchronize()
    return local, [p.grad.clone() for p in model.parameters()], stats.bytes_sent


def test_a_bf16_warm_up_averages_in_bf16_with_half_the_bytes_on_every_rank_alike():
    """``dense_warmup_dtype=torch.bfloat16``: the warm-up's average is taken in bf16 (every element a bf16
    value), close to the float32 average, the same on every rank, for half the float32 warm-up's bytes."""
    low = run_workers(3, _warmup_grads, torch.bfloat16)
    full = run_workers(3, _warmup_grads, None)
    for rank in range(3):
        for g, g0 in zip(low[rank][1], low[0][1], strict=True):
            assert torch.equal(g, g0) and g.dtype == torch.float32
            assert torch.equal(g, g.to(torch.bfloat16).float())
        for g, local in zip(full[rank][1], zip(*[r[0] for r in full], strict=True), strict=True):
            assert torch.allclose(g, torch.stack(local).mean(0), atol=1e-6)
    for g, g32 in zip(low[0][1], full[0][1], strict=True):
        assert torch.allclose(g, g32, rtol=2e-2, atol=1e-3) and not torch.equal(g, g32)
    assert low[0][2] * 2 == full[0][2]
    refused = run_workers(1, _refused_warmup_dtype, torch.int32)[0]
    assert "dense_warmup_dtype=torch.int32 must be a floating torch dtype" in refused


def _refused_warmup_dtype(dtype):
    try:
        SparseSynchronizer(nn.Linear(2, 2), None, "topka", density=0.1, dense_warmup_dtype=dtype)
    except ValueError as exc:
        return str(exc)
    return "accepted"
