"""The library's long-lived buffers are advised as huge-page regions (sparsecomm.core.buffers): the
advice covers exactly the whole pages inside a large CPU buffer, is given before anything is written,
skips small and non-CPU buffers, and is what the residual, its spare and a group's buffers get."""

import sys

import pytest
import torch

import sparsecomm.core.buffers as buffers
from sparsecomm import available_methods, make_method, run_workers
from sparsecomm.integration.dgc import MomentumCorrection
from sparsecomm.integration.residuals import Group, ParamPlan
from sparsecomm.methods import dense_warmup, is_sparse


@pytest.fixture
def advised(monkeypatch):
    """Records every madvise call (start, length, advice) instead of making it."""
    calls = []

    def record(start, length, advice):
        calls.append((start, length, advice))
        return 0

    monkeypatch.setattr(buffers, "_madvise", lambda: record)
    return calls


def _span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_advice_covers_the_whole_pages_inside_a_large_buffer(advised):
    n = buffers.MIN_BYTES // 4 + 12345
    t = buffers.long_lived_empty(n, dtype=torch.float32, device="cpu")
    assert t.shape == (n,) and t.dtype == torch.float32 and t.is_contiguous()
    (start, length, advice), = advised
    lo, hi = _span(t)
    assert advice == 14  # MADV_HUGEPAGE
    assert start % 4096 == 0 and length % 4096 == 0
    assert lo <= start < lo + 4096 and hi - 4096 < start + length <= hi


def test_zeros_are_advised_before_they_are_written(monkeypatch):
    seen = []
    monkeypatch.setattr(buffers, "_advise_huge_pages", lambda t: seen.append(t.clone()))
    z = buffers.long_lived_zeros((3, 5), dtype=torch.float64, device="cpu")
    assert z.dtype == torch.float64 and z.shape == (3, 5) and bool((z == 0).all())
    assert len(seen) == 1  # called once, on the buffer before zero_()


@pytest.mark.parametrize("n", [0, 1, buffers.MIN_BYTES // 4 - 1])
def test_small_buffers_are_left_alone(advised, n):
    buffers.long_lived_empty(n, dtype=torch.float32, device="cpu")
    assert advised == []


def test_no_advice_off_linux(monkeypatch):
    buffers._madvise.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert buffers._madvise() is None
        buffers.long_lived_empty(buffers.MIN_BYTES, dtype=torch.float32, device="cpu")  # no error
    finally:
        buffers._madvise.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_real_advice_keeps_the_values():
    t = buffers.long_lived_zeros(buffers.MIN_BYTES // 2, dtype=torch.float32, device="cpu")
    assert bool((t == 0).all())
    t.add_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


def _is_advised(t, calls):
    """Whether one recorded advice spans ``t``'s whole pages."""
    lo, hi = _span(t)
    return any(lo <= start and start + length <= hi and length >= hi - lo - 8192 for start, length, _ in calls)


def _recording():
    calls = []
    buffers._madvise = lambda: lambda start, length, advice: calls.append((start, length, advice)) or 0
    return calls


def _method_worker(name, n):
    calls = _recording()
    options = {"density": 0.01, **({"warmup_steps": 0} if dense_warmup(name) else {})}
    method = make_method(name, **options)
    grad = torch.randn(n)
    for _ in range(3):
        method(grad)
    fresh = make_method(name, **options).residual_for(grad)  # the residual where no spare is used (NCCL)
    spare = method._runner.residuals.spare
    return {part: _is_advised(t, calls) for part, t in (("residual", method.residual), ("spare", spare),
                                                         ("residual_for", fresh))}


@pytest.mark.parametrize("name", [m for m in available_methods() if is_sparse(m)])
def test_residual_and_spare_are_long_lived_buffers(name):
    """Every sparse method's error-feedback buffers: the residual and the spare its scan writes
    ``residual + grad`` to (every method agrees after its scan on gloo), and the residual a method
    makes where it updates it in place (:meth:`~sparsecomm.methods.base.Method.residual_for`)."""
    result, = run_workers(1, _method_worker, name, buffers.MIN_BYTES // 4 * 2)
    assert result == {"residual": True, "spare": True, "residual_for": True}


def _group_worker(n):
    calls = _recording()
    group = Group(index=0, ids=(0,), numels=(n,), dtype=torch.float32, device=torch.device("cpu"),
                  method=make_method("topka", density=0.01), dense=False)
    buffers_before = [group.residual, group.outbuf(), group.inbuf()]
    plan = ParamPlan("bucket", lambda numel, itemsize: False, lambda dense: make_method("topka", density=0.01))
    plan.replace_method(group, make_method("topka", density=0.01))  # a switch of methods: a new residual
    return [_is_advised(t, calls) for t in (*buffers_before, group.residual)]


def test_group_buffers_are_long_lived():
    """A hook group's residual (also the one a switch of methods gives it), output and gather buffers."""
    assert run_workers(1, _group_worker, buffers.MIN_BYTES // 4 * 2) == [[True, True, True, True]]


def test_momentum_correction_buffers_are_long_lived(advised):
    """DGC momentum correction's velocity and accumulation, and the buffers their next values go to."""
    correction = MomentumCorrection(0.9, hold_accumulation=True)
    grad = torch.randn(buffers.MIN_BYTES // 4 * 2)
    for _ in range(2):
        correction.update(grad)
    previous_velocity, previous_accumulation = correction._previous
    kept = (correction.velocity, correction.accumulation, previous_velocity, previous_accumulation)
    assert all(_is_advised(t, advised) for t in kept)
