"""The agreement of a method that accumulates before it (``Method.accumulates``, on the CPU): the
scan of ``acc = residual + grad`` counts the gradient's NaN/Inf for the agreement (no pass of its
own), and ``acc`` is written to a second buffer, so that a skipped or refused step leaves the
residual exactly as it was."""

import pytest
import torch
import torch.distributed as dist

from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import Method, checks, make_method, method_class, sparse_methods
from sparsecomm.methods.exdyna import ExDyna
from sparsecomm.methods.redsync import RedSync
from sparsecomm.methods.select_allgather import SelectAllGather
from sparsecomm.methods.spardl import SparDL

N = 70_000  # large enough for the sampled selection's fused scan (n >= 65536)


def gradient(rank: int, call: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * rank + call))


#: options that make a method fold its agreement at these sizes: Ok-Topk past its dense warm-up (and
#: estimating its threshold every other call, reusing it in between), HiTopKComm with one rank per node
OPTIONS = {"oktopk": {"warmup_steps": 0, "threshold_interval": 2}, "hitopk": {"local_size": 1}}
#: HiTopKComm with two ranks per node agrees before its intra-node reduce-scatter, as a method without
#: an accumulation does
ALIASES = {"hitopk-2-per-node": ("hitopk", {"local_size": 2})}
#: every method that hands the runner its accumulation (its class defines ``accumulate``)
FOLDED = sorted(name for name in sparse_methods() if method_class(name).accumulate is not Method.accumulate)


def _skipped_step_changes_nothing(name, policy, options=None):
    rank = dist.get_rank()
    options = OPTIONS.get(name, {}) if options is None else options
    method = make_method(name, density=0.01, nonfinite=policy, **options)
    reference = make_method(name, density=0.01, **options)  # the same calls without the poisoned one
    assert method.accumulates
    for call in range(2):  # threshold controllers and reused thresholds have moved
        method(gradient(rank, call))
        reference(gradient(rank, call))
    residual, step, state = method.residual.clone(), method.step, repr(method.extra_state())
    poisoned = gradient(rank, 2)
    if rank == 1:
        poisoned[N // 2] = float("nan")
    out = method(poisoned)
    unchanged = torch.equal(method.residual, residual) and method.step == step and repr(method.extra_state()) == state
    after = method(gradient(rank, 3))
    expected = reference(gradient(rank, 3))
    result = bool(out.isnan().all()) if policy == "propagate" else bool((out == 0).all())
    return (unchanged, method.stats.skipped, result, torch.equal(after, expected),
            torch.equal(method.residual, reference.residual))


@pytest.mark.parametrize("name", FOLDED)
@pytest.mark.parametrize("policy", ["skip", "propagate"])
def test_a_skipped_step_leaves_the_residual_bit_for_bit_and_the_next_step_as_without_it(name, policy):
    for unchanged, skipped, result, next_equal, residual_equal in run_workers(3, _skipped_step_changes_nothing, name,
                                                                             policy, timeout=120):
        assert unchanged and skipped == 0  # the next call's stats
        assert result and next_equal and residual_equal


def _refused_step(name, options):
    rank = dist.get_rank()
    method = make_method(name, density=0.01, **options)
    method(gradient(rank, 0))
    residual = None if method.residual is None else method.residual.clone()
    poisoned = gradient(rank, 1)
    if rank == 0:
        poisoned[7] = float("inf")
    try:
        method(poisoned)
        message = "went on"
    except checks.NonFiniteGradientError as exc:
        message = str(exc)
    return message, (method.residual is None if residual is None else torch.equal(method.residual, residual))


@pytest.mark.parametrize("name, options", [("topka", {}), ("sidco", {}), ("redsync", {}), ("hitopk", {"local_size": 1}),
                                           ("oktopk", {}), ("oktopk", {"warmup_steps": 0})])
def test_a_refused_step_names_the_rank_on_every_rank_and_keeps_the_residual(name, options):
    """Ok-Topk's dense warm-up (its default for 512 calls) agrees on its own count, before its all-reduce."""
    for message, unchanged in run_workers(2, _refused_step, name, options, timeout=120):
        assert "NaN/Inf in the gradient of rank 0 (rank 0: 1 non-finite elements)" in message
        assert unchanged


def _counts_of_the_separate_pass(name):
    calls = []
    real = checks.count_nonfinite

    def counting(grad):
        calls.append(grad.numel())
        return real(grad)

    checks.count_nonfinite = counting
    try:
        name, options = ALIASES.get(name, (name, OPTIONS.get(name, {})))
        method = make_method(name, density=0.01, **options)
        for call in range(3):
            method(gradient(dist.get_rank(), call))
        # a first message that rides on the agreement (the all-gather of SelectAllGather, RedSync and ExDyna,
        # SparDL's Spar-Reduce-Scatter at P = 2, on gloo) is timed as the comm
        extra = method.stats.extra
        rides = extra.get("gathered_in_agreement") == 1 or extra.get("rode_agreement") == 1
        assert rides == (isinstance(method, SelectAllGather | RedSync | ExDyna | SparDL) and method.accumulates)
        agreement_s = extra["time_agreement"]
        timed = agreement_s == 0 and method.stats.time_comm > 0 if rides else agreement_s > 0
        return method.accumulates, len(calls), timed
    finally:
        checks.count_nonfinite = real


@pytest.mark.parametrize("name, folded", [(name, True) for name in FOLDED] + [("hitopk-2-per-node", False)])
def test_the_non_finite_count_rides_on_the_selection_scan(name, folded):
    """A folded method never runs the agreement's own pass over a finite gradient; the others do,
    once per call. Either way the agreement is timed (as the comm where it carries the all-gather)."""
    for accumulates, passes, timed in run_workers(2, _counts_of_the_separate_pass, name, timeout=120):
        assert accumulates == folded
        assert passes == (0 if folded else 3)
        assert timed


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("policy", ["skip", "propagate"])
def test_spardl_sending_its_messages_in_the_agreement_skips_a_step_exactly(P, policy):
    """At P a power of two SparDL's Spar-Reduce-Scatter rides on the agreement
    (tests/test_agreement_gather.py): a skipped step still leaves the residual bit for bit and the next
    step as without it."""
    for unchanged, skipped, result, next_equal, residual_equal in run_workers(P, _skipped_step_changes_nothing,
                                                                             "spardl", policy, timeout=120):
        assert unchanged and skipped == 0
        assert result and next_equal and residual_equal


@pytest.mark.parametrize("P", [2, 4, 8])
def test_spardl_sending_its_messages_in_the_agreement_refuses_a_step_on_every_rank(P):
    for message, unchanged in run_workers(P, _refused_step, "spardl", {}, timeout=120):
        assert "NaN/Inf in the gradient of rank 0 (rank 0: 1 non-finite elements)" in message
        assert unchanged


@pytest.mark.parametrize("P", [2, 3, 4])
def test_a_skipped_step_puts_back_the_state_its_accumulation_moved(P):
    """SparDL with a selector that keeps state (DGC's sampling generator) selects the first step's bag
    before the ranks agreed (``moved_by_accumulate``): a skipped step puts the selector back, so the
    next step selects as without the skipped one, whether the messages rode on the agreement (P = 2, 4)
    or not (P = 3)."""
    for unchanged, skipped, result, next_equal, residual_equal in run_workers(
            P, _skipped_step_changes_nothing, "spardl", "skip", {"selector": "dgc_sampled"}, timeout=120):
        assert unchanged and skipped == 0
        assert result and next_equal and residual_equal


def test_the_methods_that_accumulate_are_found():
    assert {"topka", "threshold", "sidco", "spardl", "exdyna", "redsync", "oktopk", "gtopk"} <= set(FOLDED)
