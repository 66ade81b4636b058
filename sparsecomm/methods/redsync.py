"""RedSync (Fang, Fu, Yang, Hsieh 2019): per-layer residual gradient compression, Alternating Signs
Quantization, and an all-gather of ONE packed message per rank.

Per call (Algorithm 1, one bucket), on every rank:

1. ``acc = grad + residual``, layer by layer, each layer in one scan that also checks the gradient's
   finiteness (:meth:`RedSync.accumulate`): the selector's first scan for a layer sent unquantized
   (its addition fused, :meth:`~sparsecomm.selection.base.Selector.accumulate`), the plain fused scan
   for the others. Each layer of the layout (the whole bucket when ``layout`` is None) is
   compressed by the hybrid policy of section 2.1 (:func:`plan_layers`): small layers (``numel <=
   small_limit``) by exact top-k or sent dense (``small="dense"``); medium layers by trimmed top-k
   (Algorithm 2); large layers (``numel > large_limit``) by threshold binary search (Algorithm 3) or
   its sampled variant. Every layer selects ``k_l = ceil(density * numel_l)``.
2. ASQ (section 2.2, ``quantize="asq"``): on even steps a layer selects its k largest *positive*
   entries, on odd steps its k most *negative*, and sends their indices plus ONE value, their mean.
   What the mean misrepresents (``value - mean``) stays in the residual. Layers named in
   ``unquantized_layers`` (default: the last, the output layer) and dense layers are not quantized.
3. The packed message (:func:`pack_message`): per-layer counts (int32, one per layer), the global
   indices of the sparse layers, then the values (dense layers' values, sparse layers' values, one mean
   per quantized layer), all-gathered in one round per step (``allgatherv``: halving distances
   for powers of two, Bruck otherwise; ceil(log2 P) rounds): the call's first message
   (:meth:`RedSync.first_message`), which the runner may send along with the call's checks (the
   selectors' state is put back if the call does not go on, :meth:`RedSync.moved_by_accumulate`).
4. Decompression (section 2.3): every rank scatter-adds the P messages in rank order, divides by P.

Cost, equation (1): ``T = T_select + lg(p) alpha + (p-1) M D beta + p gamma_1``; the meter sees
ceil(log2 P) rounds and (P-1) message bytes per rank when messages are equal (see :func:`_redsync_cost`
and :func:`equation1_seconds`). Dense synchronization, equation (2), is Rabenseifner's all-reduce
(:func:`equation2_seconds`; ``cost("rabenseifner", ...)`` is one alpha less: its middle two rounds are one).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core.cost import Cost, ceil_log2, register_cost
from ..selection import make as make_selector
from ..selection.scan import Scratch, take_and_clear
from ..transport.chunk import bytes_as, index_dtype
from ..transport.comm import Communicator
from ..transport.merge import ascending
from ..transport.sparse_collectives import allgatherv, allgatherv_cost
from .accumulation import AllGather, add_checked
from .base import Layout, Method, Output, register_method

__all__ = ["RedSync", "LayerSpec", "LayerPart", "plan_layers", "pack_message", "unpack_message",
           "message_nbytes", "equation1_seconds", "equation2_seconds"]

log = logging.getLogger(__name__)

#: selectors whose count is exactly k (the others return a count in a band, e.g. [k, 2k])
_EXACT_COUNT = {"exact_topk", "trimmed", "mstopk"}
_COUNT_DTYPE = torch.int32


# ---------------------------------------------------------------------- the per-layer plan
@dataclass(frozen=True)
class LayerSpec:
    """How one layer travels. ``selector`` is a selector name, or ``"dense"`` (all values, no indices)."""

    offset: int
    numel: int
    selector: str
    quantized: bool

    @property
    def dense(self) -> bool:
        return self.selector == "dense"


def plan_layers(spans: Sequence[tuple[int, int]], *, small_limit: int, large_limit: int, small: str,
                medium: str, large: str, quantize: str | None,
                unquantized_layers: Sequence[int]) -> list[LayerSpec]:
    """RedSync's hybrid policy (section 2.1): the selector and quantization of every layer.

    ``numel <= small_limit``: ``small`` (``"exact_topk"`` or ``"dense"``); ``numel > large_limit``:
    ``large``; otherwise ``medium``. With ``quantize="asq"`` every non-dense layer is quantized except
    those whose position (negative counts from the end) is in ``unquantized_layers``.
    """
    L = len(spans)
    keep = {i % L for i in unquantized_layers if -L <= i < L}
    out = []
    for i, (offset, numel) in enumerate(spans):
        selector = small if numel <= small_limit else large if numel > large_limit else medium
        quantized = quantize == "asq" and selector != "dense" and i not in keep
        out.append(LayerSpec(offset, numel, selector, quantized))
    return out


# ---------------------------------------------------------------------- the packed message
@dataclass
class LayerPart:
    """One layer's share of a message: global ``indices`` (None for a dense layer) and ``values``
    (one per index; the layer's ``numel`` values when dense; ONE mean when quantized)."""

    indices: Tensor | None
    values: Tensor


def pack_message(specs: Sequence[LayerSpec], parts: Sequence[LayerPart],
                 index_type: torch.dtype) -> list[Tensor]:
    """The three tensors of one rank's message: ``[counts (int32, one per layer), indices, values]``.

    ``counts[l]`` is the number of entries of layer l (its numel when dense). Indices of the sparse
    layers follow in layer order; then the values in layer order (a quantized layer contributes one).
    """
    if len(specs) != len(parts):
        raise ValueError(f"pack_message: {len(specs)} layer specs but {len(parts)} parts")
    counts, indices, values = [], [], []
    for spec, part in zip(specs, parts, strict=False):
        if spec.dense:
            if part.indices is not None or part.values.numel() != spec.numel:
                raise ValueError(f"pack_message: dense layer at offset {spec.offset} needs no indices and "
                                 f"{spec.numel} values, got {part.values.numel()}")
            counts.append(spec.numel)
        else:
            count = part.indices.numel()  # type: ignore[union-attr]
            want = 1 if spec.quantized else count
            if part.values.numel() != want:
                raise ValueError(f"pack_message: layer at offset {spec.offset} with {count} indices needs "
                                 f"{want} value(s) (quantized={spec.quantized}), got {part.values.numel()}")
            counts.append(count)
            indices.append(part.indices.to(index_type))  # type: ignore[union-attr]
        values.append(part.values)
    device, dtype = parts[0].values.device, parts[0].values.dtype
    return [torch.tensor(counts, dtype=_COUNT_DTYPE, device=device),
            _joined(indices) if indices else torch.empty(0, dtype=index_type, device=device),
            _joined([v.to(dtype) for v in values])]


def _joined(tensors: list[Tensor]) -> Tensor:
    """``torch.cat(tensors)``, without the copy where there is one tensor (a one-layer bucket)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _shifted(indices: Tensor, offset: int) -> Tensor:
    """A layer's local indices as the bucket's: ``indices + offset``, the tensor itself at offset 0."""
    return indices if offset == 0 else indices + offset


def unpack_message(specs: Sequence[LayerSpec], counts: Tensor, indices: Tensor, values: Tensor) -> list[LayerPart]:
    """Inverse of :func:`pack_message`; raises ``ValueError`` when the lengths do not add up."""
    if counts.numel() != len(specs):
        raise ValueError(f"unpack_message: {counts.numel()} counts for {len(specs)} layers")
    parts, i_at, v_at = [], 0, 0
    for spec, count in zip(specs, counts.tolist(), strict=False):
        if spec.dense:
            if count != spec.numel:
                raise ValueError(f"unpack_message: dense layer at offset {spec.offset} has count {count}, "
                                 f"expected {spec.numel}")
            parts.append(LayerPart(None, values[v_at:v_at + count]))
            v_at += count
            continue
        n_values = 1 if spec.quantized else count
        parts.append(LayerPart(indices[i_at:i_at + count], values[v_at:v_at + n_values]))
        i_at += count
        v_at += n_values
    if i_at != indices.numel() or v_at != values.numel():
        raise ValueError(f"unpack_message: counts account for {i_at} indices and {v_at} values, the message "
                         f"holds {indices.numel()} and {values.numel()}")
    return parts


def split_message(block: Tensor, specs: Sequence[LayerSpec], index_type: torch.dtype,
                  value_type: torch.dtype) -> list[Tensor]:
    """The three tensors of a :func:`pack_message` message that arrived as the ``uint8`` ``block`` (its
    tensors back to back): one count per layer, as many indices as the sparse layers' counts, then
    the values (the rest); views where aligned."""
    count_bytes = len(specs) * _COUNT_DTYPE.itemsize
    counts = bytes_as(block[:count_bytes], _COUNT_DTYPE)
    n_indices = sum(count for spec, count in zip(specs, counts.tolist(), strict=True) if not spec.dense)
    cut = count_bytes + n_indices * index_type.itemsize
    return [counts, bytes_as(block[count_bytes:cut], index_type), bytes_as(block[cut:], value_type)]


def message_nbytes(message: Sequence[Tensor]) -> int:
    """Payload bytes of a packed message (the size header excluded)."""
    return sum(t.numel() * t.element_size() for t in message)


# ---------------------------------------------------------------------- the method
class _Plan(NamedTuple):
    """The layers' spans, how each travels, and the selectors of the sparse ones (by layer)."""

    spans: list[tuple[int, int]]
    specs: list[LayerSpec]
    selectors: dict[int, Any]


@register_method("redsync")
class RedSync(Method):
    """RedSync (Fang et al. 2019): per-layer RGC with the hybrid selector policy, optional ASQ, one
    packed all-gather per step, scatter-add decompression. See the module docstring.

    Args:
        density: fraction selected per layer, ``k_l = ceil(density * numel_l)``.
        quantize: ``None`` or ``"asq"`` (Alternating Signs Quantization, section 2.2).
        small_limit: layers with at most this many elements are "small" (default 32768: the paper's
            128 KB of float32, section 3.1).
        large_limit: layers with more elements are "large" (default 4194304 = 16 MB of float32).
        small: ``"exact_topk"`` (exact top-k, the default) or ``"dense"`` (sent uncompressed).
        medium: selector for medium layers (default ``"trimmed"``, Algorithm 2).
        large: selector for large layers (default ``"sampled_binary_search"``, or ``"binary_search"``
            with ASQ: the paper notes the sampled variant cannot be used with quantization).
        unquantized_layers: layer positions never quantized (default ``(-1,)``, the output layer).
        selector_options: ``{selector name: {option: value}}`` passed to ``selectors.make``.

    After a call ``self.last_sent`` holds the local indices this rank sent (for momentum masking).
    """

    sparse = True
    tracks_sent = True
    has_residual = True

    def __init__(self, comm: Communicator | None = None, *, density: float, quantize: str | None = None,
                 small_limit: int = 32768, large_limit: int = 4194304, small: str = "exact_topk",
                 medium: str = "trimmed", large: str | None = None,
                 unquantized_layers: Sequence[int] = (-1,),
                 selector_options: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(comm, density=density)
        if quantize not in (None, "asq"):
            raise ValueError(f"quantize={quantize!r} must be None or 'asq'")
        if large is None:
            large = "binary_search" if quantize else "sampled_binary_search"
        if quantize and large == "sampled_binary_search":
            raise ValueError("large='sampled_binary_search' cannot be used with quantize='asq' (RedSync "
                             "section 2.2: the reused threshold does not survive the alternating signs); "
                             "use 'binary_search'")
        if "dense" in (medium, large):
            raise ValueError(f"medium={medium!r}, large={large!r}: only small layers may be sent dense")
        if not 0 <= small_limit <= large_limit:
            raise ValueError(f"small_limit={small_limit!r} and large_limit={large_limit!r} must satisfy "
                             "0 <= small_limit <= large_limit")
        self.quantize = quantize
        self.policy: dict[str, Any] = dict(small_limit=int(small_limit), large_limit=int(large_limit), small=small,
                           medium=medium, large=large, quantize=quantize,
                           unquantized_layers=tuple(int(i) for i in unquantized_layers))
        self.selector_options = dict(selector_options or {})
        for name in {small, medium, large} - {"dense"}:
            make_selector(name, **self.selector_options.get(name, {}))  # fail early on a bad name/option
        self._spans: list[tuple[int, int]] | None = None
        self._specs: list[LayerSpec] = []
        self._selectors: dict[int, Any] = {}
        self._pending_selector_state: dict[int, dict[str, Any]] = {}
        self._scratch = Scratch()  # the plain fused scan's buffers

    # ------------------------------------------------------------------ plan
    def _plan(self, n: int, layout: Layout) -> _Plan:
        """The layers' plan for ``layout``: the current one, or a new one (with new selectors, given the
        state loaded for them) that :meth:`reduce` adopts; nothing changes here."""
        spans = [(0, n)] if layout is None else [(int(o), int(m)) for o, m in layout]
        covered = sum(m for _, m in spans)
        if covered != n:
            raise ValueError(f"redsync: the layout covers {covered} of the n={n} elements; it must cover the "
                             "whole bucket without gaps")
        if spans == self._spans:
            return _Plan(spans, self._specs, self._selectors)
        specs = plan_layers(spans, **self.policy)
        selectors = {}
        for i, spec in enumerate(specs):
            if not spec.dense:
                selectors[i] = make_selector(spec.selector, **self.selector_options.get(spec.selector, {}))
                if i in self._pending_selector_state:
                    selectors[i].load_state_dict(self._pending_selector_state[i])
        log.debug("redsync plan: %s", [(s.numel, s.selector, s.quantized) for s in specs])
        return _Plan(spans, specs, selectors)

    def _adopt(self, plan: _Plan) -> None:
        if plan.spans != self._spans:
            self._spans, self._specs, self._selectors = plan.spans, plan.specs, plan.selectors
            for i in plan.selectors:
                self._pending_selector_state.pop(i, None)

    # ------------------------------------------------------------------ compression of one layer
    def _fuses(self, selector: Any, spec: LayerSpec) -> bool:
        """Whether a layer's selection runs in the scan that writes its ``acc`` (a sparse layer sent
        unquantized whose selector checks finiteness)."""
        return not spec.dense and not spec.quantized and selector.check_finite

    def accumulate(self, residual: Tensor, grad: Tensor, acc: Tensor,
                   layout: Layout) -> tuple[_Plan, dict[int, Tensor]]:
        """``acc = residual + grad`` layer by layer, each in one scan that raises
        :class:`~sparsecomm.selection.NonFiniteInputError` on a non-finite gradient: the selector's
        (its indices kept, by layer) where :meth:`_fuses`, else the plain fused scan. Returns (the
        plan, the indices picked)."""
        plan = self._plan(grad.numel(), layout)
        picked: dict[int, Tensor] = {}
        for i, spec in enumerate(plan.specs):
            span = slice(spec.offset, spec.offset + spec.numel)
            selector = plan.selectors.get(i)
            if selector is not None and self._fuses(selector, spec):
                picked[i] = selector.accumulate(residual[span], grad[span], self.k(spec.numel), dest=acc[span])
            else:
                add_checked(residual[span], grad[span], acc[span], self._scratch, self.name)
        return plan, picked

    def moved_by_accumulate(self) -> list[Any]:
        """The current plan's selectors (the sampled binary search reuses its threshold)."""
        return list(self._selectors.values())

    def _compress(self, selector: Any, spec: LayerSpec, x: Tensor, sign: int,
                  picked: Tensor | None = None) -> tuple[LayerPart, Tensor]:
        """(this layer's part of the message, local indices sent); updates ``x`` (the residual) in place.
        ``picked``: the indices the layer's selector already chose (:meth:`accumulate`)."""
        if spec.dense:
            part = LayerPart(None, x.clone())
            x.zero_()
            return part, torch.arange(spec.numel, device=x.device)
        k = self.k(spec.numel)
        if not spec.quantized:
            idx = ascending(selector(x, k) if picked is None else picked)  # sorted: the receivers merge
            part = LayerPart(_shifted(idx, spec.offset), take_and_clear(x, idx))  # x keeps the rest
            return part, idx
        signed = x * sign
        idx = ascending(selector(signed.clamp_(min=0), k))
        idx = idx[signed[idx] > 0]  # fewer than k entries of this sign: send only those
        selected = x[idx]
        mean = selected.sum().div_(max(idx.numel(), 1)).reshape(1)
        x[idx] = selected - mean  # the quantization error stays in the residual
        return LayerPart(idx + spec.offset, mean), idx

    def first_message(self, acc: Tensor, picked: tuple[_Plan, dict[int, Tensor]]) -> AllGather:
        """The packed message, every layer compressed out of ``acc``, as an all-gather whose replies are
        every rank's (counts, indices, values)."""
        plan, chosen = picked
        message = self._message(plan, acc, chosen)

        def send() -> list[list[Tensor]]:
            with self.timer("comm"):
                return allgatherv(self.comm, message)
        return AllGather(parts=message, send=send, unpack=lambda blocks: [
            split_message(block, plan.specs, message[1].dtype, message[2].dtype) for block in blocks])

    def _message(self, plan: _Plan, acc: Tensor, picked: dict[int, Tensor]) -> list[Tensor]:
        """This rank's packed message (:func:`pack_message`), each layer compressed out of ``acc``,
        which keeps the rest (error feedback); sets ``last_sent`` and the message's stats."""
        sign = 1 if self.step % 2 == 0 else -1
        with self.timer("select"):
            parts, sent = [], []
            for i, spec in enumerate(plan.specs):
                part, idx = self._compress(plan.selectors.get(i), spec, acc[spec.offset:spec.offset + spec.numel],
                                           sign, picked.get(i))
                parts.append(part)
                sent.append(_shifted(idx, spec.offset))
            message = pack_message(plan.specs, parts, index_dtype(acc.numel()))
        self.last_sent = _joined(sent)
        self.stats["selected"] = self.last_sent.numel()
        self.stats["message_bytes"] = message_nbytes(message)
        self.stats["asq_sign"] = sign if self.quantize else 0
        return message

    # ------------------------------------------------------------------ the rest of the call
    def reduce(self, grad: Tensor, out: Output) -> Tensor:
        plan, _ = out.accumulated.picked
        self._adopt(plan)
        gathered = out.accumulated.replies
        specs = plan.specs
        with self.timer("decompress"):
            messages = [unpack_message(specs, counts, indices, values) for counts, indices, values in gathered]
            if any(spec.dense for spec in specs):  # dense layers are added in place: divide all of out
                result = out.zeros()
                for indices, values in [_sparse_entries(result, specs, parts) for parts in messages]:
                    result.index_add_(0, indices.long(), values.to(result.dtype))
                result.div_(self.comm.size)
                out.written(None)
                return result
            # each rank's indices are sorted (layer by layer, in layer order): one merge (no dense layer:
            # nothing is added into grad, which gives only the dtype and device)
            received = [_sparse_entries(grad, specs, parts) for parts in messages]
            return out.average([i for i, _ in received], [v for _, v in received], self.comm.size)

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"selectors": {i: sel.state_dict() for i, sel in self._selectors.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._pending_selector_state = {int(i): s for i, s in state.get("selectors", {}).items()}
        for i in list(self._pending_selector_state):
            if i in self._selectors:
                self._selectors[i].load_state_dict(self._pending_selector_state.pop(i))


def _sparse_entries(out: Tensor, specs: Sequence[LayerSpec], parts: Sequence[LayerPart]) -> tuple[Tensor, Tensor]:
    """Add one rank's dense layers into ``out`` (slices) and return the (indices, values) of its
    sparse layers' entries, in layer order (a quantized layer's mean repeated over its indices)."""
    indices, values = [], []
    for spec, part in zip(specs, parts, strict=False):
        if spec.dense:
            out[spec.offset:spec.offset + spec.numel] += part.values
        elif part.indices is not None and part.indices.numel():
            indices.append(part.indices)
            values.append(part.values.expand(part.indices.numel()) if spec.quantized else part.values)
    if not indices:
        return (torch.empty(0, dtype=index_dtype(out.numel()), device=out.device),
                torch.empty(0, dtype=out.dtype, device=out.device))
    if len(indices) == 1:  # one sparse layer: the message's own views, not a copy of them
        return indices[0].contiguous(), values[0].contiguous()
    return torch.cat(indices), torch.cat(values)


# ---------------------------------------------------------------------- cost model
@register_cost("redsync")
def _redsync_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, layout: Layout = None,
                  message_bytes: Sequence[int] | None = None, density: float | None = None,
                  **policy: Any) -> Cost:
    """Equation (1)'s communication terms: ceil(log2 P) rounds and, with equal messages of m bytes,
    (P-1) m sent and received per rank.

    ``message_bytes`` (one per rank, e.g. ``stats["message_bytes"]``) gives the exact figure. Otherwise
    m comes from the plan of ``layout`` (``density`` and the policy options of :class:`RedSync`):
    4 bytes of count per layer, plus per sparse layer k_l indices and k_l values (one value when
    quantized), plus every element of a dense layer. The figure is exact when every sparse layer's
    selector returns exactly k_l and nothing is quantized; else it is an upper bound, with threshold
    binary search counted at its 2 k_l ceiling (and ASQ at k_l entries of one sign).
    """
    if message_bytes is None:
        if density is None:
            raise ValueError("cost('redsync') needs message_bytes= or density= (with the layout and policy)")
        m, exact = _planned_message_bytes(n, layout, density, itemsize, policy)
        message_bytes = [m] * P
    else:
        exact = True
    return allgatherv_cost(message_bytes, P, rank, exact)


def _planned_message_bytes(n: int, layout: Layout, density: float, itemsize: int,
                           policy: dict[str, Any]) -> tuple[int, bool]:
    defaults = dict(small_limit=32768, large_limit=4194304, small="exact_topk", medium="trimmed", large=None,
                    quantize=None, unquantized_layers=(-1,))
    unknown = set(policy) - set(defaults)
    if unknown:
        raise TypeError(f"cost('redsync'): unknown options {sorted(unknown)}")
    opts = {**defaults, **policy}
    if opts["large"] is None:
        opts["large"] = "binary_search" if opts["quantize"] else "sampled_binary_search"
    spans = [(0, n)] if layout is None else [(int(o), int(m)) for o, m in layout]
    index_size = index_dtype(n).itemsize
    total, exact = _COUNT_DTYPE.itemsize * len(spans), True
    for spec in plan_layers(spans, **opts):
        if spec.dense:
            total += spec.numel * itemsize
            continue
        k = min(spec.numel, max(1, math.ceil(density * spec.numel)))
        count = k if spec.selector in _EXACT_COUNT else min(spec.numel, 2 * k)
        exact = exact and spec.selector in _EXACT_COUNT and not spec.quantized
        total += count * index_size + (itemsize if spec.quantized else count * itemsize)
    return total, exact


def equation1_seconds(P: int, message_bytes: float, alpha: float, beta: float, t_select: float = 0.0,
                      gamma1: float = 0.0) -> float:
    """RedSync equation (1): ``T_select + lg(p) alpha + (p-1) (M D) beta + p gamma_1``, with ``M D``
    the bytes of one rank's message and ``gamma_1`` the time to decompress one message."""
    return t_select + ceil_log2(P) * alpha + (P - 1) * message_bytes * beta + P * gamma1


def equation2_seconds(P: int, n: int, alpha: float, beta: float, gamma2: float = 0.0, itemsize: int = 4) -> float:
    """RedSync equation (2), Rabenseifner's dense all-reduce: ``2 lg(p) alpha + 2 (p-1)/p M beta +
    (p-1)/p gamma_2`` (M = n * itemsize bytes, gamma_2 the time to add two M-byte vectors)."""
    return 2 * ceil_log2(P) * alpha + 2 * (P - 1) / P * n * itemsize * beta + (P - 1) / P * gamma2
