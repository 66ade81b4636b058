"""Invariant checks shared by every method's tests (docs/architecture.md, "Invariants every method keeps").

Typical use in a test::

    traces = run_workers(P, trace_method, "spardl", {"density": 0.1}, 1000, 3)
    assert_consistent(traces)
    assert_conserved(traces)

:func:`trace_method` runs in each worker: it feeds the method ``steps`` seeded random gradients and
records, per step, the input gradient, the residual before and after, the output and the stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from sparsecomm_lab.gradients import make_gradient

from sparsecomm.methods import cost

__all__ = ["make_gradient", "trace_method", "assert_consistent", "assert_conserved",
           "assert_equals_dense", "assert_traffic_matches"]


def trace_method(name: str, options: dict[str, Any], n: int, steps: int, seed: int = 0,
                 layout: Sequence[tuple[int, int]] | None = None, kind: str = "normal",
                 dtype=torch.float32) -> list[dict[str, Any]]:
    """Worker function: run method ``name`` for ``steps`` steps and record everything (see module doc)."""
    import torch.distributed as dist

    from sparsecomm.methods import make_method

    rank = dist.get_rank()
    method = make_method(name, **options)
    records = []
    for step in range(steps):
        grad = make_gradient(n, rank, step, seed, dtype, kind)
        old = None if method.residual is None else method.residual.clone()
        out = method(grad.clone(), layout)
        records.append({
            "grad": grad, "old_residual": old, "out": out.clone(),
            "new_residual": None if method.residual is None else method.residual.clone(),
            "stats": dict(method.stats),
        })
    return records


def assert_consistent(traces: list[list[dict[str, Any]]]) -> None:
    """Every rank returned the same tensor, bit for bit, at every step."""
    for step, first in enumerate(traces[0]):
        for rank, trace in enumerate(traces[1:], start=1):
            if not torch.equal(trace[step]["out"], first["out"]):
                diff = (trace[step]["out"] - first["out"]).abs().max().item()
                raise AssertionError(f"step {step}: rank {rank}'s result differs from rank 0's "
                                     f"(max abs difference {diff:g})")


def assert_conserved(traces: list[list[dict[str, Any]]], rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """sum_r (grad_r + old residual_r) == P * out + sum_r new residual_r, at every step."""
    P = len(traces)
    for step in range(len(traces[0])):
        recs = [trace[step] for trace in traces]
        given = sum(r["grad"].double() + (0 if r["old_residual"] is None else r["old_residual"].double())
                    for r in recs)
        kept = sum(0 if r["new_residual"] is None else r["new_residual"].double() for r in recs)
        accounted = P * recs[0]["out"].double() + kept
        if not torch.allclose(given, accounted, rtol=rtol, atol=atol):
            err = (given - accounted).abs().max().item()
            raise AssertionError(f"step {step}: conservation broken, max |given - (P*out + residuals)| = {err:g}")


def assert_equals_dense(traces: list[list[dict[str, Any]]], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The result equals the dense average of the gradients (density 1: no residual left)."""
    P = len(traces)
    for step in range(len(traces[0])):
        dense = sum(trace[step]["grad"].double() for trace in traces) / P
        out = traces[0][step]["out"].double()
        if not torch.allclose(out, dense, rtol=rtol, atol=atol):
            raise AssertionError(f"step {step}: result differs from the dense average by "
                                 f"{(out - dense).abs().max().item():g}")


def assert_traffic_matches(traces: list[list[dict[str, Any]]], name: str, n: int, k: int = 0,
                           itemsize: int = 4, **options: Any) -> None:
    """Each rank's metered bytes and rounds equal the cost model (``exact`` / ``rounds_exact``
    formulas) or stay within it (bounds)."""
    P = len(traces)
    for rank, trace in enumerate(traces):
        expected = cost(name, P=P, n=n, k=k, rank=rank, itemsize=itemsize, **options)
        for step, rec in enumerate(trace):
            s = rec["stats"]
            got = (s["rounds"], s["bytes_sent"], s["bytes_recv"])
            want = (expected.rounds, expected.bytes_sent, expected.bytes_recv)
            rounds_ok = got[0] == want[0] if expected.rounds_exact else got[0] <= want[0]
            bytes_ok = got[1:] == want[1:] if expected.exact else got[1] <= want[1] and got[2] <= want[2]
            if not (rounds_ok and bytes_ok):
                relation = (f"rounds {'=' if expected.rounds_exact else '<='}, "
                            f"bytes {'=' if expected.exact else '<='}")
                raise AssertionError(f"{name}: rank {rank} step {step}: metered (rounds, sent, recv) = {got}, "
                                     f"cost model {want} ({relation}; P={P}, n={n}, k={k})")
