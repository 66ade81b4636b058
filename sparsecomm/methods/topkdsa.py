"""TopkDSA: local top-k with error feedback, then SparCML's dynamic sparse all-reduce (Renggli et al.,
"SparCML: High-Performance Sparse Communication for Machine Learning", SC'19, section 4), the
"TopkDSA" baseline of SparDL's evaluation ([SparDL], Table I and Fig. 8) and the
"SparCML" baseline of S2 Reducer's ([S2Reducer], section 4).

Per call, on every rank:

1. ``acc = grad + residual``; keep the exact local top-k of ``acc`` (the library's exact selector,
   the same as TopkA's); the rest stays in the residual. The sum is written inside the selection's
   scan, which also tells whether the gradient is finite (:meth:`TopkDSA.accumulate`).
2. The k (index, value) pairs form a sparse stream (:class:`~sparsecomm.transport.sparse_stream.Stream`);
   the streams are summed over the ranks with
   * ``algorithm="recursive_doubling"``: SSAR_Recursive_double, log2 p' rounds (+2 for the fold when P
     is not a power of two); each merged stream switches to dense once its sparse form is larger
     than the dense one (m (s_idx + s_val) > n s_val, i.e. past n/2 pairs for fp32 with int32
     indices), so the traffic of late steps is capped at n values;
   * ``algorithm="split_allgather"``: SSAR_Split_allgather for large results (P - 1 + ceil(log2 P)
     rounds): an all-to-all of P index partitions, a sum per partition, an all-gather of the sums;
   * ``algorithm="auto"`` (default): recursive doubling while the result, P k pairs at most, is
     expected sparse, the split all-gather once it is expected dense (SparCML's rule of thumb).
3. Divide by P. Every pair that was selected is sent whole, so nothing is lost: the residual keeps
   exactly what was not selected.

Cost: :func:`~sparsecomm.transport.sparse_stream.dsa_cost` (exact when the supports of the ranks are
disjoint, else an upper bound) or :func:`~sparsecomm.transport.sparse_stream.split_cost` (a bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..core.cost import Cost, register_cost
from ..core.validate import check_choice
from ..selection import make as make_selector
from ..selection.scan import take_and_clear
from ..transport.comm import Communicator
from ..transport.sparse_stream import Stream, dense_switch_count, dsa_allreduce, dsa_cost, split_allreduce, split_cost
from .base import Layout, Method, Output, register_method

__all__ = ["TopkDSA", "resolve_algorithm", "ALGORITHMS"]

ALGORITHMS = ("auto", "recursive_doubling", "split_allgather")


def resolve_algorithm(algorithm: str, P: int, n: int, k: int, value_size: int = 4) -> str:
    """The variant ``auto`` picks: split all-gather once P k pairs would reach the dense break-even."""
    check_choice("algorithm", algorithm, ALGORITHMS)
    if algorithm != "auto":
        return algorithm
    return "split_allgather" if P > 2 and P * k >= dense_switch_count(n, 1, value_size) else "recursive_doubling"


@register_method("topkdsa")
class TopkDSA(Method):
    """Top-k with error feedback and SparCML's dynamic sparse all-reduce (see the module docstring).

    Args:
        density: k = ceil(density * n) pairs selected per rank.
        algorithm: ``"auto"`` (default), ``"recursive_doubling"`` or ``"split_allgather"``.
        selector: an exact-count selector of :mod:`sparsecomm.selection` (default ``"exact_topk"``,
            exact top-k, the same as TopkA's).
    """

    sparse = True
    has_residual = True
    tracks_sent = True

    def __init__(self, comm: Communicator | None = None, *, density: float, algorithm: str = "auto",
                 selector: str = "exact_topk") -> None:
        super().__init__(comm, density=density)
        self.algorithm = check_choice("algorithm", algorithm, ALGORITHMS)
        self.selector = make_selector(selector)
        if not self.selector.exact_count:
            raise ValueError(f"topkdsa: selector={selector!r} must select exactly k (an exact-count selector)")

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor, layout: Layout) -> Tensor:
        """``acc = residual + grad`` and its exact top-k, in one scan."""
        return self.selector.accumulate(residual, grad, self.k(grad.numel()), dest=acc)

    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        n, P = grad.numel(), self.comm.size
        k = self.k(n)
        acc, idx, _ = out.accumulated  # acc is the residual from here on
        with self.timer("residual"):
            stream = Stream.sparse(n, idx, take_and_clear(acc, idx))  # what stays: acc minus what is sent
        self.last_sent = idx
        self.stats.selected = k
        variant = resolve_algorithm(self.algorithm, P, n, k, grad.element_size())
        with self.timer("comm"):
            if variant == "recursive_doubling":
                total, kinds = dsa_allreduce(self.comm, stream)
            else:
                total, kinds = split_allreduce(self.comm, stream), []
        with self.timer("decompress"):
            if total.dense:
                result = total.to_dense().reshape(-1).div_(P)
            else:  # sorted unique indices: the average written straight into the output buffer
                assert total.indices is not None
                result = out.average([total.indices], [total.values.reshape(-1)], P)
        self.stats["algorithm"] = variant
        self.stats["sent_representation"] = kinds
        self.stats["dense_result"] = total.dense
        return result

    def __repr__(self) -> str:
        return f"TopkDSA(P={self.comm.size}, density={self.density:g}, algorithm={self.algorithm!r})"


@register_cost("topkdsa")
def _topkdsa_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, algorithm: str = "auto",
                  counts: Sequence[int] | None = None, disjoint: bool = False, **_: Any) -> Cost:
    """Recursive doubling: exact for disjoint supports (``disjoint=True``), else a bound; split
    all-gather: a bound. ``counts``: pairs per rank (default k each)."""
    per_rank = list(counts) if counts is not None else [min(k, n)] * P
    variant = resolve_algorithm(algorithm, P, n, k, itemsize)
    if variant == "recursive_doubling":
        return dsa_cost(per_rank, n, rank, 1, itemsize, disjoint=disjoint)
    return split_cost(per_rank, n, rank, 1, itemsize)
