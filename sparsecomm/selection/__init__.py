"""Selection: which gradient elements a rank sends, above the transport and below the methods.

Top-k and threshold selectors: ``make(name, **options)`` returns ``sel(x, k) -> int64 indices``
(:mod:`sparsecomm.selectors` is the same namespace). Every selector picks elements of a 1-D floating
tensor by magnitude; see ``docs/selectors.md`` for the contract of each (exact count, count band, or
none), speed and quality. ``available()`` lists the names:

=================  ===============================================================  =================
name               what                                                             count
=================  ===============================================================  =================
exact_topk         exact top-k (sampled floor + top-k of the candidates)            exactly k
trimmed            RedSync Algorithm 2, trimmed top-k                               exactly k
mstopk             Shi et al. Algorithm 1, MSTopK with N samplings                  exactly k
binary_search      RedSync Algorithm 3, threshold binary search                     in [k, 2k]
sampled_binary_    RedSync's sampled variant: threshold reused for ``interval``     in [k, 2k]
search             calls, searched again when the count leaves the band
dgc_sampled        DGC sampled threshold with adaptation, then top-k of the picks   in [ceil(0.8k), k]
fixed_threshold    a fixed hard threshold                                           no band
scaled_threshold   ExDyna Algorithm 5, online threshold scaling                     no band (adapts)
block_topk         S2 Reducer block-wise top-K by L2 norm                           in [k, k + B - 1]
=================  ===============================================================  =================

Modules: the selectors (:mod:`.exact`, :mod:`.sampled`, :mod:`.search`, :mod:`.threshold`,
:mod:`.block`) over one fused magnitude scan (:mod:`.scan`, with the optional C kernel ``_scan.c``);
:mod:`.registry`; :mod:`.sketch`, the count-sketch of S2 Reducer; :mod:`.metrics`, ExDyna's
sparsification metrics (actual density, padding overhead, global error).
"""

from . import block, exact, sampled, search, threshold  # noqa: F401  (registers the selectors)
from .base import NonFiniteInputError, Selector
from .registry import available, make, option_names, register_selector

__all__ = ["make", "available", "register_selector", "option_names", "Selector", "NonFiniteInputError"]
