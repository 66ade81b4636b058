"""Fault injection for every method: inputs that only some ranks see, and what every rank must do.

Modelled on how torch.distributed tests mismatched collectives (``TORCH_DISTRIBUTED_DEBUG=DETAIL``
compares shapes and dtypes across ranks) and on NCCL's error checking: one rank (the *culprit*,
rank P-1) gets a bad input, and the outcome must be the same clear error on every rank, naming the
culprit and the cause, within :data:`DEADLINE` seconds, with the method's state unchanged; or the
documented correct behaviour. After every case the next call on finite input must succeed and give
bit-identical replicas.

:func:`fault_worker` runs every case for several methods in one worker launch (cheap: one process
group per P); :func:`evaluate` turns the per-rank records into one verdict per (method, case);
``sparsecomm bench faults`` prints the table (docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.methods import MethodSpec, make_method
from sparsecomm.methods.base import AgreementError, Method
from sparsecomm_lab.gradients import make_gradient

__all__ = ["CASES", "EXPECTED", "DEADLINE", "fault_worker", "evaluate", "run_faults"]

#: the cases, in the order they run on one method instance
CASES = ("nan", "inf", "n_changed", "dtype", "density", "n0", "skip")

#: expected outcome: the cause an error must name (``AgreementError.cause``), or "ok"
EXPECTED = {"nan": "nonfinite", "inf": "nonfinite", "n_changed": "n", "dtype": "dtype", "density": "density",
            "n0": "ok", "skip": "ok"}

#: seconds within which every rank must have raised
DEADLINE = 5.0


def _options(name: str, density: float, **extra: Any) -> dict[str, Any]:
    return dict(MethodSpec.at_density(name, density, **extra).options)


def _state(method: Method) -> tuple[int, bytes]:
    """(step, digest of residual and extra state): to check that a failed call changed nothing."""
    state = method.state_dict()
    return state["step"], _digest([state["residual"]]) + repr(state["extra"]).encode()


def _digest(tensors: Sequence[torch.Tensor | None]) -> bytes:
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"none" if t is None else t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def _inject(case: str, name: str, method: Method, n: int, rank: int, culprit: int, density: float,
            step: int) -> tuple[Method, torch.Tensor]:
    """(the method to call, this rank's gradient) for ``case``."""
    grad = make_gradient(n, rank, step)
    bad = rank == culprit
    if case == "nan" and bad:
        grad[n // 2] = float("nan")
    elif case == "inf" and bad:
        grad[n // 3] = float("inf")
    elif case == "n_changed" and bad:
        grad = make_gradient(n + 1, rank, step)
    elif case == "dtype" and bad:
        grad = grad.double()
    elif case == "density":
        return make_method(name, **_options(name, density * (2 if bad else 1))), grad
    elif case == "n0":
        grad = grad[:0]
    elif case == "skip":
        skipper = make_method(name, nonfinite="skip", **_options(name, density))
        skipper(make_gradient(n, rank, step))          # an agreeing call first
        if bad:
            grad[0] = float("nan")
        return skipper, grad
    return method, grad


def _one_case(case: str, name: str, method: Method, n: int, density: float, step: int) -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    culprit = size - 1
    target, grad = _inject(case, name, method, n, rank, culprit, density, step)
    before = _state(target)
    record: dict[str, Any] = {"rank": rank}
    start = time.perf_counter()
    try:
        out = target(grad)
    except AgreementError as exc:
        record.update(outcome="error", type=type(exc).__name__, message=str(exc), ranks=exc.ranks, cause=exc.cause)
    except Exception as exc:  # anything else is a finding: reported, not hidden
        record.update(outcome="crash", type=type(exc).__name__, message=str(exc), ranks=[], cause="")
    else:
        record.update(outcome="ok", finite=bool(torch.isfinite(out).all()), shape=tuple(out.shape),
                      digest=_digest([out]).hex(), skipped=target.stats.skipped, step_after=target.step)
    record["seconds"] = time.perf_counter() - start
    record["state_unchanged"] = _state(target) == before if record["outcome"] != "ok" else None
    if case == "skip":
        record["state_unchanged"] = _state(target) == before
    # the next call on finite input must succeed, identically on every rank
    try:
        recovered = method(make_gradient(n, rank, step + 1))
        record["recovery"] = _digest([recovered]).hex()
    except Exception as exc:
        record["recovery"] = f"failed: {type(exc).__name__}: {exc}"
    return record


def fault_worker(names: Sequence[str], n: int = 1000, density: float = 0.1) -> dict[str, dict[str, Any]]:
    """Every case of :data:`CASES` for every method in ``names``, on this rank (call in a worker)."""
    rank = dist.get_rank()
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        method = make_method(name, **_options(name, density))
        method(make_gradient(n, rank, 0))               # a first call on which every rank agrees
        table[name] = {}
        for i, case in enumerate(CASES):
            if case == "density" and not method.sparse:
                table[name][case] = {"outcome": "n/a"}      # dense methods take no density
                continue
            table[name][case] = _one_case(case, name, method, n, density, step=2 * i + 1)
    return table


def evaluate(per_rank: Sequence[dict[str, Any]], case: str, P: int) -> tuple[bool, str]:
    """(passed, one-line outcome) of one (method, case) from every rank's record."""
    culprit = P - 1
    expected = EXPECTED[case]
    if all(r["outcome"] == "n/a" for r in per_rank):
        return True, "n/a (dense method: no density)"
    outcomes = {r["outcome"] for r in per_rank}
    recoveries = {r["recovery"] for r in per_rank}
    slowest = max(r["seconds"] for r in per_rank)
    problems = []
    if len(recoveries) != 1 or next(iter(recoveries)).startswith("failed"):
        problems.append("next call " + ("failed" if any(x.startswith("failed") for x in recoveries)
                                        else "gave different replicas"))
    if outcomes != {"ok"} and any(r["state_unchanged"] is False for r in per_rank):
        problems.append("state changed")
    if expected == "ok":
        if outcomes != {"ok"}:
            problems.append("raised: " + next(r["message"] for r in per_rank if r["outcome"] != "ok")[:120])
        elif len({r["digest"] for r in per_rank}) != 1 or not all(r["finite"] for r in per_rank):
            problems.append("replicas differ or not finite")
        elif case == "n0" and any(r["shape"] != (0,) for r in per_rank):
            problems.append("n=0 result is not empty")
        elif case == "skip" and not all(r["skipped"] == 1 and r["state_unchanged"] for r in per_rank):
            problems.append("not skipped on every rank with state unchanged")
        summary = {"n0": "empty result", "skip": "skipped on all ranks"}[case]
    else:
        if outcomes != {"error"}:
            problems.append(f"outcomes {sorted(outcomes)} (need an error on every rank)")
        else:
            if len({r["message"] for r in per_rank}) != 1:
                problems.append("messages differ across ranks")
            if any(r["ranks"] != [culprit] or r["cause"] != expected for r in per_rank):
                problems.append(f"named ranks {per_rank[0]['ranks']} cause {per_rank[0]['cause']!r}")
            if slowest > DEADLINE:
                problems.append(f"slow ({slowest:.1f} s)")
        summary = f"error: {expected}, rank {culprit}, {1e3 * slowest:.0f} ms"
    return (not problems, summary if not problems else "FAIL: " + "; ".join(problems))


def run_faults(P: int, names: Sequence[str], n: int = 1000, density: float = 0.1,
               timeout: float = 240.0) -> dict[str, dict[str, tuple[bool, str]]]:
    """Run :func:`fault_worker` on P local workers and evaluate every (method, case)."""
    from sparsecomm.launch.launcher import run_workers

    records = run_workers(P, fault_worker, list(names), n, density, timeout=timeout, stall_timeout=30.0)
    return {name: {case: evaluate([records[r][name][case] for r in range(P)], case, P) for case in CASES}
            for name in names}
