"""Alpha-beta cost model: rounds and bytes per rank for every method, and the time they imply.

Each method registers its formula next to its communication code with :func:`register_cost`; the
formula returns this rank's :class:`Cost` as a function of the worker count P, the gradient length n,
the number of selected elements k, the rank and the method's options. Time is
``rounds * alpha + bytes_sent * beta`` (Hockney's model, as used by all five papers).

``Cost.exact`` says whether the bytes must equal the meter to the byte (deterministic traffic, e.g.
dense collectives) or are an upper bound (data-dependent sparse traffic); ``Cost.rounds_exact`` says
the same of the rounds (exact for most sparse methods too, e.g. SparDL's 2 ceil(log2 P)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List

__all__ = ["Cost", "register_cost", "cost", "available_costs", "chunk_sizes", "ceil_log2",
           "fit_alpha_beta"]


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

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.rounds + other.rounds, self.bytes_sent + other.bytes_sent,
                    self.bytes_recv + other.bytes_recv, self.exact and other.exact,
                    self.rounds_exact and other.rounds_exact)

    def bound(self) -> "Cost":
        """The same figures as upper bounds on the bytes (rounds stay as they are)."""
        return replace(self, exact=False)


CostFormula = Callable[..., Cost]
_FORMULAS: Dict[str, CostFormula] = {}


def register_cost(name: str) -> Callable[[CostFormula], CostFormula]:
    """Decorator: register ``fn(P, n, k, rank, itemsize=4, **options) -> Cost`` for method ``name``."""

    def wrap(fn: CostFormula) -> CostFormula:
        if name in _FORMULAS and _FORMULAS[name] is not fn:
            raise ValueError(f"a cost formula for {name!r} is already registered")
        _FORMULAS[name] = fn
        return fn

    return wrap


def _load_all() -> None:
    from . import collectives  # noqa: F401  (registers the dense collectives' formulas)
    from .methods import available_methods

    available_methods()  # imports every method module, registering its formula


def available_costs() -> List[str]:
    _load_all()
    return sorted(_FORMULAS)


def cost(name: str, P: int, n: int, k: int = 0, rank: int = 0, itemsize: int = 4, **options) -> Cost:
    """This rank's cost of method ``name`` for P workers, n gradient elements, k selected."""
    _load_all()
    if name not in _FORMULAS:
        raise KeyError(f"no cost formula for method {name!r}; known: {sorted(_FORMULAS)}")
    if P < 1 or n < 0 or not 0 <= rank < P:
        raise ValueError(f"invalid P={P}, n={n}, rank={rank}: need P >= 1, n >= 0, 0 <= rank < P")
    return _FORMULAS[name](P=P, n=n, k=k, rank=rank, itemsize=itemsize, **options)


# ---------------------------------------------------------------------- helpers shared by formulas
def ceil_log2(P: int) -> int:
    """ceil(log2 P) for P >= 1 (0 for P = 1)."""
    return (P - 1).bit_length()


def chunk_sizes(n: int, P: int) -> List[int]:
    """Sizes of the P near-equal chunks of n elements (the first n mod P chunks one larger)."""
    base, extra = divmod(n, P)
    return [base + (1 if i < extra else 0) for i in range(P)]


def fit_alpha_beta(samples: List[tuple]) -> tuple:
    """Least-squares alpha, beta from ``(rounds, bytes, seconds)`` samples (both clipped at >= 0)."""
    if len(samples) < 2:
        raise ValueError("fit_alpha_beta needs at least two (rounds, bytes, seconds) samples")
    srr = sum(r * r for r, b, t in samples)
    srb = sum(r * b for r, b, t in samples)
    sbb = sum(b * b for r, b, t in samples)
    srt = sum(r * t for r, b, t in samples)
    sbt = sum(b * t for r, b, t in samples)
    det = srr * sbb - srb * srb
    if math.isclose(det, 0.0, abs_tol=1e-30):
        raise ValueError("samples do not separate rounds from bytes; vary both")
    alpha = (srt * sbb - sbt * srb) / det
    beta = (sbt * srr - srt * srb) / det
    return max(alpha, 0.0), max(beta, 0.0)
