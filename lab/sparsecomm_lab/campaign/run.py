"""The campaign's three phases and where their records go.

1. **Convergence** (:func:`run_convergence`, loopback): every arm at every learning rate of the grid
   with seed 0, then each arm's best learning rate with the other seeds. A run's metric after a
   given step does not depend on the link or on the machine's load (the runs are deterministic), so
   these runs may train anywhere and at any time.
2. **Timing** (:func:`run_timing`, on each emulated network, on a quiet machine): each arm's step
   time, from :data:`TIMING_REPEATS` short runs made in rounds (every arm once per round, so that a
   slow spell of the machine falls on every arm alike, and the median over the rounds leaves it out):
   its dense warm-up phase (where it has one) and its main phase apart.
3. **Confirmation** (:func:`run_confirmation`): :data:`CONFIRM_REPEATS` full runs of the recommended arm
   per network, made in rounds as the timing runs, whose measured time to the target (their median)
   checks the composition ``steps to target x step time`` (:mod:`.analysis`).

A ``dense_fallback`` arm (a policy, :func:`.plan.branches`) trains its two branches, each with its
decision pinned, in phase 1; its timing runs measure the decision on each network (at its kept
branch's best learning rate: a step's time does not depend on it), and its confirmation runs, with
the decision measured again, at the best learning rate of the branch the timing runs took.

Records (the run records of :func:`sparsecomm_lab.training.train`, with a ``campaign`` entry) go to
``<out>/<workload>/convergence/<arm>/lr<lr>-seed<seed>.json``,
``<out>/<workload>/timing/<net>/<arm>/repeat<k>.json`` and ``<out>/<workload>/confirm/<net>/<arm>/repeat<k>.json``;
a run whose file exists is skipped, so an interrupted campaign resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from sparsecomm.integration.auto import DenseFallback
from sparsecomm_lab.training import save_record, train

from .plan import Arm, Workload, arms_of, branches, trained_arms
from .quiet import QuietPolicy, train_quietly

__all__ = ["run_convergence", "run_point", "run_timing", "run_confirmation", "load_records", "best_lr", "final_metric",
           "convergence_path", "timing_path", "confirm_path", "TIMING_STEPS", "TIMING_WARMUP", "TIMING_REPEATS",
           "CONFIRM_REPEATS",
           "safe_name", "timed_decision", "majority"]

log = logging.getLogger(__name__)

Trainer = Callable[..., dict[str, Any]]
Echo = Callable[[str], None]

#: steps of a timing run, and the dense warm-up steps it keeps of an arm that has one (enough for a
#: median of each phase; the first steps of each phase are skipped as warm-up of the caches)
TIMING_STEPS = 40
TIMING_WARMUP = 12
#: timing runs per arm and network: a step time is their median (one run can fall on a slow spell)
TIMING_REPEATS = 3
#: full runs of the recommended arm per network: the measured time to the target is their median
CONFIRM_REPEATS = 3


def safe_name(text: str) -> str:
    """``text`` with every run of characters outside ``[A-Za-z0-9._-]`` replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def convergence_path(out: str, wl: Workload, arm: Arm, lr: float, seed: int) -> str:
    return os.path.join(out, wl.name, "convergence", arm.name, f"lr{lr:g}-seed{seed}.json")


def timing_path(out: str, wl: Workload, arm: Arm, net: str, repeat: int) -> str:
    return os.path.join(out, wl.name, "timing", safe_name(net), arm.name, f"repeat{repeat}.json")


def confirm_path(out: str, wl: Workload, arm: Arm, net: str, repeat: int) -> str:
    return os.path.join(out, wl.name, "confirm", safe_name(net), arm.name, f"repeat{repeat}.json")


def _load(path: str) -> dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)


def final_metric(record: dict[str, Any], metric: str) -> float:
    """The last evaluation's validation loss or accuracy (NaN when training diverged)."""
    point = record["history"][-1]
    value = point["test_loss"] if metric == "loss" else point["test_accuracy"]
    return float(value) if value is not None else math.nan


def _rank_key(value: float, metric: str) -> float:
    """Smaller is better; a diverged run (NaN) ranks last."""
    if math.isnan(value):
        return math.inf
    return value if metric == "loss" else -value


def best_lr(out: str, wl: Workload, arm: Arm) -> float | None:
    """The learning rate of the grid whose seed-0 run ended best (None until every one has run)."""
    finals = {}
    for lr in wl.grid(arm):
        path = convergence_path(out, wl, arm, lr, 0)
        if not os.path.exists(path):
            return None
        finals[lr] = final_metric(_load(path), wl.metric)
    return min(wl.grid(arm), key=lambda lr: (_rank_key(finals[lr], wl.metric), lr))


def _save(record: dict[str, Any], path: str, campaign: dict[str, Any]) -> None:
    record["campaign"] = campaign
    save_record(record, os.path.dirname(path), os.path.basename(path))


def run_convergence(out: str, wl: Workload, arms: Sequence[Arm] | None = None, seeds: Sequence[int] | None = None,
                    trainer: Trainer = train, echo: Echo = log.warning, **overrides: Any) -> None:
    """Phase 1 on loopback: the grid at seed 0 for every arm (the floor excepted), then each arm's
    best learning rate at the other ``seeds``. ``overrides`` go into every run's config (tests: a
    smaller model or budget)."""
    arms = trained_arms(list(arms or arms_of(wl.name)))
    todo = [(arm, lr, 0) for arm in arms for lr in wl.grid(arm)]
    for stage in ("grid", "seeds"):
        if stage == "seeds":
            todo = []
            for arm in arms:
                lr = best_lr(out, wl, arm)
                if lr is None:
                    raise RuntimeError(f"arm {arm.name}: the grid is incomplete")
                todo += [(arm, lr, seed) for seed in (wl.seeds_of(arm) if seeds is None else seeds) if seed != 0]
        for i, (arm, lr, seed) in enumerate(todo, start=1):
            if not os.path.exists(convergence_path(out, wl, arm, lr, seed)):
                echo(f"[{stage} {i}/{len(todo)}] {wl.name} {arm.name} lr {lr:g} seed {seed} ...")
                run_point(out, wl, arm, lr, seed, trainer, echo, **overrides)


def run_point(out: str, wl: Workload, arm: Arm, lr: float, seed: int, trainer: Trainer = train,
              echo: Echo = log.warning, **overrides: Any) -> dict[str, Any]:
    """One convergence run (loopback) of ``arm`` at ``lr`` and ``seed``, saved where the campaign
    finds it; the per-step series is dropped from the record (the timing phase keeps its own)."""
    record = trainer(wl.config(arm, lr, seed, **overrides))
    record["steps"] = []
    _save(record, convergence_path(out, wl, arm, lr, seed), {"workload": wl.name, "arm": arm.name, "lr": lr,
                                                              "seed": seed, "phase": "convergence", "net": "loopback"})
    echo(f"    final {wl.metric} {final_metric(record, wl.metric):.4f}")
    return record


def run_timing(out: str, wl: Workload, nets: Sequence[str], arms: Sequence[Arm] | None = None,
               quiet: QuietPolicy | None = None, trainer: Trainer = train, echo: Echo = log.warning,
               repeats: int = TIMING_REPEATS, **overrides: Any) -> None:
    """Phase 2: each arm's step time on each network, from ``repeats`` runs of :data:`TIMING_STEPS`
    steps at its best learning rate (the grid's first for the floor), a warm-up cut to
    :data:`TIMING_WARMUP` steps. The runs go in rounds (every network and arm once, then again), so
    that the median over the rounds compares arms timed under the same spells of the machine; each
    run waits for a quiet machine (``quiet``) and records the load it started at."""
    for repeat in range(repeats):
        for net in nets:
            for arm in arms or [a for a in arms_of(wl.name) if a.explore_lrs is None]:
                path = timing_path(out, wl, arm, net, repeat)
                if os.path.exists(path):
                    continue
                lr = wl.grid(arm)[0] if arm.timed_only else best_lr(out, wl, branches(arm)["method"]
                                                                      if arm.is_policy else arm)
                if lr is None:
                    raise RuntimeError(f"arm {arm.name}: run the convergence phase first (its best learning rate)")
                timed = {"steps": TIMING_STEPS, "eval_every": TIMING_STEPS, "net": None if net == "loopback" else net}
                if arm.options.get("dense_warmup_steps"):
                    timed["dense_warmup_steps"] = TIMING_WARMUP
                decided = 0
                if arm.options.get("dense_fallback"):  # time the steps after its decision, whichever it made
                    probe = DenseFallback()
                    decided = probe.dense_steps(0) + probe.skip + probe.probe
                    timed["steps"] = TIMING_STEPS + decided
                echo(f"[timing {repeat + 1}/{repeats}] {wl.name} {arm.name} on {net} ...")
                record = train_quietly(wl.config(arm, lr, 0, **{**timed, **overrides}), trainer, quiet, echo)
                _save(record, path, {"workload": wl.name, "arm": arm.name, "lr": lr, "seed": 0, "phase": "timing",
                                     "net": net, "repeat": repeat, "warmup_steps": timed.get("dense_warmup_steps", 0),
                                     "decided_after": decided})


def run_confirmation(out: str, wl: Workload, nets: Sequence[str], arm: Arm, quiet: QuietPolicy | None = None,
                     trainer: Trainer = train, echo: Echo = log.warning, repeats: int = CONFIRM_REPEATS,
                     **overrides: Any) -> None:
    """Phase 3: ``repeats`` full runs of ``arm`` (its best learning rate, seed 0) on each network, in
    rounds (every network once, then again); a policy's at the best learning rate of the branch its
    timing runs took there."""
    for repeat, net in ((repeat, net) for repeat in range(repeats) for net in nets):
        path = confirm_path(out, wl, arm, net, repeat)
        if os.path.exists(path):
            continue
        trained = arm
        if arm.is_policy:
            decision = timed_decision(out, wl, arm, net)
            if decision is None:
                raise RuntimeError(f"arm {arm.name}: run the timing phase on {net} first (its decision there)")
            trained = branches(arm)[decision]
        lr = best_lr(out, wl, trained)
        if lr is None:
            raise RuntimeError(f"arm {trained.name}: run the convergence phase first (its best learning rate)")
        echo(f"[confirm {repeat + 1}/{repeats}] {wl.name} {arm.name} on {net}, the full budget ...")
        config = wl.config(arm, lr, 0, **{"net": None if net == "loopback" else net, **overrides})
        record = train_quietly(config, trainer, quiet, echo)
        _save(record, path, {"workload": wl.name, "arm": arm.name, "lr": lr, "seed": 0, "phase": "confirm",
                             "net": net, "repeat": repeat})


def timed_decision(out: str, wl: Workload, arm: Arm, net: str) -> str | None:
    """The decision (``"method"`` or ``"dense"``) the timing runs of policy ``arm`` took on ``net`` (the
    most of them; the first run's on a tie), or None before any."""
    decisions = []
    for repeat in range(TIMING_REPEATS):
        path = timing_path(out, wl, arm, net, repeat)
        if not os.path.exists(path):
            continue
        decision = (_load(path).get("dense_fallback") or {}).get("decision")
        if decision not in ("method", "dense"):
            raise RuntimeError(f"{path}: no dense_fallback decision recorded (rerun its timing: delete the file)")
        decisions.append(str(decision))
    return majority(decisions)


def majority(decisions: Sequence[str]) -> str | None:
    """The decision most of a policy's runs took (its timing runs, or its full runs; the first run's on a
    tie), or None of none."""
    return max(decisions, key=decisions.count) if decisions else None


def load_records(out: str, wl: Workload) -> list[dict[str, Any]]:
    """Every record of workload ``wl`` under ``out``, each with its path in ``_path``."""
    records = []
    for root, _, files in sorted(os.walk(os.path.join(out, wl.name))):
        for name in sorted(files):
            if name.endswith(".json"):
                record = _load(os.path.join(root, name))
                if "campaign" in record:
                    record["_path"] = os.path.join(root, name)
                    records.append(record)
    return records
