"""State that knows the world it was saved in: what a saved hook or synchronizer state must match to
load, and how its residuals move to a job of another size.

Error feedback makes each rank's residual part of the gradient: the sum over ranks of the residuals
is gradient mass that has not reached the model yet (the conservation invariant of
docs/architecture.md). A saved state is therefore one rank's share of that sum, and loading it
anywhere but on the rank that saved it, or into a job of another size, would lose or duplicate mass
without a trace (replicas stay equal, so training goes on). So every state records its world
(``{"size": P, "rank": r}``), and loading checks it:

* **the same world**: each rank loads the state it saved (:func:`check_own`); another rank's state
  is an error naming both ranks (the habit of saving on rank 0 only and loading that file on every
  rank would put rank 0's residual on every rank);
* **another world size**: the caller passes every old rank's state (a list); rank ``r`` of the new
  job gets the residuals of the old ranks ``q`` with ``q % P_new == r``, summed (:func:`fold`), so
  the sum over ranks is conserved: ranks that leave hand theirs to the ranks that stay, and ranks
  that join start from zero. The methods' own adaptive state (thresholds, partitions, team
  choices) depends on the ranks; it starts afresh at the saved step. A warning says so.

A load is a collective when a process group exists (:func:`agree_on_load`): each rank finds its own
problems (keys, method and options, world, residuals of the wrong shape, dtype or with NaN/Inf), then
every rank learns every rank's verdict in one all-gather and raises the same :class:`StateLoadError`,
so no rank trains on while another stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["StateLoadError", "World", "live_world", "saved_world", "as_state_list", "check_keys", "check_own",
           "check_siblings", "fold", "tensor_problem", "agree_on_load"]

log = logging.getLogger(__name__)


class StateLoadError(ValueError):
    """A saved state cannot load into this job: raised with the same message on every rank (when a
    process group exists), naming the ranks and what differs."""


class World(NamedTuple):
    """The ranks of a job: its size and this process's rank in it."""

    size: int
    rank: int

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size}"


def live_world(group: dist.ProcessGroup | None = None) -> World | None:
    """This process's world in ``group`` (``None``: the default group); ``None`` before
    ``init_process_group``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return World(dist.get_world_size(group), dist.get_rank(group))


def saved_world(state: Mapping[str, Any]) -> World | None:
    """The world recorded in a saved state (``None`` when it was saved before any process group)."""
    world = state.get("world")
    if world is None:
        return None
    return World(int(world["size"]), int(world["rank"]))


def as_state_list(states: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One state (a mapping) or every old rank's states (a sequence of mappings), as a list."""
    if isinstance(states, Mapping):
        return [states]
    if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
        raise TypeError(f"expected a state_dict or a list of every rank's state_dicts, got {type(states).__name__}")
    found = list(states)
    if not found or not all(isinstance(s, Mapping) for s in found):
        raise TypeError("expected a non-empty list of state_dicts (one per rank of the job that saved them)")
    return found


def check_keys(state: Mapping[str, Any], required: Sequence[str], owner: str) -> str | None:
    """``None``, or why ``state`` is not a state of ``owner`` (missing keys)."""
    missing = [key for key in required if key not in state]
    if missing:
        return (f"not a {owner} state_dict of this sparsecomm (missing {', '.join(map(repr, missing))}); "
                f"save it with {owner}.state_dict()")
    return None


def check_own(state: Mapping[str, Any], world: World | None, owner: str) -> str | None:
    """``None`` when the single ``state`` was saved by this very rank of a job of this size, else the
    error: another rank's state, or a job of another size (then every old rank's state is needed)."""
    saved = saved_world(state)
    if saved is None or world is None:
        return None
    if saved.size != world.size:
        return (f"the {owner} state was saved by a job of {saved.size} ranks and this job has {world.size}: "
                f"pass every old rank's state, load_state_dict([state_of_rank_0, ..., state_of_rank_"
                f"{saved.size - 1}]), and the residuals are redistributed so that their sum is conserved")
    if saved.rank != world.rank:  # (the same words on every rank given rank r's state: one line for them all)
        return (f"given the {owner} state saved by rank {saved.rank}; every rank loads the state it saved itself "
                f"(a residual is one rank's share of the gradient: loading rank {saved.rank}'s on every rank "
                "duplicates it)")
    return None


def check_siblings(states: Sequence[Mapping[str, Any]], owner: str,
                   same: Sequence[str]) -> tuple[list[Mapping[str, Any]], str | None]:
    """Every old rank's states, ordered by rank, and ``None``; or the problem: not one state per
    rank of one job, or states that differ on a key of ``same``."""
    worlds = [saved_world(s) for s in states]
    if any(w is None for w in worlds):
        return [], f"a {owner} state saved before any process group records no world and cannot be redistributed"
    sizes = sorted({w.size for w in worlds if w is not None})
    ranks = sorted(w.rank for w in worlds if w is not None)
    if len(sizes) != 1 or ranks != list(range(sizes[0])):
        return [], (f"the list holds {owner} states of ranks {ranks} of jobs of {sizes} ranks: pass exactly one "
                    f"state per rank of the job that saved them")
    ordered = sorted(states, key=lambda s: int(s["world"]["rank"]))
    for key in same:
        values = [repr(s.get(key)) for s in ordered]
        odd = [rank for rank, value in enumerate(values) if value != values[0]]
        if odd:
            return [], (f"the saved {owner} states differ in {key!r}: rank {odd[0]} has {ordered[odd[0]].get(key)!r}, "
                        f"rank 0 has {ordered[0].get(key)!r} (states of different runs or steps)")
    return ordered, None


def tensor_problem(value: Any, numel: int | None, dtype: str | None, what: str) -> str | None:
    """``None`` when ``value`` is a 1-D tensor of ``numel`` finite elements of ``dtype`` (a dtype's
    ``str``; ``None``: any), else what is wrong with it."""
    if not isinstance(value, torch.Tensor):
        return f"{what} is a {type(value).__name__} ({value!r:.40}), not a tensor"
    if value.dim() != 1 or (numel is not None and value.numel() != numel):
        expected = "1-D" if numel is None else f"({numel},)"
        return f"{what} has shape {tuple(value.shape)}, expected {expected}"
    if dtype is not None and str(value.dtype) != dtype:
        return f"{what} is {value.dtype}, the parameter {dtype}"
    if value.is_floating_point():
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            return f"{what} holds {bad} NaN/Inf value(s)"
    return None


def fold(tensors: Sequence[torch.Tensor | None], rank: int, size: int) -> torch.Tensor | None:
    """Rank ``rank``'s share in a job of ``size`` ranks of the per-old-rank ``tensors``: the sum of
    those of the old ranks ``q`` with ``q % size == rank`` (zeros when there are none), so the sum
    over the new ranks equals the sum over the old ones. ``None`` when every tensor is ``None``."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    total = torch.zeros_like(present[0])
    for old_rank in range(rank, len(tensors), size):
        tensor = tensors[old_rank]
        if tensor is not None:
            total += tensor.to(total.dtype)
    return total


def agree_on_load(problem: str | None, group: dist.ProcessGroup | None, owner: str) -> None:
    """Collective when a process group exists: raise the same :class:`StateLoadError` on every rank
    when any rank found a ``problem`` in the state it was loading, naming those ranks; else return.
    Without a process group, raise this rank's problem."""
    world = live_world(group)
    if world is None or world.size == 1:
        if problem is not None:
            raise StateLoadError(f"cannot load the {owner} state: {problem}")
        return
    rows: list[str | None] = [None] * world.size
    dist.all_gather_object(rows, problem, group=group)
    bad = [(rank, text) for rank, text in enumerate(rows) if text is not None]
    if not bad:
        return
    texts: dict[str, list[int]] = {}
    for rank, text in bad:
        texts.setdefault(text, []).append(rank)
    parts = [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {text}"
             for text, ranks in texts.items()]
    raise StateLoadError(f"cannot load the {owner} state on {len(bad)} of {world.size} ranks; " + "; ".join(parts))
