"""S2 Reducer (sparse-sketch reducer) and its count-sketch: consistency for P = 1..8, the exact
selected-vs-residual split, exactness (conservation, density 1 == dense) where the sketch has no
collision, the measured sketch error, and traffic equal to the cost formula."""

import math

import pytest
import torch
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_equals_dense,
    assert_traffic_matches,
    trace_method,
)

from sparsecomm import run_workers
from sparsecomm.selection.sketch import CountSketch, index_bits

N = 997
DENSITY = 0.05
BLOCK = 32
K = math.ceil(DENSITY * N)
# rows * cols >= 3 * 2^ceil(log2 N): every row collision-free, so every query is exact.
EXACT = {"rows": 3, "sketch_ratio": 3 * 1024 / K}


# ---------------------------------------------------------------------- the sketch alone
@pytest.mark.parametrize("n", [1, 2, 31, 997, 1024, 5000])
def test_sketch_with_enough_columns_is_exact(n):
    sketch = CountSketch(n, rows=2, cols=1 << index_bits(n), seed=n)
    assert sketch.exact
    indices = torch.arange(n)
    buckets, signs = sketch.hashes(indices)
    for row in range(2):
        assert buckets[row].unique().numel() == n                 # no collision
    assert set(signs.unique().tolist()) <= {-1, 1}
    values = torch.randn(n, dtype=torch.float64)
    table = sketch.insert(sketch.empty_table(torch.float64), indices, values)
    assert torch.equal(sketch.query(table, indices), values)


def test_sketch_is_linear_and_seeded():
    n, idx_a, idx_b = 4000, torch.arange(0, 4000, 7), torch.arange(0, 4000, 5)
    a, b = torch.randn(idx_a.numel(), dtype=torch.float64), torch.randn(idx_b.numel(), dtype=torch.float64)
    sketch = CountSketch(n, rows=3, cols=50, seed=11)
    both = sketch.insert(sketch.insert(sketch.empty_table(torch.float64), idx_a, a), idx_b, b)
    dense = torch.zeros(n, dtype=torch.float64)
    dense[idx_a] += a
    dense[idx_b] += b
    nz = dense.nonzero().reshape(-1)
    assert torch.allclose(both, sketch.insert(sketch.empty_table(torch.float64), nz, dense[nz]))
    same = CountSketch(n, rows=3, cols=50, seed=11).hashes(nz)
    other = CountSketch(n, rows=3, cols=50, seed=12).hashes(nz)
    assert all(torch.equal(x, y) for x, y in zip(sketch.hashes(nz), same, strict=False))
    assert not torch.equal(sketch.hashes(nz)[0], other[0])


def test_sketch_estimate_is_unbiased_over_seeds():
    """Theorem 1: one-row estimates average to the true values over independent hashes."""
    n, trials = 500, 400
    indices = torch.arange(0, n, 2)
    values = torch.randn(indices.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    errors = []
    for seed in range(trials):
        sketch = CountSketch(n, rows=1, cols=40, seed=seed)
        table = sketch.insert(sketch.empty_table(torch.float64), indices, values)
        errors.append(sketch.query(table, indices) - values)
    errors = torch.stack(errors)
    spread = errors.std(dim=0) / math.sqrt(trials)            # standard error of each mean
    assert errors.abs().mean() > 0.5                          # the sketch is far from exact ...
    assert (errors.mean(dim=0).abs() < 5 * spread + 1e-12).all()  # ... yet unbiased


# ---------------------------------------------------------------------- the method
def _selected(rec):
    """This rank's selection: acc - new residual (acc = grad + old residual)."""
    acc = rec["grad"] + (0 if rec["old_residual"] is None else rec["old_residual"])
    return acc, acc - rec["new_residual"]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_s2reducer_default_invariants(P):
    options = {"density": DENSITY, "measure_error": True}
    traces = run_workers(P, trace_method, "s2reducer", options, N, 2, timeout=60)
    assert_consistent(traces)
    assert_traffic_matches(traces, "s2reducer", n=N, k=K, **options)
    for step in range(2):
        total = torch.zeros(N, dtype=torch.float64)
        union = torch.zeros(N, dtype=torch.bool)
        for trace in traces:
            rec = trace[step]
            acc, selected = _selected(rec)
            kept = rec["new_residual"]
            # the split is exact: each element is either kept whole or sent whole, in whole blocks
            sent = kept == 0
            assert torch.equal(kept[~sent], acc[~sent])
            blocks = sent.reshape(-1)[: N // BLOCK * BLOCK].view(-1, BLOCK)
            assert (blocks.all(1) | ~blocks.any(1)).all()
            assert K <= int(sent.sum()) <= K + BLOCK - 1
            total += selected.double()
            union |= sent
        out = traces[0][step]["out"].double()
        assert not out[~union].any()                          # nothing outside the selected blocks
        truth = total / P
        err = out - truth
        stats = traces[0][step]["stats"]
        assert stats["union_nnz"] == int(union.sum())
        assert stats["sketch_error_max"] == pytest.approx(err.abs().max().item(), rel=1e-4, abs=1e-6)
        assert stats["sketch_error"] == pytest.approx((err.norm() / truth.norm()).item(), rel=1e-4)


@pytest.mark.parametrize("P", [1, 3, 5, 6, 8])
def test_s2reducer_collision_free_sketch_conserves(P):
    traces = run_workers(P, trace_method, "s2reducer", dict(EXACT, density=DENSITY), N, 3, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    assert_traffic_matches(traces, "s2reducer", n=N, k=K, **EXACT)


@pytest.mark.parametrize("P", [2, 7])
def test_s2reducer_density_one_collision_free_equals_dense(P):
    options = {"density": 1.0, "rows": 1, "sketch_ratio": 1024 / N, "allreduce": "ring"}
    traces = run_workers(P, trace_method, "s2reducer", options, N, 2, timeout=60)
    assert_consistent(traces)
    assert_equals_dense(traces)
    assert_traffic_matches(traces, "s2reducer", n=N, k=N, **options)


def test_s2reducer_error_shrinks_with_a_larger_sketch():
    errors = {}
    for ratio in (0.5, 8.0):
        options = {"density": DENSITY, "sketch_ratio": ratio, "measure_error": True}
        traces = run_workers(4, trace_method, "s2reducer", options, N, 2, timeout=60)
        errors[ratio] = max(rec["stats"]["sketch_error"] for rec in traces[0])
    assert errors[8.0] < errors[0.5]


def test_s2reducer_rejects_bad_options():
    from sparsecomm.methods.s2reducer import SparseSketchReducer

    for bad in ({"sketch_ratio": 0}, {"sketch_ratio": float("nan")}, {"rows": 0}, {"allreduce": "tree"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SparseSketchReducer(comm=_NoComm(), density=0.1, **bad)


class _NoComm:
    """Stands in for a Communicator: option checks run before any message."""
    size, rank = 1, 0
