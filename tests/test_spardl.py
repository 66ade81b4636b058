"""SparDL (sparsecomm/methods/spardl*.py): schedules, Algorithm 2, and the DESIGN.md invariants for
P = 1..8 with d = 1, R-SAG and B-SAG.

Each multi-process test runs all its configurations of one P inside ONE run_workers call
(``_trace_all``), to keep the suite fast on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_equals_dense,
    assert_traffic_matches,
    make_gradient,
    trace_method,
)

from sparsecomm import run_workers
from sparsecomm.core.cost import ceil_log2
from sparsecomm.methods import cost, make_method
from sparsecomm.methods.spardl import table1_cost, team_candidates
from sparsecomm.methods.spardl.sag import HAdjuster
from sparsecomm.methods.spardl.srs import srs_schedule

STEPS = 3
ELEMENT_BYTES = 4  # int32 indices and float32 values: Table I counts both as elements


def _trace_all(configs, n, steps):
    """Worker: trace_method for every (options) in ``configs``, one after the other."""
    return [trace_method("spardl", options, n, steps) for options in configs]


def _per_config(results, index):
    return [rank_results[index] for rank_results in results]


def _k(density, n):
    return min(n, max(1, math.ceil(density * n)))


def _check_invariants(traces, n, options):
    P = len(traces)
    assert_consistent(traces)
    assert_conserved(traces)
    if options["density"] == 1.0:
        assert_equals_dense(traces)
    teams = options.get("teams", 1)
    sag = options.get("sag", "auto")
    k = _k(options["density"], n)
    assert_traffic_matches(traces, "spardl", n, k, teams=teams, sag=sag)
    for rank, trace in enumerate(traces):  # rounds are exact even though bytes are a bound
        want = cost("spardl", P=P, n=n, k=k, rank=rank, teams=teams, sag=sag).rounds
        assert [rec["stats"]["rounds"] for rec in trace] == [want] * len(trace)
        assert all(rec["stats"]["teams"] == teams for rec in trace)


# ---------------------------------------------------------------------- pure units
@pytest.mark.parametrize("m", range(1, 18))
def test_srs_schedule_delivers_every_block_to_its_owner(m):
    held = [set(range(m)) for _ in range(m)]
    schedules = [srs_schedule(m, w) for w in range(m)]
    assert all(len(s) == ceil_log2(m) for s in schedules)
    for w, schedule in enumerate(schedules):  # bags: every block but w exactly once
        sent = [j for step in schedule for j in step.send_blocks]
        assert sorted(sent) == sorted(set(range(m)) - {w})
    for i in range(ceil_log2(m)):
        distance = 1 << (ceil_log2(m) - i - 1)
        for w in range(m):
            step = schedules[w][i]
            assert (step.dst, step.src) == ((w + distance) % m, (w - distance) % m)
            assert schedules[step.src][i].send_blocks == step.recv_blocks
            assert set(step.recv_blocks) <= held[w] - set(step.send_blocks)  # Theorem 1
        for w in range(m):
            held[w] -= set(schedules[w][i].send_blocks)
    assert held == [{w} for w in range(m)]


def test_srs_schedule_matches_the_paper_six_worker_example():
    # Example 1: worker 1 of 6 (here rank 0): B_1 = {2}, B_2 = {3, 4}, B_3 = {5, 6} (E = 2).
    steps = srs_schedule(6, 0)
    assert [s.send_blocks for s in steps] == [(4, 5), (2, 3), (1,)]
    assert [s.dst for s in steps] == [4, 2, 1]  # distances 4, 2, 1 (Example 2)


def test_h_adjuster_follows_algorithm_2():
    adjuster = HAdjuster(L=100, d=3)  # h = k/P = L/d, step = 0.01 k (d-1)/P
    assert adjuster.h == pytest.approx(100 / 3)
    assert adjuster.step == pytest.approx(2 / 3)
    hs = []
    for count in [50, 50, 50, 150, 150, 50]:
        adjuster.update(count)
        hs.append(adjuster.h)
    # worked by hand from Algorithm 2: keep direction (flag, then double), turn and halve
    third = 1 / 3
    expected = [34.0, 34.0 + 4 * third, 34.0 + 8 * third, 36.0, 36.0 - 2 * third, 36.0 - third]
    assert hs == pytest.approx(expected)
    assert adjuster.count() == math.ceil(expected[-1])


def test_h_adjuster_stays_in_the_papers_range():
    adjuster = HAdjuster(L=10, d=2)
    for _ in range(20):
        adjuster.update(0)  # always too few: h grows, but not past L
    assert adjuster.h == 10 and adjuster.count() == 10 and abs(adjuster.step) <= 5
    for _ in range(20):
        adjuster.update(100)  # always too many: h shrinks to L/d
    assert adjuster.h == 5 and adjuster.count() == 5


def test_table1_formulas():
    assert table1_cost(8, 80) == (6, 280.0, 280.0)              # eq. 4: 4k(P-1)/P
    assert table1_cost(8, 80, teams=2) == (5, 280.0, 280.0)      # eq. 7: d = 2 costs as d = 1
    assert table1_cost(6, 60, teams=3) == (4, 2 * 60 * 9 / 18, 2 * 60 * 12 / 6)  # eq. 10


def test_cost_formula_rejects_bad_options():
    with pytest.raises(ValueError, match="dividing"):
        cost("spardl", P=6, n=100, k=10, teams=4)
    with pytest.raises(ValueError, match="power-of-2"):
        cost("spardl", P=6, n=100, k=10, teams=3, sag="recursive")
    with pytest.raises(ValueError, match="auto"):
        cost("spardl", P=6, n=100, k=10, teams="auto")
    assert team_candidates(12) == [1, 2, 3, 4, 6, 12]
    assert team_candidates(12, "recursive") == [1, 2, 4]


# ---------------------------------------------------------------------- invariants, every P
@pytest.mark.parametrize("P", range(1, 9))
def test_one_team_invariants(P):
    n = 1003  # divisible by none of 2..8
    configs = [{"density": density} for density in (0.01, 0.2, 1.0)]
    results = run_workers(P, _trace_all, configs, n, STEPS)
    for index, options in enumerate(configs):
        traces = _per_config(results, index)
        _check_invariants(traces, n, options)
        # Table I, eq. 4: the average rank sends at most 4k(P-1)/P elements
        k = _k(options["density"], n)
        mean_sent = sum(t[0]["stats"]["bytes_sent"] for t in traces) / P
        assert mean_sent <= 4 * k * (P - 1) / P * ELEMENT_BYTES + 1e-9


def _team_configs(P, density=0.1):
    """Every d > 1 dividing P with B-SAG, and with R-SAG where d is a power of 2."""
    configs = []
    for d in range(2, P + 1):
        if P % d == 0:
            configs.append({"density": density, "teams": d, "sag": "bruck"})
            if d & (d - 1) == 0:
                configs.append({"density": density, "teams": d, "sag": "recursive"})
    return configs


@pytest.mark.parametrize("P", range(2, 9))
def test_team_invariants(P):
    n = 1003
    configs = _team_configs(P) + [{"density": 1.0, "teams": P, "sag": "auto"}]
    results = run_workers(P, _trace_all, configs, n, STEPS)
    for index, options in enumerate(configs):
        _check_invariants(_per_config(results, index), n, options)


@pytest.mark.parametrize("P", [4, 6, 8])
def test_traffic_within_table1_per_rank(P):
    """With n and k divisible by every team size, each rank's bytes obey Table I (eq. 4, 7, 10)."""
    n, density = 3360, 0.25  # k = 840, divisible by 1..8
    configs = [{"density": density}] + _team_configs(P, density)
    results = run_workers(P, _trace_all, configs, n, STEPS)
    k = _k(density, n)
    for index, options in enumerate(configs):
        traces = _per_config(results, index)
        rounds, least, most = table1_cost(P, k, options.get("teams", 1), options.get("sag", "auto"))
        for trace in traces:
            for rec in trace:
                stats = rec["stats"]
                assert stats["rounds"] == rounds
                assert least * ELEMENT_BYTES <= stats["bytes_sent"] <= most * ELEMENT_BYTES, options


# ---------------------------------------------------------------------- options, auto, checkpoints
def _bad_options():
    outcomes = []
    for options in [{"density": 0.1, "teams": 4}, {"density": 0.1, "teams": 0},
                    {"density": 0.1, "teams": "two"}, {"density": 0.0}, {"density": 1.5},
                    {"density": 0.1, "teams": 3, "sag": "recursive"}, {"density": 0.1, "sag": "tree"},
                    {"density": 0.1, "teams": "auto", "alpha": 1e-3},
                    {"density": 0.1, "teams": "auto", "auto_trials": 0}]:
        try:
            make_method("spardl", **options)
            outcomes.append("no error")
        except ValueError as exc:
            outcomes.append(str(exc))
    return outcomes


def test_bad_options_raise_clear_errors():
    messages = run_workers(6, _bad_options)[0]
    expected = ["teams=4 must be a positive integer dividing the number of workers P=6",
                "teams=0 must be", "teams='two' must be", "density=0.0 must be", "density=1.5 must be",
                "needs a power-of-2 number of teams; teams=3", "sag='tree' must be one of",
                "give both", "auto_trials=0 must be"]
    for message, fragment in zip(messages, expected, strict=False):
        assert fragment in message


def _auto_choices(n):
    rank = dist.get_rank()
    timed = make_method("spardl", density=0.05, teams="auto", auto_trials=1)
    teams = []
    for step in range(5):
        timed(make_gradient(n, rank, step))
        teams.append(timed.stats["teams"])
    latency = make_method("spardl", density=0.05, teams="auto", alpha=1e-3, beta=0.0)
    latency(make_gradient(n, rank, 0))
    bandwidth = make_method("spardl", density=0.05, teams="auto", alpha=0.0, beta=1e-9)
    bandwidth(make_gradient(n, rank, 0))
    return teams, timed.teams, latency.teams, bandwidth.teams


def test_teams_auto():
    results = run_workers(4, _auto_choices, 2000)
    teams, chosen, latency, bandwidth = results[0]
    assert teams[:3] == [1, 2, 4] and chosen in (1, 2, 4) and teams[3:] == [chosen, chosen]
    assert all(r[:2] == (teams, chosen) for r in results)  # every rank chose the same d
    assert latency == 4      # fewest rounds: 2 ceil(log2 1) + log2 4 = 2 < 3 < 4
    assert bandwidth == 1    # d = 1 and d = 2 tie on bytes (eq. 7); the smaller d wins ties


def _resume(n, options):
    rank = dist.get_rank()
    straight = make_method("spardl", **options)
    outs = [straight(make_gradient(n, rank, step)) for step in range(4)]
    first = make_method("spardl", **options)
    for step in range(2):
        first(make_gradient(n, rank, step))
    resumed = make_method("spardl", **options)
    resumed.load_state_dict(first.state_dict())
    again = [resumed(make_gradient(n, rank, step)) for step in range(2, 4)]
    return all(torch.equal(a, b) for a, b in zip(outs[2:], again, strict=False))


def test_checkpoint_resumes_bsag_exactly():
    assert all(run_workers(6, _resume, 1003, {"density": 0.1, "teams": 3}))


def _calls_lean_or_reference(reference: bool, n: int, calls: int):
    """Outputs and residuals of ``calls`` one-team SparDL calls. ``reference``: the path before the
    first bag's selection joined the accumulating scan and the own block's selection left the
    journal (it selects from G afterwards and journals every change); checks, on every call, that
    outside the final gradient's indices the new residual is G = gradient + residual."""
    import sparsecomm.methods.spardl as spardl_module

    real_srs, real_fused = spardl_module.SparReduceScatter, spardl_module.SparDL._accumulate_selecting
    if reference:
        spardl_module.SparReduceScatter = lambda *args, **kwargs: real_srs(*args, **{**kwargs, "journal_own": True})
        spardl_module.SparDL._accumulate_selecting = lambda *args, **kwargs: None
    try:
        method = make_method("spardl", density=0.05)
        results = []
        for call in range(calls):
            grad = make_gradient(n, dist.get_rank(), call, seed=7)
            G = grad + (0 if method.residual is None else method.residual)  # Algorithm 1, line 1
            out = method(grad)
            outside = out == 0  # outside the final gradient's indices the new residual is G (lines 13-15)
            assert torch.equal(method.residual[outside], G[outside]), f"call {call}: residual is not G outside"
            results.append((out, method.residual.clone()))
        return results
    finally:
        spardl_module.SparReduceScatter = real_srs
        spardl_module.SparDL._accumulate_selecting = real_fused


@pytest.mark.parametrize("P, n", [(1, 1003), (2, 1003), (3, 1003), (5, 1003), (8, 1003),
                                  (1, 300_000), (2, 300_000), (3, 300_000), (4, 300_000)])
def test_first_selections_in_the_scan_and_a_lean_journal_change_no_bit(P, n):
    """The blocks SRS selects before anything is added into G (the first step's bag; the own block
    when P = 1) are selected in the scan that writes G, and with one team the own block's selection,
    G's last change, is not journaled (at P = 1 nothing is and the residual collection is skipped):
    outputs and residuals are the reference path's, bit for bit, call after call (n = 300000: blocks
    large enough for the sampled scan), and outside the final gradient the residual is G, as
    Algorithm 1 lines 13-15 say."""
    lean = run_workers(P, _calls_lean_or_reference, False, n, 3, timeout=120)
    reference = run_workers(P, _calls_lean_or_reference, True, n, 3, timeout=120)
    for mine, theirs in zip(lean, reference, strict=True):
        for (out, residual), (ref_out, ref_residual) in zip(mine, theirs, strict=True):
            assert torch.equal(out, ref_out) and torch.equal(residual, ref_residual)


def _fuses(selector: str) -> bool:
    method = make_method("spardl", density=0.05, selector=selector)
    grad = torch.randn(300_000)
    return method._accumulate_selecting(grad, [(0, 300_000)], [15_000], [0]) is not None


@pytest.mark.parametrize("selector, fused", [("exact_topk", True), ("dgc_sampled", False), ("mstopk", False)])
def test_only_a_stateless_selector_selects_in_the_accumulating_scan(selector, fused):
    """The first cuts happen before the agreement: a selector that keeps state between calls (which a
    refused or skipped call must leave as it was) selects after it, as before."""
    from sparsecomm.selection.scan import Scratch

    expected = fused and Scratch.uses_compiled(torch.empty(300_000))
    assert run_workers(1, _fuses, selector, timeout=60) == [expected]


def _calls_posting_ahead(post: bool, teams: int, calls: int):
    """spardl's outputs with the receives after its agreement posted ahead (``post``) or as each step
    comes, and, with them, how many the team communicator posted and held after each call."""
    from sparsecomm.transport.comm import Communicator

    real = Communicator.post_receives
    posted = []

    def counting(self, sources):
        real(self, sources)
        posted.append(len(self._ahead))

    Communicator.post_receives = counting if post else (lambda self, sources: None)
    try:
        method = make_method("spardl", density=0.05, teams=teams)
        outs, left = [], []
        for call in range(calls):
            outs.append(method(make_gradient(30_000, dist.get_rank(), call, seed=11)))
            left.append(len(method._split(teams)[0]._ahead))
        return outs, posted, left
    finally:
        Communicator.post_receives = real


@pytest.mark.parametrize("P, teams", [(2, 1), (3, 1), (4, 1), (4, 2), (6, 2), (8, 1)])
def test_receives_posted_after_the_agreement_change_no_bit(P, teams):
    """Once the ranks agreed, SparDL posts the receives of the team's remaining messages (SRS unless
    it rode on the agreement, then the Bruck all-gather) together; the messages find them and the
    outputs are the same bits as with each receive posted at its step; no receive is left after a call."""
    ahead = run_workers(P, _calls_posting_ahead, True, teams, 3, timeout=120)
    plain = run_workers(P, _calls_posting_ahead, False, teams, 3, timeout=120)
    m = P // teams
    for rank, ((outs, posted, left), (ref_outs, _, _)) in enumerate(zip(ahead, plain, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs, strict=True))
        position = rank % m
        rides = teams == 1 and P & (P - 1) == 0  # every SRS message rode on the agreement, before the posting
        expected = set() if rides else {s.src for s in srs_schedule(m, position)}
        expected |= {(position + d) % m for d in (1, 2, 4) if d < m}
        assert posted == [len(expected - {position})] * 3 and left == [0] * 3


def _resume_with_selector(selector: str) -> bool:
    options = {"density": 0.05, "selector": selector}
    first, second = make_method("spardl", **options), make_method("spardl", **options)
    grads = [torch.randn(50_000, generator=torch.Generator().manual_seed(step)) for step in range(5)]
    for g in grads[:2]:
        first(g.clone())
    second.load_state_dict(first.state_dict())
    return all(torch.equal(first(g.clone()), second(g.clone())) for g in grads[2:])


@pytest.mark.parametrize("selector", ["dgc_sampled", "exact_topk"])
def test_state_dict_resumes_the_selectors_state(selector):
    """A selector that keeps state between calls (DGC's sampling generator) is part of SparDL's
    checkpoint: the resumed method selects what the uninterrupted one does."""
    assert run_workers(1, _resume_with_selector, selector, timeout=60) == [True]


def _load_into_a_stateless_selector() -> str:
    saved = make_method("spardl", density=0.05, selector="dgc_sampled")
    saved(torch.randn(50_000))
    try:
        make_method("spardl", density=0.05).load_state_dict(saved.state_dict())
    except ValueError as error:
        return str(error)
    return ""


def test_a_selectors_state_into_spardl_without_that_selector_is_refused():
    assert "build it with the selector it was saved with" in run_workers(1, _load_into_a_stateless_selector,
                                                                          timeout=60)[0]
