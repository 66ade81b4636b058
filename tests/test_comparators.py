"""ExDyna's comparators (topk, cltk, threshold, sidco): invariants for P = 1..8, traffic against
their cost formulas, what each selects, gradient build-up, SIDCo's fits, and the paper's metrics."""

import math

import pytest
import torch
import torch.distributed as dist
from invariants import assert_conserved, assert_consistent, make_gradient, trace_method

from sparsecomm import run_workers
from sparsecomm.methods import cost, make_method
from sparsecomm.methods.sidco import sidco_threshold

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
N = 2003
DENSITY = 0.02
K = math.ceil(DENSITY * N)
COMPARATORS = {"topk": {}, "cltk": {}, "threshold": {"threshold": 2.5}, "sidco": {}}


def _traffic_options(name, stats, step):
    if name == "cltk":
        return {"leader": step}
    if name in ("threshold", "sidco"):
        return {"counts": stats["counts"]}
    return {}


@pytest.mark.parametrize("name", sorted(COMPARATORS))
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_comparator_invariants_traffic_and_metrics(name, P):
    traces = run_workers(P, trace_method, name, {"density": DENSITY, **COMPARATORS[name]}, N, 3, timeout=90)
    assert_consistent(traces)
    assert_conserved(traces)
    for rank, trace in enumerate(traces):
        for step, rec in enumerate(trace):
            s = rec["stats"]
            want = cost(name, P=P, n=N, k=K, rank=rank, **_traffic_options(name, s, step))
            assert want.exact
            assert (s["rounds"], s["bytes_sent"], s["bytes_recv"]) == \
                (want.rounds, want.bytes_sent, want.bytes_recv), (rank, step)
            assert s["counts"][rank] == s["selected"]
            assert s["density_error"] == pytest.approx(abs(s["density"] - DENSITY))
            expected_f = 1.0 if name == "cltk" else P * max(s["counts"]) / max(1, sum(s["counts"]))
            assert s["padding_overhead"] == pytest.approx(expected_f)
            assert "local_error" not in s  # the error metrics cost a pass: only with global_error=True


@pytest.mark.parametrize("P", [1, 3, 4])
def test_cltk_sends_exactly_the_leaders_top_k(P):
    traces = run_workers(P, trace_method, "cltk", {"density": DENSITY}, N, P + 1, timeout=60)
    for step in range(P + 1):
        leader = traces[step % P][step]
        acc = leader["grad"] + (0 if leader["old_residual"] is None else leader["old_residual"])
        sent = leader["out"] != 0
        assert int(sent.sum()) == K == leader["stats"]["nnz_out"]
        assert acc.abs()[sent].min() >= acc.abs()[~sent].max()
        assert all(trace[step]["stats"]["leader"] == step % P for trace in traces)


def test_hard_threshold_sends_every_entry_at_or_above_it():
    traces = run_workers(3, trace_method, "threshold", {"density": DENSITY, "threshold": 2.0, "cap": None}, N, 3)
    for trace in traces:
        for rec in trace:
            acc = rec["grad"] + (0 if rec["old_residual"] is None else rec["old_residual"])
            sent = rec["new_residual"] == 0
            assert torch.equal(sent, acc.abs() >= 2.0)


def _density_at(name, n, steps, options):
    rank = dist.get_rank()
    method = make_method(name, density=DENSITY, **options)
    for step in range(steps):
        method(make_gradient(n, rank, step))
    return method.stats["density"]


def _sidco_corrections(n, steps, gather_from_acc):
    """SIDCo's controller correction after each call; ``gather_from_acc``: its controller reads the
    selected magnitudes from ``acc`` (as before the view handed them over) instead of the view's."""
    method = make_method("sidco", density=DENSITY)
    if gather_from_acc:
        update = method.controller_update

        def from_acc(acc, indices):
            method._selected_magnitudes = None
            return update(acc, indices)
        method.controller_update = from_acc
    corrections = []
    for step in range(steps):
        method(make_gradient(n, dist.get_rank(), step) * (1 + step % 3))
        corrections.append(method._feedback.log_correction)
    return corrections


def test_sidco_controller_reads_the_magnitudes_it_would_gather_from_acc():
    """The controller's elasticity from the view's magnitudes of the selected entries: the same
    corrections, call after call, as from ``|acc|`` gathered at the selected indices."""
    n = 300_007  # large enough for SIDCo's sampled floor (the candidates' view)
    viewed = run_workers(2, _sidco_corrections, n, 6, False, timeout=90)
    gathered = run_workers(2, _sidco_corrections, n, 6, True, timeout=90)
    assert viewed == gathered
    assert len(set(viewed[0])) > 1  # the controller moved


@pytest.mark.parametrize("P", [4, 8])
def test_topk_builds_up_gradients_while_cltk_does_not(P):
    """Uncorrelated gradients: the P local top-k sets barely overlap, so the union approaches P k."""
    topk = run_workers(P, _density_at, "topk", 4001, 3, {}, timeout=60)[0]
    cltk = run_workers(P, _density_at, "cltk", 4001, 3, {}, timeout=60)[0]
    assert topk > 0.7 * P * DENSITY > DENSITY
    assert cltk == pytest.approx(math.ceil(DENSITY * 4001) / 4001)


@pytest.mark.parametrize("distribution", ["exponential", "gamma", "gpd"])
@pytest.mark.parametrize("stages", [1, 2])
def test_sidco_threshold_hits_the_density_on_data_of_its_family(distribution, stages):
    """Exponential magnitudes are also gamma(1) and GPD(xi = 0): every fit should land within 15%
    (the moment estimate of the GPD shape is the noisiest)."""
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.empty(400_000, dtype=torch.float64).exponential_(2.0, generator=gen)
    for density in (0.01, 0.001):
        threshold = sidco_threshold(magnitudes, density, distribution, stages)
        achieved = float((magnitudes >= threshold).double().mean())
        assert achieved == pytest.approx(density, rel=0.15), (distribution, stages, density, achieved)


def test_sidco_multi_stage_fits_a_normal_tail_better_than_one_stage():
    """|N(0, 1)| has a lighter tail than an exponential: one exponential fit over-shoots the
    threshold (too few selected); refitting on the exceedances corrects most of that."""
    magnitudes = torch.randn(400_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64).abs()
    errors = []
    for stages in (1, 3):
        achieved = float((magnitudes >= sidco_threshold(magnitudes, 0.001, "exponential", stages)).double().mean())
        errors.append(abs(achieved / 0.001 - 1))
    assert errors[1] < errors[0]


def test_l2_norm_is_accurate_without_a_float64_copy_or_overflow():
    from sparsecomm.selection.metrics import l2_norm

    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    assert l2_norm(x) == pytest.approx(float(x.double().norm()), rel=1e-6)
    assert l2_norm(x.double()) == pytest.approx(float(x.double().norm()), rel=1e-12)
    big = torch.full((1000,), 1e30)  # its square overflows float32
    assert l2_norm(big) == pytest.approx(float(big[0]) * 1000 ** 0.5, rel=1e-12)
    assert l2_norm(torch.empty(0)) == 0.0


@pytest.mark.parametrize("variant", ["avx512", "avx2", "scalar", "torch"])
def test_count_and_sum_ge_counts_and_sums_the_candidates_at_or_above(variant):
    """MagnitudeView.count_and_sum_ge against a float64 sum of the selected magnitudes, at thresholds
    on, between and beyond the candidates (lengths that are not multiples of eight, NaN never counted);
    the C variants give the same bits as each other."""
    from sparsecomm.selection import scan
    if variant not in scan.available_kernels():
        pytest.skip(f"the {variant} scan does not run here")
    gen = torch.Generator().manual_seed(5)
    # magnitudes over many binades, so that the float64 sums round and their order shows in the bits
    x = torch.randn(100_003, generator=gen) * torch.exp2(torch.randint(-30, 31, (100_003,), generator=gen).float())
    x[::97] = float("nan")
    results = []
    with scan.use_kernel(variant):
        view = scan.MagnitudeView(x.clone(), scan.Scratch(), 0.5, name="t", check_finite=False, count=70_000)
        for t in (0.5, 1.0, float(x.abs().nan_to_num(0).max()), 1e12, 0.25):  # the last below the floor
            number, total = view.count_and_sum_ge(t)
            selected = x.abs()[x.abs() >= t].double()
            assert number == selected.numel()
            assert total == pytest.approx(float(selected.sum()), rel=1e-13, abs=0)
            results.append((number, total))
    if variant != "torch":
        with scan.use_kernel("scalar"):
            view = scan.MagnitudeView(x.clone(), scan.Scratch(), 0.5, name="t", check_finite=False, count=70_000)
            assert [view.count_and_sum_ge(t) for t in (0.5, 1.0)] == results[:2]


def _sidco_reference(x, density, stages):
    """SIDCo's exponential stages as first written: a full scan of |x| per stage."""
    from sparsecomm.selection.scan import Scratch
    p = density ** (1 / stages)
    threshold = Scratch().scan(x, math.inf, name="t", check_finite=False).total / x.numel() * math.log(1 / p)
    for _ in range(1, stages):
        above = Scratch().scan(x, threshold, name="t", check_finite=False).values
        samples = above[above > threshold].double() - threshold
        if samples.numel() < 2:
            break
        threshold += float(samples.mean()) * math.log(1 / p)
    return threshold


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("misled", [False, True])
def test_sidco_view_fits_on_the_candidates_of_one_scan_as_on_full_scans(stages, misled):
    """The stages read from the candidates above the sampled floor give the threshold of full scans (up to
    the rounding of a float64 sum: the mean excess is taken from a count and a sum, not from a copy); so
    does a floor the sample placed too high (then the view scans again); and the view's selection at any
    threshold is that of a scan of x."""
    from sparsecomm.methods.sidco import sidco_view
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(stages)) * torch.rand(400_000)
    if misled:  # the sample (runs of four at a stride) sees only large elements: the floor lies above the
        runs = (1 << 16) // 4  # first stage's threshold
        stride = x.numel() // runs
        x[: runs * stride].view(runs, stride)[:, :4] = 50.0
    residual, dest = x - 0.25, torch.empty_like(x)
    threshold, view = sidco_view(residual, 0.01, "exponential", stages, check_finite=True,
                                 addend=torch.full_like(x, 0.25), dest=dest)
    assert threshold == pytest.approx(_sidco_reference(dest, 0.01, stages), rel=1e-12, abs=0)
    assert (view.floor > threshold) if misled else (view.floor < threshold)
    from sparsecomm.selection.scan import Scratch
    for t in (threshold, threshold * 0.9, threshold * 1.5):
        assert torch.equal(view.indices_ge(t), Scratch().scan(dest, t, name="t", check_finite=False).indices)
