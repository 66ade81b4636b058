"""From the campaign's records to its figures: best learning rates, the target, steps and time to it.

* **The target** is DDP's validation metric at 75% of the budget (at DDP's best learning rate, the
  median over seeds). DDP must have stopped improving by the end: :func:`plateau` is its relative
  improvement over the last fifth of the budget (the campaign asks for less than 1%).
* **Steps to the target** of a run: the first evaluation at or past the target.
* **Time to the target** is composed: ``steps in the warm-up x the warm-up step + the remaining
  steps x the main step``, the step times measured on each network by the timing phase (the median
  over its runs); the confirmation phase checks the composition against full runs (their median).
* **The limit** is the floor's step x DDP's steps to the target: the soonest any synchronization
  could reach the target on this machine.
* **A policy arm** (``dense_fallback``) has, on each network, the figures of the branch its timing
  run took there (:meth:`Campaign.result`) and its own step times.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .plan import Arm, Workload, arms_of, branches
from .run import TIMING_WARMUP, final_metric, majority

__all__ = ["ArmResult", "Campaign", "analyse", "median_spread", "median_with_misses"]


def _metric(point: dict[str, Any], metric: str) -> float:
    value = point["test_loss"] if metric == "loss" else point["test_accuracy"]
    return math.nan if value is None else float(value)


def _reaches(value: float, target: float, metric: str) -> bool:
    return value <= target if metric == "loss" else value >= target


def _at_step(record: dict[str, Any], step: int, metric: str) -> float:
    """The metric of the last evaluation at or before ``step``."""
    points = [p for p in record["history"] if p["step"] <= step]
    return _metric(points[-1], metric) if points else math.nan


def steps_to_target(record: dict[str, Any], target: float, metric: str) -> int | None:
    for point in record["history"]:
        if _reaches(_metric(point, metric), target, metric):
            return int(point["step"])
    return None


def median_spread(values: Sequence[float], digits: int = 3) -> str:
    """``median (least-most)``, or the value alone."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}g}"
    return f"{med:.{digits}g} ({min(values):.{digits}g}-{max(values):.{digits}g})"


def median_with_misses(values: Sequence[float | None], digits: int = 3) -> str:
    """The median over seeds where a seed that never reached the target (None) counts as infinitely
    late, then the range: ``median (least-most)``; ``not reached`` where the median or the most is."""
    if not values:
        return "-"
    late = [math.inf if v is None else float(v) for v in values]

    def fmt(v: float) -> str:
        return "not reached" if math.isinf(v) else f"{v:.{digits}g}"

    med = statistics.median(late)
    if len(late) == 1:
        return fmt(med)
    return f"{fmt(med)} ({fmt(min(late))}-{fmt(max(late))})"


def _phase_times(record: dict[str, Any], warmup: int, decided_after: int = 0) -> tuple[float | None, float]:
    """(median warm-up step s or None, median main step s) of a timing record; the first 2 steps of
    each phase are left out (first-touch allocations, the switch of method). With ``dense_fallback``
    the main steps are those after its decision (``decided_after``)."""
    times = [s["time"] for s in record["steps"]]
    main = times[decided_after + 2:] if decided_after else times[warmup + 2:] if warmup else times[3:]
    warm = statistics.median(times[2:warmup]) if warmup > 2 else None
    return warm, statistics.median(main)


@dataclass
class ArmResult:
    """What the campaign found for one arm: its grid, best learning rate and, per seed, steps to the
    target and final metric; per network, its step times and composed times to the target."""

    arm: Arm
    grid: dict[float, float] = field(default_factory=dict)             # lr -> final metric at seed 0
    best_lr: float | None = None
    steps: dict[int, int | None] = field(default_factory=dict)           # seed -> steps to target
    final: dict[int, float] = field(default_factory=dict)                # seed -> final metric
    warmup: int = 0                                                      # dense warm-up steps of its runs
    #: net -> (warm-up, main) step s: the medians over its timing runs there
    step_s: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    timing_runs: dict[str, int] = field(default_factory=dict)            # net -> timing runs they rest on
    load: dict[str, float | None] = field(default_factory=dict)          # net -> the highest load before them
    bytes_per_step: float | None = None
    #: a policy arm: net -> the decision its timing runs took there ("method" or "dense"; the most of them)
    decision: dict[str, str] = field(default_factory=dict)

    def time_to_target(self, net: str, seed: int) -> float | None:
        """The composed time to the target on ``net`` for ``seed`` (None: not reached, or untimed)."""
        steps = self.steps.get(seed)
        if steps is None or net not in self.step_s:
            return None
        warm_s, main_s = self.step_s[net]
        in_warmup = min(steps, self.warmup) if warm_s is not None else 0
        return in_warmup * (warm_s or 0.0) + (steps - in_warmup) * main_s

    def times(self, net: str) -> list[float]:
        """Composed times over the seeds that reached the target."""
        return [t for seed in sorted(self.steps) for t in [self.time_to_target(net, seed)] if t is not None]

    def median_time(self, net: str) -> float:
        """Median over seeds, a seed that never reached the target counting as infinitely late."""
        values = [self.time_to_target(net, seed) for seed in sorted(self.steps)]
        return statistics.median([math.inf if v is None else v for v in values]) if values else math.inf


@dataclass
class Campaign:
    """The analysed campaign of one workload."""

    workload: Workload
    arms: dict[str, ArmResult]
    target: float | None
    plateau: float | None
    ddp_steps: float | None                     # DDP's median steps to the target
    nets: list[str]
    confirmations: dict[str, dict[str, Any]]    # net -> {"measured": s, "composed": s, "ratio": x, "runs": n}

    def result(self, name: str, net: str | None = None) -> ArmResult:
        """Arm ``name``'s figures on ``net``: a policy's are those of the branch its timing runs took
        there (its kept branch where ``net`` is None or untimed), with its own step times."""
        result = self.arms[name]
        if not result.arm.is_policy:
            return result
        branch = self.arms[branches(result.arm)[result.decision.get(net or "", "method")].name]
        return dataclasses.replace(branch, arm=result.arm, step_s=result.step_s, timing_runs=result.timing_runs,
                                   load=result.load, decision=result.decision, warmup=result.warmup)

    def branch_names(self) -> set[str]:
        """The names of the policies' branches (rows of the grid, not of the networks' tables)."""
        return {b.name for r in self.arms.values() if r.arm.is_policy for b in branches(r.arm).values()}

    def branches_taken(self) -> set[str]:
        """The branches some network's timing run took."""
        return {branches(r.arm)[d].name for r in self.arms.values() if r.arm.is_policy for d in r.decision.values()}

    def limit(self, net: str) -> float | None:
        """The floor's step x DDP's median steps to the target."""
        floor = self.arms.get("floor")
        if floor is None or net not in floor.step_s or self.ddp_steps is None:
            return None
        return floor.step_s[net][1] * self.ddp_steps

    def best_baseline(self, net: str) -> tuple[str, float]:
        """The fastest of torch's DDP (in any of its forms: half precision, sparse embeddings) and
        PowerSGD's ranks to the target on ``net`` (name, median time)."""
        candidates = [(r.median_time(net), name) for name, r in self.arms.items()
                      if r.arm.kind == "powersgd" or r.arm.options.get("method") == "ddp"]
        time, name = min(candidates) if candidates else (math.inf, "-")
        return name, time

    def final_vs_ddp(self, name: str, net: str | None = None) -> float | None:
        """The arm's median final metric (on ``net``, for a policy) relative to DDP's: +0.01 is 1%
        worse loss (or accuracy points lower x 1/100 for accuracy, as a fraction of DDP's)."""
        mine, ddp = self.result(name, net).final, self.arms["ddp"].final if "ddp" in self.arms else {}
        if not mine or not ddp:
            return None
        a, b = statistics.median(mine.values()), statistics.median(ddp.values())
        return a / b - 1.0 if self.workload.metric == "loss" else (b - a) / b


def analyse(records: Sequence[dict[str, Any]], wl: Workload, nets: Sequence[str] | None = None) -> Campaign:
    """The :class:`Campaign` of ``wl`` from its records (any phase may be missing: the figures that
    need it are then None)."""
    listed = arms_of(wl.name)
    listed += [branch for arm in listed if arm.is_policy for branch in branches(arm).values()]
    arms = {arm.name: ArmResult(arm, warmup=int(arm.options.get("dense_warmup_steps", 0))) for arm in listed}
    by_phase: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_phase.setdefault(record["campaign"]["phase"], []).append(record)
    convergence = [r for r in by_phase.get("convergence", []) if r["campaign"]["arm"] in arms]
    for record in convergence:
        camp = record["campaign"]
        if camp["seed"] == 0:
            arms[camp["arm"]].grid[camp["lr"]] = final_metric(record, wl.metric)
    for result in arms.values():
        if result.grid and len(result.grid) == len(wl.grid(result.arm)):
            result.best_lr = min(result.grid, key=lambda lr: (
                math.inf if math.isnan(result.grid[lr]) else result.grid[lr] * (1 if wl.metric == "loss" else -1), lr))
    best_runs = {(r["campaign"]["arm"], r["campaign"]["seed"]): r for r in convergence
                 if r["campaign"]["lr"] == arms[r["campaign"]["arm"]].best_lr}
    target = plateau = ddp_steps = None
    ddp_runs = [r for (arm, _), r in best_runs.items() if arm == "ddp"]
    if ddp_runs:
        at = round(0.75 * wl.steps / wl.eval_every) * wl.eval_every
        target = statistics.median(_at_step(r, at, wl.metric) for r in ddp_runs)
        fifth = round(0.8 * wl.steps / wl.eval_every) * wl.eval_every
        plateau = statistics.median(abs(_at_step(r, fifth, wl.metric) - final_metric(r, wl.metric))
                                    / abs(_at_step(r, fifth, wl.metric)) for r in ddp_runs)
    for (name, seed), record in sorted(best_runs.items()):
        result = arms[name]
        result.final[seed] = final_metric(record, wl.metric)
        if target is not None:
            result.steps[seed] = steps_to_target(record, target, wl.metric)
        if record.get("epochs"):
            sent = [e.get("bytes_per_step") for e in record["epochs"] if e.get("bytes_per_step")]
            result.bytes_per_step = statistics.mean(sent) if sent else None
    if "ddp" in arms and arms["ddp"].steps:
        values = [math.inf if s is None else s for s in arms["ddp"].steps.values()]
        ddp_steps = statistics.median(values) if statistics.median(values) < math.inf else None
    timed: dict[tuple[str, str], list[dict[str, Any]]] = {}
    seen_nets = []
    for record in by_phase.get("timing", []):
        camp = record["campaign"]
        if camp["arm"] not in arms:
            continue
        timed.setdefault((camp["arm"], camp["net"]), []).append(record)
        if camp["net"] not in seen_nets:
            seen_nets.append(camp["net"])
    for (name, net), runs in timed.items():
        result = arms[name]
        runs.sort(key=lambda r: r["campaign"].get("repeat", 0))
        if result.arm.is_policy:  # the decision most of its runs took, and the step times of those runs
            decisions = [str(d) for r in runs for d in [(r.get("dense_fallback") or {}).get("decision")]
                         if d in ("method", "dense")]
            decided = majority(decisions)
            if decided is not None:
                result.decision[net] = decided
                runs = [r for r in runs if (r.get("dense_fallback") or {}).get("decision") == result.decision[net]]
        phases = [_phase_times(r, r["campaign"].get("warmup_steps", TIMING_WARMUP if result.warmup else 0),
                               r["campaign"].get("decided_after", 0)) for r in runs]
        warm = [w for w, _ in phases if w is not None]
        result.step_s[net] = (statistics.median(warm) if warm else None, statistics.median(m for _, m in phases))
        result.timing_runs[net] = len(runs)
        loads = [r.get("load", {}).get("before") for r in runs]
        result.load[net] = max((x for x in loads if x is not None), default=None)
    campaign = Campaign(wl, arms, target, plateau, ddp_steps, list(nets or seen_nets), {})
    full: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in by_phase.get("confirm", []):
        camp = record["campaign"]
        if target is not None and camp["arm"] in arms:
            full.setdefault((camp["net"], camp["arm"]), []).append(record)
    order = {net: i for i, net in enumerate(campaign.nets)}  # the report's order of the networks
    for (net, name), runs in sorted(full.items(), key=lambda item: order.get(item[0][0], len(order))):
        assert target is not None  # (confirmations are kept only with a target)
        runs.sort(key=lambda r: r["campaign"].get("repeat", 0))
        times = [next((p["train_time"] for p in r["history"] if _reaches(_metric(p, wl.metric), target, wl.metric)),
                      math.inf) for r in runs]  # a miss counts as never
        median = statistics.median(times)
        measured = None if median == math.inf else median
        composed = campaign.result(name, net).time_to_target(net, 0)
        loads = [x for r in runs for x in [r.get("load", {}).get("before")] if x is not None]
        campaign.confirmations[net] = {
            "arm": name, "measured": measured, "composed": composed,
            "ratio": measured / composed if measured and composed else None, "runs": len(runs),
            "load": max(loads, default=None)}
        if arms[name].arm.is_policy:  # the full runs measured their own decision: the same as timing's?
            campaign.confirmations[net]["decision"] = majority(
                [str(d) for r in runs for d in [(r.get("dense_fallback") or {}).get("decision")] if d is not None])
    return campaign
