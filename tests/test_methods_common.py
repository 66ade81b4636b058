"""Invariants of DESIGN.md checked for EVERY registered method, P = 1..8, and the method interface's
input validation. Each method's own test file checks its paper-specific behaviour at density < 1."""

import pytest
import torch
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_equals_dense,
    assert_traffic_matches,
    trace_method,
)

import sparsecomm
from sparsecomm import WorkerError, available_methods, make_method, run_workers
from sparsecomm.methods import method_class

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
N = 1003  # not divisible by any P > 1 tested


def _full_density_options(name):
    cls = method_class(name)
    return {"density": 1.0, **cls.exact_options} if cls.sparse else {}


@pytest.mark.parametrize("name", available_methods())
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_full_density_equals_dense_and_is_consistent(name, P):
    traces = run_workers(P, trace_method, name, _full_density_options(name), N, 2, timeout=90)
    assert_consistent(traces)
    assert_equals_dense(traces)
    if method_class(name).has_residual:
        assert_conserved(traces)
    for trace in traces:
        assert trace[-1]["stats"]["nnz_out"] == N or name == "dense" or trace[-1]["stats"]["nnz_out"] <= N
        for key in ("selected", "nnz_out", "bytes_sent", "bytes_recv", "rounds",
                    "time_select", "time_comm", "time_decompress"):
            assert key in trace[-1]["stats"], f"{name}: stats lacks {key!r}"


@pytest.mark.parametrize("name", ["ring", "rabenseifner"])
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_dense_p2p_methods_traffic_equals_cost_model(name, P):
    traces = run_workers(P, trace_method, name, {}, N, 2, timeout=60)
    assert_traffic_matches(traces, name, n=N)


def _call_with(grad_kind):
    method = make_method("ring")
    rank = torch.distributed.get_rank()
    if grad_kind == "uneven":
        grad = torch.ones(10 + rank)
    elif grad_kind == "2d":
        grad = torch.ones(2, 5)
    elif grad_kind == "int":
        grad = torch.ones(10, dtype=torch.int64)
    else:
        grad = [1.0, 2.0]
    return method(grad)


@pytest.mark.parametrize("kind, message", [
    ("uneven", r"gradient length differs across ranks \(min 10, max 12; rank 1 has n=11, rank 2 has n=12, "
                r"rank 0 has n=10\)"),
    ("2d", r"grad must be a 1-D \(flat\) tensor, got shape \(2, 5\)"),
    ("int", r"grad must be a floating-point tensor, got dtype torch.int64"),
    ("list", r"grad must be a torch.Tensor, got list"),
])
def test_bad_gradients_raise_clear_errors_on_every_rank(kind, message):
    with pytest.raises(WorkerError, match=message):
        run_workers(3, _call_with, kind, timeout=30)


def _make(name, options):
    make_method(name, **options)


def test_unknown_method_and_bad_density():
    with pytest.raises(WorkerError, match=r"unknown method 'nope'; available: .*dense"):
        run_workers(1, _make, "nope", {}, timeout=30)
    sparse = [m for m in available_methods() if method_class(m).sparse]
    for name in sparse:
        for bad in (0, -0.1, 1.5, float("nan")):
            with pytest.raises(WorkerError, match=r"density=.* must be a number in \(0, 1\]"):
                run_workers(1, _make, name, {"density": bad}, timeout=30)
    with pytest.raises(WorkerError, match="is dense and takes no density"):
        run_workers(1, _make, "ring", {"density": 0.5}, timeout=30)


def test_available_methods_lists_the_dense_baselines():
    assert {"dense", "ring", "rabenseifner"} <= set(sparsecomm.available_methods())


def _checkpoint_roundtrip(name, options):
    from invariants import make_gradient
    rank = torch.distributed.get_rank()
    a = make_method(name, **options)
    a(make_gradient(200, rank, 0))
    b = make_method(name, **options)
    b.load_state_dict(a.state_dict())
    g = make_gradient(200, rank, 1)
    return torch.equal(a(g.clone()), b(g.clone()))


@pytest.mark.parametrize("name", available_methods())
def test_state_dict_resumes_identically(name):
    options = {"density": 0.1} if method_class(name).sparse else {}
    assert all(run_workers(3, _checkpoint_roundtrip, name, options, timeout=60))
