"""The agreement of a method that agrees after its selection's scan (``Method.agrees_in_reduce``):
the scan of ``acc = residual + grad`` counts the gradient's NaN/Inf for the agreement (no pass of
its own), and ``acc`` is written to a second buffer, so that a skipped or refused step leaves the
residual exactly as it was."""

import pytest
import torch
import torch.distributed as dist

from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import agreement, make_method

N = 70_000  # large enough for the sampled selection's fused scan (n >= 65536)


def gradient(rank: int, call: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * rank + call))


def _skipped_step_changes_nothing(name, policy):
    rank = dist.get_rank()
    method = make_method(name, density=0.01, nonfinite=policy)
    reference = make_method(name, density=0.01)  # the same calls without the poisoned one
    assert method.agrees_in_reduce
    method(gradient(rank, 0))
    reference(gradient(rank, 0))
    residual, step = method.residual.clone(), method.step
    poisoned = gradient(rank, 1)
    if rank == 1:
        poisoned[N // 2] = float("nan")
    out = method(poisoned)
    unchanged = torch.equal(method.residual, residual) and method.step == step
    after = method(gradient(rank, 2))
    expected = reference(gradient(rank, 2))
    result = bool(out.isnan().all()) if policy == "propagate" else bool((out == 0).all())
    return (unchanged, method.stats.skipped, result, torch.equal(after, expected),
            torch.equal(method.residual, reference.residual))


@pytest.mark.parametrize("name", ["topka", "topk", "cltk", "spardl", "topkdsa", "gtopk", "s2reducer", "omnireduce"])
@pytest.mark.parametrize("policy", ["skip", "propagate"])
def test_a_skipped_step_leaves_the_residual_bit_for_bit_and_the_next_step_as_without_it(name, policy):
    for unchanged, skipped, result, next_equal, residual_equal in run_workers(3, _skipped_step_changes_nothing, name,
                                                                             policy, timeout=120):
        assert unchanged and skipped == 0  # the next call's stats
        assert result and next_equal and residual_equal


def _refused_step(name):
    rank = dist.get_rank()
    method = make_method(name, density=0.01)
    method(gradient(rank, 0))
    residual = method.residual.clone()
    poisoned = gradient(rank, 1)
    if rank == 0:
        poisoned[7] = float("inf")
    try:
        method(poisoned)
        message = "went on"
    except agreement.NonFiniteGradientError as exc:
        message = str(exc)
    return message, torch.equal(method.residual, residual)


def test_a_refused_step_names_the_rank_on_every_rank_and_keeps_the_residual():
    for message, unchanged in run_workers(2, _refused_step, "topka", timeout=120):
        assert "NaN/Inf in the gradient of rank 0 (rank 0: 1 non-finite elements)" in message
        assert unchanged


def _counts_of_the_separate_pass(name):
    calls = []
    real = agreement.count_nonfinite

    def counting(grad):
        calls.append(grad.numel())
        return real(grad)

    agreement.count_nonfinite = counting
    try:
        method = make_method(name, density=0.01)
        for call in range(3):
            method(gradient(dist.get_rank(), call))
        return method.agrees_in_reduce, len(calls), method.stats.extra["time_agreement"] > 0
    finally:
        agreement.count_nonfinite = real


@pytest.mark.parametrize("name, folded", [("topka", True), ("topk", True), ("cltk", True),
                                          ("spardl", True), ("topkdsa", True), ("gtopk", True),
                                          ("s2reducer", True), ("omnireduce", True), ("threshold", False)])
def test_the_non_finite_count_rides_on_the_selection_scan(name, folded):
    """A folded method never runs the agreement's own pass over a finite gradient; the others do,
    once per call. Either way the agreement is timed."""
    for agrees_in_reduce, passes, timed in run_workers(2, _counts_of_the_separate_pass, name, timeout=120):
        assert agrees_in_reduce == folded
        assert passes == (0 if folded else 3)
        assert timed
