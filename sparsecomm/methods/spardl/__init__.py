"""SparDL: sparse all-reduce by Spar-Reduce-Scatter, Spar-All-Gather and Bruck all-gather.

SparDL: Distributed Deep Learning Training with Efficient Sparse Communication (Zhao et al.),
section III. Per call, on every rank:

1. G = gradient + residual (Algorithm 1, lines 1-3); instead of a copy of G, the changes made to G
   are journaled (:class:`.srs.Accumulator`) and undone where step 5 needs G back.
2. The P ranks form d teams of m = P/d consecutive ranks. Inside each team, Spar-Reduce-Scatter
   (:mod:`.srs`) leaves rank w with block w of its team's sum, top-(k/m) sparse. Its messages are
   the call's first (:meth:`SparDL.first_message`): point-to-point steps, step i to rank
   w + 2^(l-i), which the runner may send along with the call's checks where those go to the same
   ranks (one team, P a power of two).
3. With d > 1, Spar-All-Gather between the teams (:mod:`.sag`): R-SAG when d is a power of 2,
   B-SAG otherwise (``sag="auto"``), so that the ranks at one position of every team hold the same
   block of the global sum.
4. A Bruck all-gather inside each team delivers every block to every rank; each block was reduced by
   one rank (and, with SAG, made identical on its d holders), so all ranks assemble the same bits.
5. Global residual collection (Algorithm 1, lines 13-15): at the indices of the final gradient the
   new residual is what this rank discarded there (in-procedure residuals stay where they were
   discarded, SAG discards are shared among their identical holders); at all other indices it is the
   rank's own G (local and end-procedure residuals return to their owner). Residuals are in summed
   (un-averaged) units; the result is the sum / P.

Cost per rank (Table I): d = 1: 2 ceil(log2 P) rounds, 4k(P-1)/P elements (indices and values);
R-SAG: (2 ceil(log2 m) + log2 d) rounds, 2k((2P-2d)/P + (d/P) log2 d) elements (eq. 7);
B-SAG: (2 ceil(log2 m) + ceil(log2 d)) rounds, at most 2k(d^2 + 2P - 3d)/P elements (eq. 10).
Blocks may carry fewer non-zeros than their share of k, so bytes are upper bounds; rounds are exact.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ...core.cost import Cost, ceil_log2, chunk_offsets, chunk_sizes, is_power_of_two, register_cost
from ...core.validate import check_int, is_int, is_number
from ...selection import make as make_selector
from ...selection.base import Selector
from ...selection.scan import Scratch
from ...transport.chunk import pair_bytes
from ...transport.comm import Communicator
from ...transport.control import max_all_reduce
from ...transport.sparse_collectives import allgather_chunks, bruck_sources, bruck_traffic
from ..accumulation import Exchanges, add_checked
from ..base import Layout, Method, Output, register_method
from .sag import HAdjuster, bruck_sag, bsag_traffic, recursive_sag, rsag_traffic
from .srs import Accumulator, BlockSelector, SparReduceScatter, srs_schedule, srs_traffic

__all__ = ["SparDL", "table1_cost", "team_candidates"]

log = logging.getLogger(__name__)

SAG_VARIANTS = ("auto", "recursive", "bruck")


def _resolve_sag(teams: int, sag: str) -> str:
    """The SAG variant run with ``teams`` teams: "none" for one team, else "recursive" or "bruck"."""
    if sag not in SAG_VARIANTS:
        raise ValueError(f"sag={sag!r} must be one of {SAG_VARIANTS} ('recursive' = R-SAG, 'bruck' = B-SAG)")
    if teams == 1:
        return "none"
    if sag == "auto":
        return "recursive" if is_power_of_two(teams) else "bruck"
    if sag == "recursive" and not is_power_of_two(teams):
        raise ValueError(f"sag='recursive' (R-SAG, recursive doubling between teams) needs a power-of-2 "
                         f"number of teams; teams={teams} is not (use sag='bruck' or 'auto')")
    return sag


def _check_teams(teams: Any, P: int) -> int:
    if not is_int(teams) or teams < 1 or P % teams:
        raise ValueError(f"teams={teams!r} must be a positive integer dividing the number of workers "
                         f"P={P}, or 'auto'")
    return int(teams)


def team_candidates(P: int, sag: str = "auto") -> list[int]:
    """The team counts d that ``teams="auto"`` may pick: divisors of P (powers of 2 only for R-SAG)."""
    return [d for d in range(1, P + 1) if P % d == 0 and (sag != "recursive" or is_power_of_two(d))]


def _selector_from(option: None | str | Callable) -> Callable | None:
    if option is None:
        return None  # exact top-k (torch.topk) through BlockSelector's own reused buffer
    if callable(option):
        return option
    if isinstance(option, str):
        return make_selector(option)
    raise ValueError(f"selector={option!r} must be None, a selector name or a callable (x, k) -> indices")


def _keeps_state(selector: Callable | None) -> bool:
    """Whether ``selector`` carries state from one call to the next (a ``sparsecomm.selection``
    selector that is not stateless): its state is then part of the method's checkpoint."""
    return selector is not None and hasattr(selector, "state_dict") and not getattr(selector, "stateless", True)


class _Plan(NamedTuple):
    """One call's plan, made before it communicates (:meth:`SparDL.accumulate`)."""

    started: float  # when the call's work began (timed teams="auto")
    k: int
    teams: int  # d
    modelled: dict[int, float] | None  # each candidate d's modelled seconds, to choose by (teams="auto")
    sag: str  # the SAG variant: "none", "recursive" or "bruck"
    team: Communicator
    cross: Communicator
    srs: SparReduceScatter


@register_method("spardl")
class SparDL(Method):
    """SparDL (Zhao et al.): Spar-Reduce-Scatter + Spar-All-Gather + Bruck all-gather, any P.

    Args:
        comm: communicator (default: all ranks).
        density: fraction selected, k = ceil(density * n); each of the m blocks of a team carries at
            most its share of k (``chunk_sizes(k, m)``), the paper's k/P for d = 1.
        teams: d, the number of teams (a divisor of P), or ``"auto"``: with ``alpha`` and ``beta``
            given, the d of least modelled time (Table I via the ``"spardl"`` cost formula, slowest
            rank); otherwise, as the paper suggests, each candidate d runs ``auto_trials`` real steps
            and the fastest (the slowest rank's best time) is kept. The choice is logged and stays in
            ``stats["teams"]``.
        sag: ``"auto"`` (R-SAG when d is a power of 2, else B-SAG), ``"recursive"`` or ``"bruck"``.
        selector: the per-block selection of Spar-Reduce-Scatter: a name for
            ``sparsecomm.selection.make`` (default ``"exact_topk"``, exact top-k), ``None`` (plain
            ``torch.topk``) or a callable ``(x, k) -> indices``. The traffic bounds assume it
            returns at most k indices. Spar-All-Gather always uses exact top-k: its ranks select
            from identical sums and must keep identical entries, and its chunks are small.
        alpha, beta: seconds per round and per byte for the model-based ``teams="auto"``.
        auto_trials: steps per candidate for the timed ``teams="auto"``.
    """

    sparse = True
    has_residual = True

    def __init__(self, comm: Communicator | None = None, *, density: float, teams: int | str = 1,
                 sag: str = "auto", selector: None | str | Callable = "exact_topk",
                 alpha: float | None = None, beta: float | None = None, auto_trials: int = 2) -> None:
        super().__init__(comm, density=density)
        P = self.comm.size
        _resolve_sag(1, sag)  # validates the name
        if teams == "auto":
            self.candidates = team_candidates(P, sag)
        else:
            fixed = _check_teams(teams, P)
            _resolve_sag(fixed, sag)
            self.candidates = [fixed]
        valid = [v is None or (is_number(v) and v >= 0)
                 for v in (alpha, beta)]
        if (alpha is None) != (beta is None) or not all(valid):
            raise ValueError(f"alpha={alpha!r}, beta={beta!r}: give both (non-negative seconds per round "
                             f"and per byte) or neither")
        check_int("auto_trials", auto_trials, minimum=1)
        self.sag = sag
        self.alpha, self.beta = alpha, beta
        self.auto_trials = auto_trials
        self.teams: int | None = self.candidates[0] if len(self.candidates) == 1 else None
        self.trial_seconds: dict[int, float] = {}
        self._blocks = BlockSelector(_selector_from(selector))
        self._exact = self._blocks if selector is None else BlockSelector()
        self._splits: dict[int, tuple[Communicator, Communicator]] = {}
        self._adjusters: dict[tuple[int, int], HAdjuster] = {}
        self._scratch = Scratch()  # the accumulating scan's buffers

    @classmethod
    def topk_blocks(cls, P: int, n: int, scan: bool = True, teams: int | str = 1, **_: Any) -> list[int]:
        """Spar-Reduce-Scatter's selections, each a top-k of one block of n / m (m = P / d ranks a
        team): the blocks a rank sends after the first step and its own, 2^(ceil(log2 m) - 1) of its m
        blocks (the first step's bag, the other m - 2^(ceil(log2 m) - 1), is selected in the
        accumulation's scan where ``scan``; otherwise by top-k too). One at P = 2, two at P = 3 and
        4, four at P = 5 to 8: the selection grows with P where the other methods' does not. Spar-All-
        Gather's selections (d > 1, chunks of k / m entries) are not counted; ``teams="auto"`` counts
        one team."""
        m = P // teams if isinstance(teams, int) and teams >= 1 and P % teams == 0 else P
        if m <= 1:
            return []  # a team of one: its block is selected in the scan, or the gradient is taken whole
        schedule = srs_schedule(m, 0)
        blocks = [j for step in schedule[1 if scan else 0:] for j in step.send_blocks] + [0]
        sizes = [size for _, size in chunk_offsets(n, m)]
        return [sizes[j] for j in blocks]

    # ------------------------------------------------------------------ choosing d
    def _teams_now(self, n: int, k: int, itemsize: int) -> tuple[int, dict[int, float] | None]:
        """The d of this step (fixed, chosen, or, timed auto, the candidate on trial), and with
        ``alpha`` and ``beta`` before a choice the modelled seconds of each candidate, which the call
        chooses by once it goes on (:meth:`reduce`)."""
        if self.teams is not None:
            return self.teams, None
        if self.alpha is not None and self.beta is not None:
            modelled = {d: max(replay_cost(self.comm.size, n, k, r, itemsize, d, self.sag)
                               .time(self.alpha, self.beta) for r in range(self.comm.size))
                        for d in self.candidates}
            return min(self.candidates, key=lambda d: (modelled[d], d)), modelled
        return self.candidates[min(self.step // self.auto_trials, len(self.candidates) - 1)], None

    def _record_trial(self, d: int, seconds: float) -> None:
        self.trial_seconds[d] = min(seconds, self.trial_seconds.get(d, math.inf))
        if self.step + 1 == len(self.candidates) * self.auto_trials:
            # all ranks must pick the same d: the slowest rank's time of every candidate
            micros = max_all_reduce(self.comm, [int(self.trial_seconds[c] * 1e6) for c in self.candidates])
            self._choose({c: us / 1e6 for c, us in zip(self.candidates, micros, strict=False)}, "timed trials")

    def _choose(self, seconds: dict[int, float], how: str) -> None:
        self.teams = min(self.candidates, key=lambda d: (seconds[d], d))
        self.trial_seconds = dict(seconds)
        log.info("spardl: teams=%d chosen by %s among %s (seconds per step: %s)", self.teams, how,
                 self.candidates, {d: round(s, 6) for d, s in seconds.items()})

    def _split(self, d: int) -> tuple[Communicator, Communicator]:
        if d not in self._splits:
            self._splits[d] = self.comm.split(teams=d, mode="consecutive")
        return self._splits[d]

    def _adjuster(self, n: int, d: int, L: int) -> HAdjuster:
        key = (n, d)
        if key not in self._adjusters or self._adjusters[key].L != L:
            self._adjusters[key] = HAdjuster(L, d)
        return self._adjusters[key]

    # ------------------------------------------------------------------ the call
    def accumulate(self, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, layout: Layout) -> _Plan:
        """The call's teams and blocks, and G = gradient + residual (Algorithm 1, line 1) in one scan
        that also checks the gradient and selects the blocks Spar-Reduce-Scatter sends first
        (:meth:`_accumulate_selecting`). Nothing communicates (the teams' split included), and no state
        changes but the cached split: a choice of d is adopted in :meth:`reduce`."""
        started = time.perf_counter()
        n = grad.numel()
        k = self.k(n)
        d, modelled = self._teams_now(n, k, grad.element_size())
        sag = _resolve_sag(d, self.sag)
        team, cross = self._split(d)
        m, position = team.size, team.rank
        bounds, counts = chunk_offsets(n, m), chunk_sizes(k, m)
        schedule = srs_schedule(m, position)
        select = self._accumulate_selecting(grad, bounds, counts, schedule[0].send_blocks if schedule else (position,))
        picks: dict[int, torch.Tensor] = {}
        if select is None:
            add_checked(residual, grad, acc, self._scratch, self.name)
        else:
            picks = select(residual, grad, acc)
        # the accumulator is G itself, changed in place; its journal stands for G_copy (line 3). With one
        # team nothing changes G after the own block's selection, which then needs no record
        srs = SparReduceScatter(team, Accumulator(acc), bounds, counts, self._blocks, self.timer,
                                journal_own=sag != "none", picks=picks)
        return _Plan(started, k, d, modelled, sag, team, cross, srs)

    def moved_by_accumulate(self) -> list[Any]:
        """The Spar-Reduce-Scatter selector, when it keeps state: the first step's bag is selected with it."""
        selector = self._blocks.selector
        return [selector] if isinstance(selector, Selector) and not selector.stateless else []

    def first_message(self, acc: torch.Tensor, picked: _Plan) -> Exchanges | None:
        """Spar-Reduce-Scatter's steps, the first message made now; their peers in this method's ranks
        (the team's are consecutive). The replies are the Spar-Reduce-Scatter, done."""
        srs, team = picked.srs, picked.team
        if not srs.schedule:
            return None
        first = srs.message(0)
        position, m, base = team.rank, team.size, self.comm.rank - team.rank

        def send() -> SparReduceScatter:
            # the receives of the team's messages (SRS's, then the Bruck all-gather's) are posted together:
            # a peer's message then moves as soon as it is sent
            team.post_receives([step.src for step in srs.schedule] + bruck_sources(m, position))
            srs.exchange(first)
            return srs

        def unpack(received: list[torch.Tensor]) -> SparReduceScatter:
            srs.add_last(received)
            team.post_receives(bruck_sources(m, position))
            return srs
        return Exchanges(parts=first, peers=[(base + step.dst, base + step.src) for step in srs.schedule],
                         next_message=srs.next_message, unpack=unpack, send=send)

    def _accumulate_selecting(self, grad: torch.Tensor, bounds: Sequence[tuple[int, int]], counts: Sequence[int],
                              first: Sequence[int]) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any] | None:
        """G = residual + gradient block by block, each block read once, with the blocks ``first``
        (those Spar-Reduce-Scatter selects before anything is added into G) selected in the same scan
        (``selector.accumulate``, the same entries as selecting from G afterwards), as
        ``select(residual, grad, acc)``; it returns {block: local indices}. ``None`` (one scan of the
        whole gradient, no selection) where the scan kernel does not run, or the SRS selector is not a
        stateless ``Selector``."""
        selector = self._blocks.selector
        if not isinstance(selector, Selector) or not selector.stateless or not self._scratch.uses_compiled(grad):
            return None
        chosen = set(first)

        def accumulate(residual: torch.Tensor, gradient: torch.Tensor, acc: torch.Tensor) -> dict[int, torch.Tensor]:
            if not self._scratch.uses_compiled(residual, gradient, acc):
                raise RuntimeError(f"{self.name}: the scan kernel does not take these tensors (a method bug)")
            picks = {}
            for j, (start, size) in enumerate(bounds):
                span = slice(start, start + size)
                if j in chosen and 0 < counts[j] < size:
                    picks[j] = selector.accumulate(residual[span], gradient[span], counts[j], dest=acc[span])
                elif size:
                    self._scratch.scan(residual[span], math.inf, name=self.name, check_finite=True,
                                       addend=gradient[span], dest=acc[span])
            return picks
        return accumulate

    def reduce(self, grad: torch.Tensor, out: Output) -> torch.Tensor:
        P, n = self.comm.size, grad.numel()
        residual, plan, _ = out.accumulated
        d, sag, team, cross, srs = plan.teams, plan.sag, plan.team, plan.cross, plan.srs
        position = team.rank
        own, selected = srs.own_block()
        if sag == "recursive":
            with self.timer("comm"):
                own = recursive_sag(cross, own, srs.counts[position], self._exact, srs.work)
        elif sag == "bruck":
            own = self._bruck_sag(n, d, cross, own, srs)
        with self.timer("comm"):
            blocks = allgather_chunks(team, own, bruck=True)
        if srs.work.changed:  # else G is the new residual already: nothing recorded, nothing to bring back
            with self.timer("residual"):
                indices = torch.cat([b.indices for b in blocks]).long()
                discarded = residual.index_select(0, indices)  # what this rank discarded there
                srs.work.restore()                    # G everywhere else (G_copy, line 3) ...
                residual.index_copy_(0, indices, discarded)  # ... Algorithm 1, lines 13-15
        with self.timer("decompress"):
            # the blocks are disjoint and each sorted: one ordered sweep, divided on the way
            result = out.average([b.indices for b in blocks], [b.values for b in blocks], P)
        self.stats.update(selected=selected, nnz_out=sum(b.nnz for b in blocks), teams=d, sag=sag, k=plan.k)
        if plan.modelled is not None:
            self._choose(plan.modelled, "cost model")
        elif self.teams is None:
            self._record_trial(d, time.perf_counter() - plan.started)
        return result

    def _bruck_sag(self, n: int, d: int, cross: Communicator, own: Any, srs: SparReduceScatter) -> Any:
        """B-SAG between the teams, with the h of :class:`HAdjuster`."""
        position = srs.comm.rank
        count = srs.counts[position]
        adjuster = self._adjuster(n, d, count)
        # a block whose share of k is its whole length (density 1) cannot overflow L after the
        # all-gather, so it is not pre-selected: nothing needs to be dropped
        dense_block = count >= srs.bounds[position][1]
        h = count if dense_block else adjuster.count()
        with self.timer("comm"):
            own, after = bruck_sag(cross, own, count, h, self._exact, srs.work)
        if not dense_block:
            adjuster.update(after)
        self.stats.update(h=h, sag_count=after)
        return own

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"teams": self.teams, "trial_seconds": dict(self.trial_seconds),
                                 "adjusters": {key: a.state_dict() for key, a in self._adjusters.items()}}
        selector = self._blocks.selector
        if _keeps_state(selector):
            state["selector"] = selector.state_dict()  # type: ignore[union-attr]
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        teams = state.get("teams")
        if teams is not None and teams not in self.candidates:
            raise ValueError(f"saved teams={teams} is not among this method's candidates {self.candidates}")
        if "selector" in state:
            selector = self._blocks.selector
            if not _keeps_state(selector):
                raise ValueError(f"the saved state has a selector's state, but this SparDL's selector {selector!r} "
                                 "keeps none: build it with the selector it was saved with")
            selector.load_state_dict(state["selector"])  # type: ignore[union-attr]
        self.teams = teams if teams is not None else self.teams
        self.trial_seconds = dict(state.get("trial_seconds", {}))
        self._adjusters = {}
        for (n, d), saved in state.get("adjusters", {}).items():
            adjuster = HAdjuster(int(saved["L"]), d)
            adjuster.load_state_dict(saved)
            self._adjusters[(n, d)] = adjuster

    def __repr__(self) -> str:
        return (f"SparDL(P={self.comm.size}, density={self.density:g}, teams={self.teams or 'auto'}, "
                f"sag={self.sag!r})")


# ---------------------------------------------------------------------- cost model
def replay_cost(P: int, n: int, k: int, rank: int, itemsize: int, teams: int, sag: str) -> Cost:
    """This rank's traffic bound, replaying the schedules with block ``j`` carrying at most its share
    of k (``chunk_sizes(k, m)[j]``) pairs; for equal shares it equals Table I (see :func:`table1_cost`)."""
    _check_teams(teams, P)
    variant = _resolve_sag(teams, sag)
    m = P // teams
    position = rank % m
    counts = chunk_sizes(k, m)
    pair = pair_bytes(n, itemsize)
    parts = [srs_traffic(m, position, counts, pair), bruck_traffic([c * pair for c in counts], position)]
    if variant == "recursive":
        parts.append(rsag_traffic(teams, counts[position], pair))
    elif variant == "bruck":
        parts.append(bsag_traffic(teams, counts[position], pair))
    rounds, sent, recv = (sum(p[i] for p in parts) for i in range(3))
    return Cost(rounds, sent, recv, exact=False)


@register_cost("spardl")
def _spardl_cost(P: int, n: int, k: int, rank: int, itemsize: int = 4, teams: int = 1, sag: str = "auto",
                 **_: Any) -> Cost:
    """SparDL, per rank: rounds exact (2 ceil(log2 P/d) + SAG's), bytes an upper bound (``exact=False``).

    Options ``teams`` (d) and ``sag`` as for the method; ``teams="auto"`` has no single cost.
    """
    if teams == "auto":
        raise ValueError("the cost of teams='auto' depends on the choice; pass the chosen teams=d")
    return replay_cost(P, n, k, rank, itemsize, teams, sag)


def table1_cost(P: int, k: float, teams: int = 1, sag: str = "auto") -> tuple[int, float, float]:
    """Table I of the paper: (rounds, least, most elements sent per rank; indices and values counted).

    d = 1: 2 ceil(log2 P) rounds, 4k(P-1)/P (eq. 4). R-SAG: 2 ceil(log2 P/d) + log2 d rounds,
    2k((2P-2d)/P + (d/P) log2 d) (eq. 7). B-SAG: 2 ceil(log2 P/d) + ceil(log2 d) rounds,
    2k(d^2+P-2d)/(Pd) .. 2k(d^2+2P-3d)/P (eq. 10).
    """
    _check_teams(teams, P)
    variant = _resolve_sag(teams, sag)
    d, m = teams, P // teams
    if variant == "none":
        most = 4 * k * (P - 1) / P
        return 2 * ceil_log2(P), most, most
    if variant == "recursive":
        log_d = d.bit_length() - 1
        most = 2 * k * (2 * P - 2 * d + d * log_d) / P
        return 2 * ceil_log2(m) + log_d, most, most
    return (2 * ceil_log2(m) + ceil_log2(d), 2 * k * (d * d + P - 2 * d) / (P * d),
            2 * k * (d * d + 2 * P - 3 * d) / P)
