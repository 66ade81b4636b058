"""Replicas that start alike and stay alike: agreement on the model and the configuration before any
work, and a checksum of the replicas after it.

Data-parallel training assumes every rank runs the same model with the same options; when one rank
differs, nothing in the gradients' exchange need notice (a learning rate differing on one rank gives
replicas that silently drift apart; another epoch count or batch size leaves a rank waiting for a
collective that never comes). So, in one small collective each, before the first step:

* :func:`check_same_tensors`: the parameters (and buffers) have the same count, shapes and dtypes on
  every rank (the synchronizer checks this before it broadcasts rank 0's parameters, which would
  otherwise hang, or abort in gloo with "Received data size doesn't match expected size");
* :func:`check_same_config`: every option that must match (learning rate and its schedule, batch
  size, epochs, optimizer, model, data, method and its options, seed) is equal on every rank.

Each compares one checksum per rank first (ceil(log2 P) messages of a few int64, over the
communicator's agreement, :meth:`~sparsecomm.transport.comm.Communicator.agree_max`); only when they
differ are the values gathered, so that every rank raises the same :class:`ConfigMismatchError` naming
the first difference and the ranks that hold each value. A rank that never arrives is named after the
process group's timeout (:func:`~sparsecomm.transport.deadline.explain_timeout`).

After the work, :func:`replica_checksums` all-gathers a CRC-32 of each rank's parameters and buffers:
equal replicas, bit for bit, give equal checksums (a run record's ``consistent``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..transport.agreement import AgreementError
from ..transport.comm import Communicator
from ..transport.control import max_all_reduce
from ..transport.deadline import explain_timeout, is_peer_failure

__all__ = ["ConfigMismatchError", "check_same_config", "check_same_tensors", "parameter_checksum",
           "replica_checksums", "gather"]

T = TypeVar("T")


class ConfigMismatchError(AgreementError):
    """The ranks disagree on the model or the configuration; raised on every rank with the same
    message, naming the first difference (``.ranks``: the ranks that differ from the majority)."""


def _within_timeout(comm: Communicator, call: Callable[[], T]) -> T:
    """``call()``, a collective; a peer that never arrives is named after the timeout, on every rank
    left waiting."""
    try:
        return call()
    except RuntimeError as exc:
        if is_peer_failure(exc):
            raise explain_timeout(exc, comm.ranks) from exc
        raise


def _device(comm: Communicator) -> torch.device | None:
    """Where the agreement's header lives: the current GPU on NCCL, the host elsewhere."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(comm.group) == "nccl" else None


def _checksum_agrees(comm: Communicator, checksum: int) -> bool:
    """Whether every rank of ``comm`` holds ``checksum`` (one agreement of two int64)."""
    both = _within_timeout(comm, lambda: max_all_reduce(comm, [checksum, -checksum], device=_device(comm)))
    return both[0] == -both[1]


def _gather(comm: Communicator, value: Any) -> list[Any]:
    rows: list[Any] = [None] * comm.size
    _within_timeout(comm, lambda: dist.all_gather_object(rows, value, group=comm.group))
    return rows


def gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective: every rank's ``value`` (picklable, small), in rank order, the same list on every
    rank; a rank that never arrives is named after the process group's timeout."""
    comm = Communicator(group)
    return [value] if comm.size == 1 else _gather(comm, value)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _holders(values: Sequence[str]) -> tuple[str, list[int]]:
    """``"rank 1 has X, ranks 0, 2 have Y"`` for per-rank ``values`` (texts), majority last, and the
    ranks whose value is not the one most ranks hold (a tie goes to rank 0's)."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    top = max(len(r) for r in groups.values())
    reference = values[0] if len(groups[values[0]]) == top else \
        next(v for v, r in groups.items() if len(r) == top)
    ordered = sorted(groups, key=lambda v: (v == reference, groups[v][0]))
    text = ", ".join(f"{_ranks(groups[v])} {'has' if len(groups[v]) == 1 else 'have'} {v}" for v in ordered)
    return text, [r for r, v in enumerate(values) if v != reference]


def _canonical(value: Any) -> str:
    """A text that is equal for equal option values on every rank (dict keys sorted)."""
    return json.dumps(value, sort_keys=True, default=repr)


def check_same_config(config: Mapping[str, Any], group: dist.ProcessGroup | None = None, *,
                      what: str = "configuration") -> None:
    """Collective: return when ``config`` (option name -> value: plain values, lists, dicts) is equal on
    every rank of ``group``; else raise :class:`ConfigMismatchError` on every rank naming the first
    option (in this rank 0's order) that differs and which ranks hold which value, e.g. ``the ranks'
    training configurations differ: lr: rank 1 has 0.2, ranks 0, 2 have 0.1``.

    Call it once before the first step, with every option that must match across ranks; leave out
    what may differ by rank (paths on local disks, a rank's device)."""
    comm = Communicator(group)
    if comm.size == 1:
        return
    text = _canonical({str(key): value for key, value in config.items()})
    if _checksum_agrees(comm, zlib.crc32(text.encode())):
        return
    configs: list[dict[str, str]] = [{k: _canonical(v) for k, v in row.items()} for row in
                                     _gather(comm, {str(k): v for k, v in config.items()})]
    keys = list(configs[0]) + [k for row in configs[1:] for k in row if k not in configs[0]]
    differing = [key for key in dict.fromkeys(keys) if len({row.get(key, "(not set)") for row in configs}) > 1]
    if not differing:  # equal values, but in another order or spelling: the texts differ all the same
        raise ConfigMismatchError(f"the ranks' {what}s differ in their encoding only (option order or types)",
                                  cause="config")
    key = differing[0]
    described, odd = _holders([row.get(key, "(not set)") for row in configs])
    more = f" (and {len(differing) - 1} more: {', '.join(differing[1:4])}{', ...' if len(differing) > 4 else ''})" \
        if len(differing) > 1 else ""
    raise ConfigMismatchError(f"the ranks' {what}s differ: {key}: {described}{more}; every rank must run "
                              f"with the same {what}", ranks=odd, cause="config")


def check_same_tensors(named: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None = None, *,
                       what: str = "model") -> None:
    """Collective: return when the tensors (``(name, tensor)`` pairs: a model's parameters and
    buffers) have the same count, shapes, dtypes and ``requires_grad``, in the same order, on every
    rank of ``group``;
    else raise :class:`ConfigMismatchError` on every rank naming the first tensor that differs, e.g.
    ``the ranks' models differ at tensor 4: rank 1 has '4.weight' (1, 30) float32, rank 0 has none
    (it has 4 tensors)``. Names are reported, not compared."""
    comm = Communicator(group)
    if comm.size == 1:
        return
    mine = [(name, f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
             + (" frozen" if isinstance(tensor, nn.Parameter) and not tensor.requires_grad else ""))
            for name, tensor in named]
    layout = [kind for _, kind in mine]
    if _checksum_agrees(comm, zlib.crc32(repr(layout).encode())):
        return
    rows: list[list[tuple[str, str]]] = _gather(comm, mine)

    def kind(row: list[tuple[str, str]], i: int) -> str:
        return row[i][1] if i < len(row) else "none"

    first = next(i for i in range(max(len(row) for row in rows)) if len({kind(row, i) for row in rows}) > 1)
    texts = [f"{row[first][0]!r} {row[first][1]}" if first < len(row) else f"none (it has {len(row)} tensors)"
             for row in rows]
    text, odd = _holders(texts)
    raise ConfigMismatchError(f"the ranks' {what}s differ at tensor {first}: {text}; every rank must build the "
                              f"same {what} (the same parameters and buffers, in the same order)",
                              ranks=odd, cause="layout")


def parameter_checksum(tensors: Mapping[str, torch.Tensor] | nn.Module) -> int:
    """CRC-32 of the names and bytes of the tensors (a ``state_dict``, or a module's parameters and
    buffers), in name order: equal replicas give equal checksums on every machine of the same byte
    order."""
    state = tensors.state_dict() if isinstance(tensors, nn.Module) else tensors
    crc = 0
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            crc = zlib.crc32(key.encode(), crc)
            # reshape: a 0-dim tensor (BatchNorm's num_batches_tracked) has no byte view of its own
            raw = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            crc = zlib.crc32(raw.numpy().tobytes(), crc)
    return crc


def replica_checksums(module: nn.Module | Mapping[str, torch.Tensor],
                      group: dist.ProcessGroup | None = None) -> list[int]:
    """Collective: every rank's :func:`parameter_checksum` of ``module``, in rank order (the same list
    on every rank); the replicas are equal when every entry is."""
    comm = Communicator(group)
    mine = parameter_checksum(module)
    if comm.size == 1:
        return [mine]
    return [int(v) for v in _gather(comm, mine)]
