"""Ok-Topk: invariants for P = 1..8, traffic equal to the formula replayed from the recorded counts,
the dense warm-up, and the schedule: thresholds re-estimated every ``threshold_interval`` calls and
regions re-balanced every ``partition_interval`` calls on a gradient stream whose mass drifts."""

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

from sparsecomm import make_method, run_workers
from sparsecomm.methods.oktopk import PAPER_DEFAULTS

N = 1003
SHORT = {"warmup_steps": 1, "threshold_interval": 2, "partition_interval": 3}


def _replay(traces, k, **schedule):
    """The meter equals the formula replayed from every rank's recorded counts, call by call."""
    for step in range(len(traces[0])):
        recs = [trace[step] for trace in traces]
        counts = {}
        if not recs[0]["stats"].get("warmup"):
            counts = {"send_counts": [rec["stats"]["send_counts"] for rec in recs],
                      "gather_counts": recs[0]["stats"]["gather_counts"]}
        assert_traffic_matches([[rec] for rec in recs], "oktopk", n=N, k=k, step=step, **schedule, **counts)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_oktopk_invariants_and_traffic(P):
    options = {"density": 0.05, **SHORT}
    traces = run_workers(P, trace_method, "oktopk", options, N, 5, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    k = math.ceil(0.05 * N)
    _replay(traces, k, warmup_steps=1, partition_interval=3)
    assert traces[0][0]["stats"]["warmup"] and not traces[0][1]["stats"]["warmup"]
    for rec in traces[0][1:]:
        assert rec["stats"]["nnz_out"] == rec["stats"]["global_count"]


@pytest.mark.parametrize("P", [2, 5])
def test_density_one_equals_dense_after_warmup(P):
    traces = run_workers(P, trace_method, "oktopk", {"density": 1.0, **SHORT}, N, 4, timeout=60)
    assert_consistent(traces)
    assert_equals_dense(traces)
    assert_conserved(traces)


def test_defaults_are_the_public_codes():
    assert PAPER_DEFAULTS == {"warmup_steps": 512, "threshold_interval": 32, "partition_interval": 64,
                              "local_scale": 1.012, "global_scale": 1.008, "reuse_scale": 1.03, "reuse_loops": 5}


def _drifting_stream(n, k, steps, drift):
    """Gradients whose large entries sit in a window that moves by ``drift`` elements per call."""
    rank = torch.distributed.get_rank()
    method = make_method("oktopk", density=k / n, warmup_steps=0)
    gen = torch.Generator().manual_seed(rank)
    records = []
    for t in range(steps):
        grad = 0.01 * torch.randn(n, generator=gen)
        start = (t * drift) % (n - 4 * k)
        grad[start:start + 4 * k] += torch.randn(4 * k, generator=gen)
        acc = grad + (0 if method.residual is None else method.residual)
        kth = float(torch.topk(acc.abs(), k).values.min())
        method(grad)
        stats = method.stats
        records.append({"kth": kth, "local": stats["local_threshold"], "global": stats["global_threshold"],
                        "estimated": stats["estimated"], "repartitioned": stats["repartitioned"],
                        "boundaries": stats["boundaries"], "send_counts": stats["send_counts"]})
    return records


def test_thresholds_and_boundaries_follow_the_schedule_on_a_drifting_stream():
    P, n, k, steps = 3, 4000, 40, 130
    per_rank = run_workers(P, _drifting_stream, n, k, steps, 20, timeout=120)
    ours = per_rank[0]
    assert [t for t, rec in enumerate(ours) if rec["estimated"]] == [0, 32, 64, 96, 128]
    assert [t for t, rec in enumerate(ours) if rec["repartitioned"]] == [0, 64, 128]
    # a reused threshold moves by 1.03^j (j <= 5, the pre-selection raise) times 1.012^(-1, 0 or 1)
    scales = {1.03 ** j * s for j in range(6) for s in (1.0, 1.012, 1 / 1.012)}
    for t in range(1, steps):
        prev, rec = ours[t - 1], ours[t]
        if rec["estimated"]:
            assert rec["local"] == pytest.approx(rec["kth"], rel=1e-6)   # exact k-th |acc| on schedule
        else:                                                         # reused, scaled as above
            ratio = rec["local"] / prev["local"]
            assert min(abs(ratio - s) for s in scales) < 1e-9, (t, ratio)
            # the global threshold moves only by the 1.008 rule between estimations
            g_ratio = rec["global"] / prev["global"]
            assert min(abs(g_ratio - s) for s in (1.0, 1.008, 1 / 1.008)) < 1e-9, (t, g_ratio)
        if not rec["repartitioned"]:
            assert rec["boundaries"] == prev["boundaries"]
    # the window drifted: the regions re-set at 64 and 128 are new, and balance the load again
    assert ours[64]["boundaries"] != ours[63]["boundaries"] != ours[128]["boundaries"]

    def imbalance(t):
        per_region = [sum(per_rank[r][t]["send_counts"][q] for r in range(P)) for q in range(P)]
        return max(per_region) / max(1, sum(per_region) / P)

    assert imbalance(64) < 1.5 and imbalance(128) < 1.5
    assert imbalance(63) > imbalance(64) and imbalance(127) > imbalance(128)


def _warmup_step(_=None):
    import torch.distributed as dist

    counted = []
    real = torch.count_nonzero
    torch.count_nonzero = lambda *a, **kw: (counted.append(1), real(*a, **kw))[1]
    try:
        method = make_method("oktopk", density=0.05, warmup_steps=1)
        grad = torch.randn(N, generator=torch.Generator().manual_seed(dist.get_rank()))
        grad[::3] = 0.0  # zeros in the output: a count of the output would not give N
        method(grad)
    finally:
        torch.count_nonzero = real
    return method.stats.nnz_out, len(counted)


@pytest.mark.parametrize("P", [1, 3])
def test_the_dense_warmup_step_counts_as_dense_without_a_pass(P):
    """A warm-up step is a dense all-reduce: its output counts as n non-zeros, as a dense method's
    does, and no pass over it counts them."""
    for nnz_out, counted in run_workers(P, _warmup_step, timeout=60):
        assert nnz_out == N and counted == 0
