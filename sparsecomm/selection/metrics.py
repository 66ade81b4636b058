"""Sparsification metrics of the ExDyna paper (Yoon and Oh), shared by ExDyna and its comparators.

Every method that uses :class:`SparsificationMetrics` adds to its ``stats``:

* ``density_target``: the user-set density d;
* ``density``: the actual density d' = output non-zeros / n (set by :class:`~sparsecomm.methods.Method`);
* ``density_error``: |d - d'|, equation 6 (for ExDyna d' = k'/n exactly, since its output holds the
  k' selected coordinates);
* ``padding_overhead``: f(t) = P * max_i k_i / sum_i k_i, equation 5, from the per-rank selection
  counts ``counts`` (1.0 when the counts are equal, i.e. an all-gather padded to the largest count
  would send no padding; also 1.0 when nothing was selected; a method that sends no all-gather,
  like CLT-k's broadcast, sets 1.0 itself);
* with ``global_error=True`` only, the error metrics: ``local_error``, ||e_i||, the L2 norm of this
  rank's residual after the step (Section II), and ``global_error``, (1/P) sum_i ||e_i||, equation 1.

The error metrics cost a pass over the residual (the norm) and one extra tiny exchange per step (a
recursive-doubling all-gather of one float64 per rank), so they are off by default: the hot path
reads nothing for bookkeeping. The exchange runs *after* the metered call, in its own meter phase
``"<method>.metrics"``, so it never enters the step's ``bytes_sent`` / ``rounds`` nor the comparison
with the cost model.
Tests compute the global error in the parent from the traced residuals instead.

f(t) needs every rank's count: every method using the mixin learns them in its ``reduce`` (ExDyna
and the all-gather family from the gathered messages) and stores them in ``stats["counts"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..transport.collectives import recursive_doubling_allgather

__all__ = ["padding_overhead", "l2_norm", "SparsificationMetrics"]

#: elements per chunk in :func:`l2_norm`
_NORM_CHUNK = 1 << 16


def l2_norm(x: torch.Tensor) -> float:
    """``||x||_2`` for a metric: norms of 65536-element chunks in x's dtype, combined in float64.

    The chunks' float32 sums keep the relative error near float32's epsilon, and nothing of the size
    of the vector is copied: a float64 copy of a large residual is fresh memory on every step, paid by
    every worker. Chunks whose squares overflow x's dtype are redone in float64.
    """
    if x.numel() == 0:
        return 0.0
    chunks = torch.stack([torch.linalg.vector_norm(c) for c in x.split(_NORM_CHUNK)]).double()
    if not bool(torch.isfinite(chunks).all()):
        chunks = torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64) for c in x.split(_NORM_CHUNK)])
    return float(torch.linalg.vector_norm(chunks))


def padding_overhead(counts: Sequence[int]) -> float:
    """f(t) of equation 5: P * max count / total count (1.0 for an empty selection)."""
    total = sum(counts)
    return len(counts) * max(counts) / total if total else 1.0


class SparsificationMetrics:
    """Mixin for a sparse :class:`~sparsecomm.methods.Method`: adds the metrics above to ``stats``.

    The subclass's ``reduce`` sets ``stats["counts"]`` (the number of coordinates each rank
    contributed, identical list on every rank); the mixin derives the rest after the call.
    Put it first in the bases: ``class X(SparsificationMetrics, Method)``.
    """

    track_global_error: bool = False

    def __call__(self, grad: torch.Tensor, layout=None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        out = super().__call__(grad, layout, out=out)  # type: ignore[misc]
        stats: dict[str, Any] = self.stats  # type: ignore[attr-defined]
        if stats["skipped"] or not stats["n"]:  # nothing was sent: no metrics (Method.__call__)
            return out
        stats["density_target"] = self.density  # type: ignore[attr-defined]
        stats["density_error"] = abs(stats["density"] - self.density)  # type: ignore[attr-defined]
        if "padding_overhead" not in stats:  # a method without an all-gather sets its own
            stats["padding_overhead"] = padding_overhead(stats["counts"])
        if self.track_global_error:  # a pass over the residual and an exchange: only when asked for
            residual = self.residual  # type: ignore[attr-defined]
            local = 0.0 if residual is None else l2_norm(residual)
            stats["local_error"] = local
            stats["global_error"] = self._global_error(local, grad.device)
        return out

    def _global_error(self, local: float, device) -> float:
        comm = self.comm  # type: ignore[attr-defined]
        with comm.meter.phase(f"{self.name}.metrics"):  # type: ignore[attr-defined]
            norms = recursive_doubling_allgather(comm, torch.tensor([local], dtype=torch.float64, device=device))
        return float(sum(float(x) for x in norms)) / comm.size
