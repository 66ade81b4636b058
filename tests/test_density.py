"""Densities that hold (issue 12, item 5): exdyna, threshold and sidco send the density asked for,
whatever the gradient's scale, within 20 steps, and keep it on a drifting stream; the hard cap bounds
every step and loses nothing."""

import math

import pytest
import torch
import torch.distributed as dist
from invariants import assert_conserved, assert_consistent, make_gradient, trace_method

from sparsecomm import make_method, run_workers

P = 2
N = 200_000
DENSITY = 0.01
SCALES = (1e-6, 1e-3, 1.0, 1e3)
SETTLE = 20  # steps allowed to reach the band
DRIFT = 40  # steps of drifting scale after that
TOLERANCE = 0.10


def _drift(step):
    """The scale factor applied at ``step`` >= SETTLE: a swing of e^(+-0.4), up to 2% per step."""
    return math.exp(0.4 * math.sin((step - SETTLE) / 10))


def _densities(name, scales, n, density, drift_steps):
    """Per scale, per step: (density sent / target, entries selected by this rank, cap acted)."""
    rank = dist.get_rank()
    result = {}
    for scale in scales:
        method = make_method(name, density=density)
        rows = []
        for step in range(SETTLE + drift_steps):
            factor = scale * (_drift(step) if step >= SETTLE else 1.0)
            method(factor * make_gradient(n, rank, step, seed=3))
            stats = method.stats
            # exdyna's ranks search disjoint partitions for k together: its density is the union's
            sent = stats.density if name == "exdyna" else stats.density_sent
            rows.append((sent / density, stats.selected, stats.capped))
        result[scale] = rows
    return result


def _check_density(name, scales, n, density, drift_steps):
    per_rank = run_workers(P, _densities, name, scales, n, density, drift_steps, timeout=600)
    k = math.ceil(density * n)
    cap = math.ceil(2 * k / P) if name == "exdyna" else 2 * k
    for rank, result in enumerate(per_rank):
        for scale, rows in result.items():
            ratios = [r for r, _, _ in rows]
            first = next((i for i, r in enumerate(ratios) if abs(r - 1) <= TOLERANCE), None)
            assert first is not None and first < SETTLE, (name, scale, rank, ratios[:SETTLE])
            late = ratios[SETTLE:]
            worst = max(late, key=lambda r: abs(r - 1))
            assert abs(worst - 1) <= TOLERANCE, (name, scale, rank, worst)
            assert all(selected <= cap for _, selected, _ in rows), (name, scale, max(s for _, s, _ in rows))


@pytest.mark.parametrize("name", ["exdyna", "threshold", "sidco"])
def test_density_holds_from_extreme_scales_and_on_a_drifting_stream(name):
    """The quick version: the two extreme scales, 20 drifting steps, k = 2000 per rank."""
    _check_density(name, (1e-6, 1e3), 100_000, 0.02, 20)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exdyna", "threshold", "sidco"])
def test_density_holds_from_any_scale_and_on_a_drifting_stream(name):
    """Issue 12's criterion: scales 1e-6, 1e-3, 1, 1e3; within 10% by step 20, then 40 drifting steps."""
    _check_density(name, SCALES, N, DENSITY, DRIFT)


def test_the_paper_constants_stay_behind_one_option():
    """controller="paper": ExDyna's first threshold 1/(2 sqrt(k)) ignores the scale, so on unit-scale
    gradients at 0.1% it sends far more than asked at first (here only the cap stops it), as measured in
    issue 12; the adaptive default does not."""
    paper = run_workers(1, _first_counts, "exdyna", {"controller": "paper", "cap": None}, timeout=60)[0]
    adaptive = run_workers(1, _first_counts, "exdyna", {}, timeout=60)[0]
    k = math.ceil(0.001 * N)
    assert paper[0] > 50 * k  # 1/(2 sqrt(200)) = 0.035 on unit-scale data: most of the vector
    assert abs(adaptive[0] / k - 1) <= TOLERANCE


def _first_counts(name, options):
    method = make_method(name, density=0.001, **options)
    counts = []
    for step in range(3):
        method(make_gradient(N, dist.get_rank(), step))
        counts.append(method.stats.nnz_out)
    return counts


@pytest.mark.parametrize("name, options", [
    ("threshold", {"threshold": 0.5}),               # selects ~60% of unit-scale data
    ("exdyna", {"initial_threshold": 1e-3, "controller": "paper"}),
    ("topka", {"selector": "binary_search"}),        # a band selector: never over 2k, the cap never acts
])
def test_the_cap_bounds_every_step_and_loses_nothing(name, options):
    n, density = 20_000, 0.01
    traces = run_workers(3, trace_method, name, {"density": density, **options}, n, 4, timeout=90)
    assert_consistent(traces)
    assert_conserved(traces)
    k = math.ceil(density * n)
    limit = math.ceil(2 * k / 3) if name == "exdyna" else 2 * k
    acted = []
    for trace in traces:
        for rec in trace:
            stats = rec["stats"]
            assert stats["selected"] <= limit
            assert stats["capped"] == int(stats["cut"] > 0)
            assert stats["density_sent"] == pytest.approx(stats["selected"] / n)
            acted.append(stats["capped"])
    if name == "topka":
        assert not any(acted)
    else:
        assert all(acted)  # far over the cap at every step


def _cap_values(name, options):
    """(accumulated gradient, what was sent) of one call with a cap that acts."""
    method = make_method(name, density=0.01, **options)
    grad = make_gradient(20_000, dist.get_rank(), 0)
    out = method(grad.clone())
    return grad, method.residual.clone(), out.clone(), method.stats.selected


def test_the_cap_keeps_the_largest_values():
    grad, residual, _, selected = run_workers(1, _cap_values, "threshold", {"threshold": 0.5}, timeout=60)[0]
    sent = residual == 0
    assert int(sent.sum()) == selected == 400
    # every entry sent is at least as large as every entry above the threshold that was cut
    cut = (grad.abs() >= 0.5) & ~sent
    assert float(grad[sent].abs().min()) >= float(grad[cut].abs().max())
    assert torch.equal(residual[~sent], grad[~sent])
