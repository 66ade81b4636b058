"""Alpha-beta cost model: rounds and bytes per rank, the time they imply, and the formula registries.

Each method registers its formula next to its communication code with :func:`register_cost`
(:data:`METHOD_COSTS`, one per method, under the method's name); each collective, and each other
communication part a method or technique is built from, with :func:`register_collective_cost`
(:data:`COLLECTIVE_COSTS`: ``ring_allreduce``, ``bruck_allgather``, ``pto``, ...). The formula returns
this rank's :class:`Cost` as a function of the worker count P, the gradient length n, the number of
selected elements k, the rank and the method's options. Time is ``rounds * alpha + bytes_sent * beta``
(Hockney's model, as used by all five papers).

``Cost.exact`` says whether the bytes must equal the meter to the byte (deterministic traffic, e.g.
dense collectives) or are an upper bound (data-dependent sparse traffic); ``Cost.rounds_exact`` says
the same of the rounds (exact for most sparse methods too, e.g. SparDL's 2 ceil(log2 P)).

This module is a leaf: it imports nothing of the library. The lookup that first imports every
method, so that all formulas are registered, is :func:`sparsecomm.methods.cost` (and
:func:`sparsecomm.methods.collective_cost`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .registry import Registry

__all__ = ["Cost", "ZERO", "METHOD_COSTS", "COLLECTIVE_COSTS", "register_cost", "register_collective_cost",
           "evaluate", "ceil_log2", "is_power_of_two",
           "chunk_sizes", "chunk_offsets", "fit_alpha_beta"]


@dataclass(frozen=True)
class Cost:
    """One rank's traffic for one call: rounds (latency terms) and payload bytes."""

    rounds: int
    bytes_sent: int
    bytes_recv: int
    exact: bool = True
    rounds_exact: bool = True

    def time(self, alpha: float, beta: float) -> float:
        """Seconds under latency ``alpha`` (s per round) and inverse bandwidth ``beta`` (s per byte)."""
        return self.rounds * alpha + self.bytes_sent * beta

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.rounds + other.rounds, self.bytes_sent + other.bytes_sent,
                    self.bytes_recv + other.bytes_recv, self.exact and other.exact,
                    self.rounds_exact and other.rounds_exact)

    def bound(self) -> Cost:
        """The same figures as upper bounds on the bytes (rounds stay as they are)."""
        return replace(self, exact=False)

    def estimate(self) -> Cost:
        """The same figures as an estimate of both rounds and bytes (a backend's own algorithm)."""
        return replace(self, exact=False, rounds_exact=False)


#: No traffic (P = 1, or nothing to send).
ZERO = Cost(0, 0, 0)

CostFormula = Callable[..., Cost]
#: ``fn(P, n, k, rank, itemsize=4, **options) -> Cost`` per method name.
METHOD_COSTS: Registry[CostFormula] = Registry("method cost formula")
#: ``fn(P, n, k, rank, itemsize=4, **options) -> Cost`` per collective (or other communication part).
COLLECTIVE_COSTS: Registry[CostFormula] = Registry("collective cost formula")


def register_cost(name: str) -> Callable[[CostFormula], CostFormula]:
    """Decorator: register method ``name``'s ``fn(P, n, k, rank, itemsize=4, **options) -> Cost``."""
    return METHOD_COSTS.register(name)


def register_collective_cost(name: str) -> Callable[[CostFormula], CostFormula]:
    """Decorator: register collective ``name``'s ``fn(P, n, k, rank, itemsize=4, **options) -> Cost``."""
    return COLLECTIVE_COSTS.register(name)


def evaluate(name: str, P: int, n: int, k: int = 0, rank: int = 0, itemsize: int = 4, *,
             formulas: Registry[CostFormula] = METHOD_COSTS, **options) -> Cost:
    """This rank's cost of the formula registered as ``name`` in ``formulas`` (the methods' by default;
    see :func:`sparsecomm.methods.cost`)."""
    formula = formulas.get(name)
    if P < 1 or n < 0 or not 0 <= rank < P:
        raise ValueError(f"invalid P={P}, n={n}, rank={rank}: need P >= 1, n >= 0, 0 <= rank < P")
    return formula(P=P, n=n, k=k, rank=rank, itemsize=itemsize, **options)


# ---------------------------------------------------------------------- arithmetic shared by formulas
def ceil_log2(P: int) -> int:
    """ceil(log2 P) for P >= 1 (0 for P = 1)."""
    return (P - 1).bit_length()


def is_power_of_two(P: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return P >= 1 and P & (P - 1) == 0


def chunk_sizes(n: int, P: int) -> list[int]:
    """Sizes of the P near-equal chunks of n elements (the first n mod P chunks one larger)."""
    base, extra = divmod(n, P)
    return [base + (1 if i < extra else 0) for i in range(P)]


def chunk_offsets(n: int, P: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the P near-equal chunks of ``[0, n)``."""
    out, start = [], 0
    for size in chunk_sizes(n, P):
        out.append((start, size))
        start += size
    return out


def fit_alpha_beta(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares alpha, beta from ``(rounds, bytes, seconds)`` samples (both clipped at >= 0)."""
    if len(samples) < 2:
        raise ValueError("fit_alpha_beta needs at least two (rounds, bytes, seconds) samples")
    design = np.array([[r, b] for r, b, _ in samples], dtype=float)
    seconds = np.array([t for _, _, t in samples], dtype=float)
    if np.linalg.matrix_rank(design) < 2:
        raise ValueError("samples do not separate rounds from bytes; vary both")
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)
