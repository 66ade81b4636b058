"""dense_fallback: the hook and the synchronizer time dense and sparse steps and keep the method where it pays
(sparsecomm.integration.auto), the same decision on every rank, nothing lost, resumable."""

import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparsecomm import SparseHookState, SparseSynchronizer, hook, run_workers
from sparsecomm.integration.auto import DenseFallback
from sparsecomm.transport.comm import Communicator


def _decide(dense_s, method_s, margin, pinned=None):
    """Feed scripted step times (this rank's) to a DenseFallback; return its decision and whether it
    asked for the switch."""
    fallback = DenseFallback(probe=3, skip=1, margin=margin, pinned=pinned)
    until = fallback.dense_steps(0)
    rank = dist.get_rank()
    times = [0.0]
    for step in range(until + fallback.skip + fallback.probe):
        times.append(times[-1] + (dense_s[rank] if step < until else method_s[rank]))
    clock = iter(times)
    switched = []
    for step in range(len(times)):
        fallback.step_ended(step - 1, until, Communicator(), lambda: switched.append(True), clock=lambda: next(clock))
    return fallback.decision, bool(switched), fallback.state_dict()


@pytest.mark.parametrize("dense_s, method_s, margin, decision", [
    ((1.0, 1.0), (0.5, 0.5), 0.05, "method"),     # the method's steps are twice as fast
    ((1.0, 1.0), (0.97, 0.97), 0.05, "dense"),    # faster, but not by the margin
    ((1.0, 1.0), (1.5, 1.5), 0.05, "dense"),      # slower
    ((1.0, 1.0), (0.5, 1.2), 0.05, "dense"),      # rank 1 is slower with the method: the slowest rank decides
])
def test_the_decision_is_the_slowest_ranks_and_the_same_on_every_rank(dense_s, method_s, margin, decision):
    results = run_workers(2, _decide, dense_s, method_s, margin)
    assert [r[0] for r in results] == [decision, decision]
    assert [r[1] for r in results] == [decision == "dense"] * 2
    assert results[0][2] == results[1][2] and results[0][2]["method_s"] == pytest.approx(max(method_s))


@pytest.mark.parametrize("method_s, pinned", [((0.5, 0.5), "dense"), ((1.5, 1.5), "method")])
def test_a_pinned_decision_is_taken_whatever_the_probe_measured_and_the_times_still_recorded(method_s, pinned):
    results = run_workers(2, _decide, (1.0, 1.0), method_s, 0.05, pinned)
    assert [r[0] for r in results] == [pinned, pinned]
    assert [r[1] for r in results] == [pinned == "dense"] * 2
    assert results[0][2]["method_s"] == pytest.approx(method_s[0]) and results[0][2]["dense_s"] == pytest.approx(1.0)


def test_the_default_margin_asks_for_a_step_a_fifth_shorter():
    results = run_workers(2, _decide, (1.0, 1.0), (0.85, 0.85), DenseFallback().margin)
    assert [r[0] for r in results] == ["dense", "dense"]  # 15% shorter: lost to a sparse method's extra steps
    results = run_workers(2, _decide, (1.0, 1.0), (0.75, 0.75), DenseFallback().margin)
    assert [r[0] for r in results] == ["method", "method"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="probe"):
        DenseFallback(probe=0)
    with pytest.raises(ValueError, match="margin"):
        DenseFallback(margin=1.0)
    with pytest.raises(ValueError, match="pinned='sparse'"):
        DenseFallback(pinned="sparse")
    with pytest.raises(TypeError, match="dense_fallback='yes'"):
        SparseHookState(None, "topka", density=0.1, dense_fallback="yes")


def test_the_hook_takes_a_configured_fallback():
    fallback = DenseFallback(probe=2, skip=1, margin=0.5, pinned="dense")
    state = SparseHookState(None, "topka", density=0.1, dense_fallback=fallback)
    assert state.engine.dense_fallback is fallback
    assert SparseHookState(None, "topka", density=0.1, dense_fallback=False).engine.dense_fallback is None


def _train_hook(steps, margin, state_bytes=None, start=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = SparseHookState(None, "topka", density=0.1, dense_fallback=True)
    state.engine.dense_fallback.margin = margin  # 0.99: the method must be 100x faster, so it falls back
    if state_bytes is not None:
        state.load_state_dict(torch.load(io.BytesIO(state_bytes[dist.get_rank()]), weights_only=False))
        model.load_state_dict(torch.load(io.BytesIO(state_bytes[-1])))
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(torch.randn(8, 32, generator=gen)), torch.randint(4, (8,), generator=gen)
                                    ).backward()
        opt.step()
    buffers = []
    for obj in (state.state_dict(), model.state_dict()):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffers.append(buffer.getvalue())
    copy = pickle.loads(pickle.dumps(state))  # a pickled state keeps the policy's settings and decision
    pickled = (copy.method_name, copy.engine.dense_fallback.decision, copy.engine.dense_fallback.margin)
    copy.close()
    result = ([p.detach().clone() for p in model.parameters()], state.method_name,
              state.engine.dense_fallback.decision, buffers, pickled)
    state.close()
    return result


def test_the_hook_falls_back_to_dense_keeps_the_replicas_identical_and_resumes_with_the_decision():
    fallback = DenseFallback()
    steps = fallback.dense_steps(0) + fallback.skip + fallback.probe + 4
    results = run_workers(3, _train_hook, steps, 0.99)
    assert [r[1:3] for r in results] == [("dense", "dense")] * 3   # fell back, on every rank
    assert [r[4] for r in results] == [("dense", "dense", 0.99)] * 3
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r[0], results[0][0], strict=True))
    # a resumed run keeps the decision (dense) and makes the same steps as the uninterrupted one
    saved = [r[3][0] for r in results] + [results[0][3][1]]
    resumed = run_workers(3, _train_hook, steps + 3, 0.99, saved, steps)
    longer = run_workers(3, _train_hook, steps + 3, 0.99)
    assert [r[1:3] for r in resumed] == [("dense", "dense")] * 3
    assert all(torch.equal(a, b) for a, b in zip(resumed[0][0], longer[0][0], strict=True))


def _synchronize(steps, margin):
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = SparseSynchronizer(model, opt, "topka", density=0.25, dense_fallback=True)
    sync.engine.dense_fallback.margin = margin
    for step in range(steps):
        gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        opt.zero_grad()
        model(torch.randn(4, 16, generator=gen)).square().mean().backward()
        sync.step()
    return [p.detach().clone() for p in model.parameters()], sync.method_name


def test_the_synchronizer_falls_back_alike():
    fallback = DenseFallback()
    results = run_workers(2, _synchronize, fallback.dense_steps(0) + fallback.skip + fallback.probe + 2, 0.99)
    assert [r[1] for r in results] == ["dense", "dense"]
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0], strict=True))


def _train_native_or_engine(model, ddp, state, native, steps, loss):
    """Train ``steps`` iterations of ``loss(ddp, generator)`` with ``state`` on ``ddp`` (``native=False``:
    every iteration on the engine's path); the parameters and which iterations went to the backend."""
    if not native:
        state.goes_native = lambda bucket: False
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    went = []
    for step in range(steps):
        opt.zero_grad()
        loss(ddp, torch.Generator().manual_seed(step * 10 + dist.get_rank())).backward()
        went.append(state._native)
        assert state.take_stats().density == 1.0 or not state._native
        opt.step()
    return [p.detach().clone() for p in model.parameters()], went


def _train_dense_hook(steps, native, method="topka", nonfinite="propagate"):
    """Train with a hook that falls back (margin 0.99) or synchronizes densely."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    options = {"density": 0.1} if method == "topka" else {}
    state = SparseHookState(None, method, dense_fallback=method == "topka", nonfinite=nonfinite, **options)
    if method == "topka":
        state.engine.dense_fallback.margin = 0.99
    result = _train_native_or_engine(model, ddp, state, native, steps, lambda ddp, gen: nn.functional.cross_entropy(
        ddp(torch.randn(8, 32, generator=gen)), torch.randint(4, (8,), generator=gen)))
    if method == "topka":
        assert state.engine.dense_fallback.decision == "dense" and state.engine.dense_fallback.dense_s > 0
    state.close()
    return result


def test_after_falling_back_the_hook_hands_buckets_to_the_backend_as_ddp_does_with_the_same_bits():
    """In the dense warm-up (the probe's dense phase), and once the fallback's residuals are flushed (the
    iteration after the switch), the hook all-reduces each bucket itself (no thread, no copy, no
    agreement round), with the engine's dense bits; the probe still times the dense steps."""
    fallback = DenseFallback()
    decided = fallback.dense_steps(0) + fallback.skip + fallback.probe - 1
    steps = decided + 5
    native = run_workers(3, _train_dense_hook, steps, True)
    engine = run_workers(3, _train_dense_hook, steps, False)
    warmup = fallback.dense_steps(0)  # DDP's first iteration forms the groups; the flush step is the engine's
    assert native[0][1] == [False] + [True] * (warmup - 1) + [False] * (decided - warmup + 2) + [True] * 3
    assert all(torch.equal(a, b) for r in native[1:] for a, b in zip(r[0], native[0][0], strict=True))  # replicas
    assert all(torch.equal(a, b) for a, b in zip(native[0][0], engine[0][0], strict=True))
    # a state made dense goes native from its second iteration (DDP's first builds the groups); a policy
    # other than "propagate" needs the engine's agreement round, so it never does
    assert run_workers(2, _train_dense_hook, 4, True, "dense")[0][1] == [False, True, True, True]
    assert not any(run_workers(2, _train_dense_hook, 4, True, "dense", "skip")[0][1])


class _Reordered(nn.Module):
    """Layers used in another order than registered: DDP's rebuilt buckets (gradient-ready order) differ
    from its first iteration's (reverse registration order)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 48), nn.Linear(16, 32), nn.Linear(48, 4)

    def forward(self, x):
        return self.c(torch.relu(self.a(torch.relu(self.b(x)))))


def _warmup_then_method(steps, native, dtype=None):
    torch.manual_seed(0)
    model = _Reordered()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)  # a few buckets, rebuilt
    state = SparseHookState(None, "topka", density=0.1, dense_warmup_steps=3, dense_warmup_dtype=dtype)
    result = _train_native_or_engine(model, ddp, state, native, steps,
                                     lambda ddp, gen: ddp(torch.randn(8, 16, generator=gen)).square().mean())
    state.close()
    return result


def test_a_native_warm_up_leaves_the_method_the_same_groups_and_bits_across_ddps_bucket_rebuild():
    native = run_workers(2, _warmup_then_method, 7, True)
    engine = run_workers(2, _warmup_then_method, 7, False)
    assert native[0][1] == [False, True, True, False, False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(native[0][0], engine[0][0], strict=True))


def _first_warmup_step(native, dtype):
    """One warm-up iteration after DDP's first (which forms the groups): each rank's averaged gradient
    and the bytes the stats book for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = SparseHookState(None, "topka", density=0.1, dense_warmup_steps=3, dense_warmup_dtype=dtype)
    if not native:
        state.goes_native = lambda bucket: False
    ddp.register_comm_hook(state, hook)
    for step in range(2):
        model.zero_grad()
        gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        nn.functional.cross_entropy(ddp(torch.randn(8, 32, generator=gen)), torch.randint(4, (8,), generator=gen)
                                    ).backward()
        stats = state.take_stats()
    went = state._native
    copy = pickle.loads(pickle.dumps(state))  # the dtype is a setting the pickled state keeps
    assert copy.engine.warmup_dtype == dtype
    copy.close()
    state.close()
    return [p.grad.clone() for p in model.parameters()], stats.bytes_sent, went


def test_a_bf16_warm_up_through_the_hook_averages_in_bf16_for_half_the_bytes_by_either_path():
    """``dense_warmup_dtype=torch.bfloat16`` on the hook: the warm-up's average is a bf16 value cast back
    to float32, the same bits on the backend's path and the engine's, on every rank, for half the bytes."""
    native = run_workers(3, _first_warmup_step, True, torch.bfloat16)
    engine = run_workers(3, _first_warmup_step, False, torch.bfloat16)
    full = run_workers(3, _first_warmup_step, True, None)
    assert native[0][2] and not engine[0][2] and full[0][2]
    for rank in range(3):
        for a, b, c in zip(native[rank][0], engine[rank][0], native[0][0], strict=True):
            assert torch.equal(a, b) and torch.equal(a, c) and a.dtype == torch.float32
            assert torch.equal(a, a.to(torch.bfloat16).float())
    for low, high in zip(native[0][0], full[0][0], strict=True):
        assert torch.allclose(low, high, rtol=2e-2, atol=1e-3) and not torch.equal(low, high)
    assert native[0][1] * 2 == full[0][1] and engine[0][1] * 2 == full[0][1]
