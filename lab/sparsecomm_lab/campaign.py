"""The time-to-accuracy campaign: every method against DDP and PowerSGD on the
communication-heavy workloads, each run trained to a target, resumable, with a table and plots.

A campaign is a list of :class:`RunSpec` (:func:`plan`): per workload and emulated network, plain
DDP, DDP + PowerSGD (ranks 2 and 4; one DDP bucket, since torch 2.13's ``powerSGD_hook`` aborts on
gloo with two or more), every sparse method at 1% density and the four best of those (shortest
time to target at 1%, from the finished runs) at 0.1%. :func:`run_campaign` trains the runs one
after the other (one process tree at a time, so the ratios are comparable on a loaded machine)
and writes each run record to ``<out>/<workload>/<net>/<label>.json``; a run whose file exists is
skipped, so an interrupted campaign resumes where it stopped. :func:`campaign_rows` and
:func:`write_campaign_report` turn the records into the markdown table and the plots (metric
against training wall time and against epochs).

The time to target is the training wall time (evaluation excluded) of the first evaluation that
meets the target: test accuracy at or above it, or test perplexity at or below it.

Protocol:

* **The floor.** Every workload and network also runs ``nosync`` (DDP with torch's no-op comm hook,
  :data:`~sparsecomm.experiments.training.FLOOR`): the same model, batch and P workers exchanging no
  gradients. Every row reports its step time as a multiple of that floor's (``x floor``): what the
  method's synchronization costs on top of the step a data-parallel run cannot go below here.
* **Seeds.** Each run is made for every seed of ``seeds`` (default 3: 0, 1, 2); the headline figures
  (:func:`aggregate_rows`, :func:`speedups`) are the median over seeds with the least and the most.
  Speed-ups are taken within a seed (the runs of one seed share the machine's period) first.
* **A quiet machine.** Before each run the 1-minute load average is recorded in the run's record;
  :class:`QuietPolicy` waits for it to fall to ``max_load_per_core`` x cores (1.5 on 2 cores) and
  redoes a run that started above it.
* **PowerSGD ranks 2 and 4** are always both planned (:func:`plan`), so the best PowerSGD rank is
  always measured in the same campaign as the methods it is compared with.
* Each workload trains 3 epochs (:data:`WORKLOADS`; the demo keeps one).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparsecomm.cli.table import markdown_table
from sparsecomm.methods import available_methods, is_sparse, sparse_methods
from sparsecomm_lab.training import DEFAULT_DENSITY, FLOOR, TrainConfig, recipe_density, save_record, train

__all__ = ["Workload", "WORKLOADS", "RunSpec", "RECIPES", "plan", "plan_low_density", "plan_recipes", "best_sparse",
           "run_campaign", "campaign_rows", "write_campaign_report", "speedups", "load_campaign", "metric_of",
           "safe_name", "aggregate_rows", "QuietPolicy", "add_quiet_arguments", "quiet_policy", "SEEDS",
           "POWERSGD_RANKS"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    """A model, its data and its target: ``metric`` is ``"accuracy"`` (%, higher is better) or
    ``"perplexity"`` (lower is better)."""

    name: str
    model: str
    data: str
    metric: str
    target: float
    max_epochs: int
    evals_per_epoch: int
    data_options: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> TrainConfig:
        """The run's :class:`TrainConfig`: the model's tuned defaults, this target, ``overrides``."""
        target = {"target_accuracy": self.target} if self.metric == "accuracy" else {"target_perplexity": self.target}
        options: dict[str, Any] = {"model": self.model, "data": self.data, "epochs": self.max_epochs,
                                   "lr_schedule": "cosine",
                   "evals_per_epoch": self.evals_per_epoch, "data_options": dict(self.data_options),
                   "model_options": dict(self.model_options), **target}
        options.update(overrides)
        return TrainConfig(**options)


#: the communication-heavy workloads (models.WideVGG and models.WordLSTM, 11-12M parameters each)
#: (3 epochs each: the campaign's budget; the demo cuts it to one). 12 evaluations per epoch, as in
#: the demo: the time to the target is resolved to 5 steps (at 6 per epoch, a method crossing the
#: target at step 31 was booked at step 40); an evaluation's time is not training time.
WORKLOADS: dict[str, Workload] = {
    "fashion": Workload("fashion", "vgg-fc", "fashion-mnist", "accuracy", target=72.0, max_epochs=3,
                        evals_per_epoch=12, data_options={"train_size": 4096, "test_size": 1000}),
    "lstm": Workload("lstm", "word-lstm", "fortunes-words", "perplexity", target=750.0, max_epochs=3,
                     evals_per_epoch=12, data_options={"train_size": 1920, "test_size": 200}),
}

#: the campaign's seeds: its headline figures are the median over them, with the least and the most
SEEDS = (0, 1, 2)
#: PowerSGD's ranks, always run together (the best of them is the comparison)
POWERSGD_RANKS = (2, 4)


@dataclass(frozen=True)
class RunSpec:
    """One run of the campaign."""

    workload: str
    net: str | None
    method: str
    density: float = 0.01
    powersgd_rank: int = 2
    recipe: str = ""  # a key of RECIPES, "" for the recommended one (training.sparse_recipe, docs/training.md)
    seed: int = 0

    @property
    def label(self) -> str:
        if self.method == "powersgd":
            return f"powersgd-r{self.powersgd_rank}"
        label = f"{self.method}@{self.density:g}" if _is_sparse(self.method) else self.method
        return f"{label}+{self.recipe}" if self.recipe else label


#: sparse-training recipes compared by ``bench time_to_accuracy --recipe METHOD`` (docs/training.md,
#: benchmarks/recipe): the DDP comm hook with the optimizer's momentum, without and with a dense warm-up
#: of 10% of the steps (6 of the LSTM's 60); DGC momentum correction with factor masking (Lin et al.
#: 2018, section 3.2; SparseSynchronizer, momentum-free optimizer), without and with that warm-up.
#: A run without a recipe takes the recommended one (:func:`training.sparse_recipe`).
RECIPES: dict[str, dict[str, Any]] = {
    "hook": {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 0},
    "warmup": {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 6},
    "mc": {"sync": "synchronizer", "momentum_correction": True},
    "mc-warmup": {"sync": "synchronizer", "momentum_correction": True, "dense_warmup_steps": 6},
}


#: the campaign's names that are not sparsecomm methods: torch's DDP, PowerSGD hook and no-op hook
BASELINE_NAMES = ("ddp", "powersgd", FLOOR)


def _is_sparse(method: str) -> bool:
    return method not in BASELINE_NAMES and is_sparse(method)


def safe_name(text: str) -> str:
    """``text`` with every run of characters outside ``[A-Za-z0-9._-]`` replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")



def _check(workloads: Sequence[str], methods: Sequence[str] | None) -> list[str]:
    unknown = [m for m in methods or () if m not in BASELINE_NAMES and m not in available_methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: {', '.join(BASELINE_NAMES)}, "
                         f"{', '.join(available_methods())}")
    missing = [w for w in workloads if w not in WORKLOADS]
    if missing:
        raise ValueError(f"unknown workload(s) {missing}; available: {', '.join(WORKLOADS)}")
    return list(methods) if methods is not None else list(BASELINE_NAMES) + sparse_methods()


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    if not seeds or len(set(seeds)) != len(seeds) or any(int(s) != s or s < 0 for s in seeds):
        raise ValueError(f"seeds {list(seeds)} must be distinct integers >= 0, at least one")
    return list(seeds)


def plan(workloads: Sequence[str], nets: Sequence[str | None], methods: Sequence[str] | None = None,
         density: float | None = None, powersgd_ranks: Sequence[int] = POWERSGD_RANKS,
         seeds: Sequence[int] = (0,), registry: dict[str, Workload] | None = None) -> list[RunSpec]:
    """The first stage, in order: per seed, workload and network, the floor (``nosync``), DDP,
    PowerSGD at each rank and each sparse method at ``density`` (``None``: the density of the
    method's recommended recipe on the workload's model, :func:`training.recipe_density`).
    ``methods`` (names, ``nosync``, ``ddp`` and ``powersgd`` included) restricts the plan; ``None``
    takes them all. PowerSGD always runs at ranks 2 and 4 (:data:`POWERSGD_RANKS`), and at the other
    ``powersgd_ranks`` given. ``registry`` replaces :data:`WORKLOADS` (the demo's)."""
    chosen = _check(workloads, methods)
    ranks = sorted(set(POWERSGD_RANKS) | set(powersgd_ranks))
    runs: list[RunSpec] = []
    for seed in _check_seeds(seeds):
        for workload in workloads:
            for net in nets:
                if FLOOR in chosen:
                    runs.append(RunSpec(workload, net, FLOOR, seed=seed))
                if "ddp" in chosen:
                    runs.append(RunSpec(workload, net, "ddp", seed=seed))
                if "powersgd" in chosen:
                    runs += [RunSpec(workload, net, "powersgd", powersgd_rank=r, seed=seed) for r in ranks]
                model = (registry or WORKLOADS)[workload].model
                runs += [RunSpec(workload, net, m, recipe_density(model, m) if density is None else density, seed=seed)
                         for m in chosen if m not in BASELINE_NAMES and _is_sparse(m)]
    return runs


def plan_low_density(workloads: Sequence[str], nets: Sequence[str | None], out: str,
                     methods: Sequence[str] | None = None, density: float = 0.001, best: int = 4,
                     from_density: float | None = None, seeds: Sequence[int] = (0,)) -> list[RunSpec]:
    """The second stage: the ``best`` sparse methods of the finished first-stage runs under
    ``out`` (:func:`best_sparse`, per workload and network, over the first seed's runs, made at
    ``from_density``: ``None`` for each method's recipe density) at ``density``, for every seed."""
    chosen = _check(workloads, methods)
    seeds = _check_seeds(seeds)
    return [RunSpec(workload, net, m, density, seed=seed) for seed in seeds for workload in workloads
            for net in nets
            for m in [m for m in best_sparse(out, workload, net, from_density, seeds[0]) if m in chosen][:best]]


def plan_recipes(workloads: Sequence[str], nets: Sequence[str | None], method: str,
                 density: float | None = None, seeds: Sequence[int] = (0,)) -> list[RunSpec]:
    """``method`` under every recipe of :data:`RECIPES` at ``density`` (``None``:
    :data:`~.training.DEFAULT_DENSITY`; the campaign's own run of ``method`` takes the recommended
    recipe), per seed, workload and network."""
    _check(workloads, [method])
    density = DEFAULT_DENSITY if density is None else density
    return [RunSpec(workload, net, method, density, recipe=name, seed=seed) for seed in _check_seeds(seeds)
            for workload in workloads for net in nets for name in RECIPES]


def record_path(out: str, spec: RunSpec) -> str:
    """``<out>/<workload>/<net>/seed<seed>/<label>.json``."""
    return os.path.join(out, spec.workload, safe_name(spec.net or "loopback"), f"seed{spec.seed}",
                        safe_name(spec.label) + ".json")


def metric_of(point: dict[str, Any], metric: str) -> float:
    """An evaluation point's accuracy (%) or perplexity."""
    return point["test_accuracy"] if metric == "accuracy" else math.exp(min(point["test_loss"], 700.0))


def _better(value: float, than: float, metric: str) -> bool:
    return value >= than if metric == "accuracy" else value <= than


def time_and_epochs_to_target(history: Sequence[dict[str, Any]], metric: str,
                              target: float) -> tuple[float | None, float | None]:
    for point in history:
        if _better(metric_of(point, metric), target, metric):
            return point["train_time"], point["epoch"]
    return None, None


def best_sparse(out: str, workload: str, net: str | None, density: float | None = None, seed: int = 0) -> list[str]:
    """Sparse methods with a finished run at ``density`` (``None``: each method's recipe density)
    on ``workload`` / ``net`` (seed ``seed``), fastest to the target first (those that never reached
    it last, by their final metric)."""
    scored = []
    for method in sparse_methods():
        made_at = recipe_density(WORKLOADS[workload].model, method) if density is None else density
        path = record_path(out, RunSpec(workload, net, method, made_at, seed=seed))
        if not os.path.exists(path):
            continue
        with open(path) as handle:
            record = json.load(handle)
        metric, target = record["campaign"]["metric"], record["campaign"]["target"]
        ttt, _ = time_and_epochs_to_target(record["history"], metric, target)
        final = metric_of(record["history"][-1], metric)
        scored.append((ttt is None, ttt or 0.0, -final if metric == "accuracy" else final, method))
    return [s[-1] for s in sorted(scored)]


@dataclass
class QuietPolicy:
    """When the machine counts as quiet enough for a timed run: the 1-minute load average at most
    ``max_load_per_core`` per core (0.75: 1.5 on 2 cores). Before a run, :meth:`wait` polls the
    load every ``poll_s`` seconds for up to ``max_wait_s`` and returns the load the run starts at;
    a run that started above the threshold is redone, up to ``redo`` times (the last attempt is
    kept, its record saying so). ``loadavg`` and ``sleep`` are the system's (replaceable in tests)."""

    max_load_per_core: float = 0.75
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else (os.cpu_count() or 1))
    max_wait_s: float = 300.0
    poll_s: float = 5.0
    redo: int = 2
    loadavg: Callable[[], float] = field(default=lambda: os.getloadavg()[0])
    sleep: Callable[[float], None] = field(default=time.sleep)

    def __post_init__(self) -> None:
        if not self.max_load_per_core > 0:
            raise ValueError(f"max_load_per_core={self.max_load_per_core} must be > 0")
        if self.redo < 0 or self.max_wait_s < 0:
            raise ValueError(f"redo={self.redo} and max_wait_s={self.max_wait_s} must be >= 0")

    @property
    def threshold(self) -> float:
        return self.max_load_per_core * self.cores

    def wait(self, announce: Callable[[float], None] | None = None) -> tuple[float, float]:
        """(load average the run starts at, seconds waited for it); ``announce(load)`` is called once
        when the wait begins, so that a long wait is never silent."""
        waited, load = 0.0, self.loadavg()
        if announce is not None and load > self.threshold and self.max_wait_s > 0:
            announce(load)
        while load > self.threshold and waited < self.max_wait_s:
            step = min(self.poll_s, self.max_wait_s - waited)
            self.sleep(step)
            waited += step
            load = self.loadavg()
        return load, waited


def add_quiet_arguments(parser: Any, max_wait: float = 300.0, redo: int = 2) -> None:
    """The quiet-machine options of the commands that time training runs (``bench time_to_accuracy``
    and ``demo``): ``--max-load-per-core``, ``--max-wait``, ``--redo`` (:func:`quiet_policy` reads
    them), with the command's defaults for the last two."""
    parser.add_argument("--max-load-per-core", type=float, default=0.75,
                        help="quiet machine: the 1-minute load average before a run at most this times the "
                        "cores (default %(default)s: 1.5 on 2 cores); 0 disables the check")
    parser.add_argument("--max-wait", type=float, default=max_wait,
                        help="seconds to wait for a quiet machine before a run (default %(default)s)")
    parser.add_argument("--redo", type=int, default=redo,
                        help="times a run started above the load threshold is redone (default %(default)s)")


def quiet_policy(args: Any) -> QuietPolicy | None:
    """The :class:`QuietPolicy` of :func:`add_quiet_arguments`'s options (``None``: the check is off)."""
    if args.max_load_per_core == 0:
        return None
    return QuietPolicy(max_load_per_core=args.max_load_per_core, max_wait_s=args.max_wait, redo=args.redo)


def _train_quietly(config: TrainConfig, trainer: Callable[[TrainConfig], dict[str, Any]],
                   quiet: QuietPolicy | None, echo: Callable[[str], None]) -> dict[str, Any]:
    """``trainer(config)``, under ``quiet``: waited for, redone when it started on a busy machine;
    the record's ``load`` says the load before each attempt and the threshold."""
    if quiet is None:
        return trainer(config)
    loads: list[float] = []
    def announce(load: float) -> None:
        echo(f"    load average {load:.2f} > {quiet.threshold:g} ({quiet.max_load_per_core:g} x {quiet.cores} cores): "
             f"waiting up to {quiet.max_wait_s:.0f} s for a quiet machine (--max-load-per-core 0 skips the wait)")

    for attempt in range(quiet.redo + 1):
        load, waited = quiet.wait(announce)
        loads.append(load)
        record = trainer(config)
        if load <= quiet.threshold:
            break
        echo(f"    load average {load:.2f} > {quiet.threshold:g} ({quiet.max_load_per_core:g} x {quiet.cores} cores) "
             f"before the run (waited {waited:.0f} s): " + ("redone" if attempt < quiet.redo else "kept, marked busy"))
    record["load"] = {"before": loads[-1], "attempts": loads, "threshold": quiet.threshold,
                      "quiet": loads[-1] <= quiet.threshold}
    return record


def run_campaign(specs: Sequence[RunSpec], out: str, overrides: dict[str, Any] | None = None,
                 trainer: Callable[[TrainConfig], dict[str, Any]] = train,
                 echo: Callable[[str], None] = log.warning,
                 workloads: dict[str, Workload] | None = None, quiet: QuietPolicy | None = None) -> list[str]:
    """Train every run of ``specs`` whose record file is missing; returns the record paths.

    ``overrides`` go into every :class:`TrainConfig` (e.g. ``workers``, or ``epochs`` for a
    shorter budget than the workload's ``max_epochs``); ``workloads`` replaces :data:`WORKLOADS`
    (the demo's shorter budgets, the tests' tiny models); ``quiet`` (:class:`QuietPolicy`) waits
    for a quiet machine before each run and redoes a run started on a busy one. Each run's seed is
    its spec's.
    """
    paths = []
    for i, spec in enumerate(specs, start=1):
        path = record_path(out, spec)
        paths.append(path)
        name = f"{spec.workload} {spec.net or 'loopback'} {spec.label} seed {spec.seed}"
        if os.path.exists(path):
            echo(f"[{i}/{len(specs)}] {name}: done before, skipped")
            continue
        wl = (workloads or WORKLOADS)[spec.workload]
        config = wl.config(method=spec.method, density=spec.density, powersgd_rank=spec.powersgd_rank,
                           net=spec.net, stop_at_target=False, **(RECIPES[spec.recipe] if spec.recipe else {}),
                           **{**(overrides or {}), "seed": spec.seed})
        echo(f"[{i}/{len(specs)}] {name} ...")
        record = _train_quietly(config, trainer, quiet, echo)
        record["campaign"] = {"workload": spec.workload, "metric": wl.metric, "target": wl.target,
                              "label": spec.label, "seed": spec.seed}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_record(record, os.path.dirname(path), os.path.basename(path))
        ttt, _ = time_and_epochs_to_target(record["history"], wl.metric, wl.target)
        final = metric_of(record["history"][-1], wl.metric)
        echo(f"    {wl.metric} {final:.2f} after {record['history'][-1]['epoch']:g} epochs; time to target "
             f"{'not reached' if ttt is None else f'{ttt:.1f} s'}; network: {record['network']}")
    return paths


def load_campaign(out: str) -> list[dict[str, Any]]:
    """Every run record under ``out`` (written by :func:`run_campaign`), sorted by path."""
    records = []
    for root, _, files in sorted(os.walk(out)):
        for name in sorted(files):
            if name.endswith(".json"):
                with open(os.path.join(root, name)) as handle:
                    record = json.load(handle)
                if "campaign" in record:
                    record["_path"] = os.path.join(root, name)
                    records.append(record)
    return records


def _seed(record: dict[str, Any]) -> int:
    return int(record["campaign"].get("seed", 0))


def _kind(label: str) -> int:
    return 0 if label == FLOOR else 1 if label == "ddp" else 2 if label.startswith("powersgd") else 3


def _order(record: dict[str, Any]) -> tuple:
    label = record["campaign"]["label"]
    return (record["campaign"]["workload"], record["config"]["net"] or "", _kind(label),
            -record["config"]["density"], label, _seed(record))


def _metric_at_epoch(history: Sequence[dict[str, Any]], epoch: float, metric: str) -> float | None:
    points = [h for h in history if h["epoch"] <= epoch + 1e-9]
    return metric_of(points[-1], metric) if points else None


def _ms_per_step(record: dict[str, Any]) -> float:
    steps = record["epochs"]
    return 1e3 * sum(e["time_per_step"] for e in steps) / len(steps)


def campaign_rows(records: Sequence[dict[str, Any]], by_network: bool = True) -> list[dict[str, Any]]:
    """One row per run: time and epochs to target, speed-up against DDP (same workload, network and
    seed; any network with ``by_network=False``, for the metric columns of runs whose trajectory
    does not depend on it), ms per step and its multiple of the floor's (``nosync``, same workload,
    network and seed), final metric, the difference to DDP after the same epochs, and the load
    average before the run. The floor's own row has no time to target: its ranks train apart."""
    rows = []

    def key(r: dict[str, Any]) -> tuple:
        return r["campaign"]["workload"], r["config"]["net"] if by_network else None, _seed(r)

    ddp = {key(r): r for r in records if r["campaign"]["label"] == "ddp"}
    floor = {(r["campaign"]["workload"], r["config"]["net"], _seed(r)): r for r in records
             if r["campaign"]["label"] == FLOOR}
    for rec in sorted(records, key=_order):
        camp, net = rec["campaign"], rec["config"]["net"]
        metric, target = camp["metric"], camp["target"]
        is_floor = camp["label"] == FLOOR
        ttt, ett = time_and_epochs_to_target(rec["history"], metric, target)
        base = ddp.get(key(rec))
        base_ttt = time_and_epochs_to_target(base["history"], metric, target)[0] if base else None
        final = metric_of(rec["history"][-1], metric)
        epoch = rec["history"][-1]["epoch"]
        delta: Any = "-"
        if base is not None and not is_floor:
            common = min(epoch, base["history"][-1]["epoch"])
            mine, theirs = (_metric_at_epoch(rec["history"], common, metric),
                            _metric_at_epoch(base["history"], common, metric))
            if mine is not None and theirs is not None:
                delta = (f"{mine - theirs:+.1f} points" if metric == "accuracy"
                         else f"{100 * (mine / theirs - 1):+.1f}%")
        steps = rec["epochs"]
        ms = _ms_per_step(rec)
        floor_rec = floor.get((camp["workload"], net, _seed(rec)))
        load = rec.get("load", {}).get("before")
        rows.append({
            "workload": f"{rec['config']['model']} / {rec['config']['data']}",
            "network": net or "loopback",
            "method": camp["label"],
            "seed": _seed(rec),
            "time to target s": "floor: no exchange" if is_floor else "not reached" if ttt is None else ttt,
            "speed-up vs DDP": (base_ttt / ttt) if (ttt and base_ttt and not is_floor) else "-",
            "epochs to target": "-" if ett is None or is_floor else ett,
            "ms/step": ms,
            "x floor": ms / _ms_per_step(floor_rec) if floor_rec is not None else "-",
            f"final {metric}": final,
            "epochs run": epoch,
            "vs DDP, same epochs": delta,
            "MB sent/step": (sum(e["bytes_per_step"] for e in steps) / len(steps) / 1e6
                             if _kind(camp["label"]) == 3 else "not metered"),  # torch's hooks bypass the meter
            "load before": "-" if load is None else load,
        })
    return rows


def _spread(values: Sequence[float], digits: int = 3) -> str:
    """``median (min-max)`` of ``values`` (just the value when there is one)."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}g}"
    return f"{med:.{digits}g} ({min(values):.{digits}g}-{max(values):.{digits}g})"


def _number(value: Any) -> float | None:
    return value if isinstance(value, float) else None


def aggregate_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload, network and method over the seeds of :func:`campaign_rows`: time to
    target, speed-up vs DDP, ms/step, x floor and the final metric, each the median over seeds with
    the least and the most (a seed that did not reach the target counts as never: the median is
    "not reached" when most did not)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["network"], row["method"]), []).append(row)
    out = []
    for (workload, network, method), group in groups.items():
        metric_key = next(k for k in group[0] if k.startswith("final "))
        times = [_number(r["time to target s"]) for r in group]
        reached = sorted(t for t in times if t is not None)
        is_floor = method == FLOOR
        if is_floor:
            ttt = "floor: no exchange"
        elif len(reached) * 2 > len(group):  # the median over seeds, "never" counted as infinity
            ttt = _spread(reached) if len(reached) == len(group) else \
                f"{statistics.median(reached + [math.inf] * (len(group) - len(reached))):.3g} " \
                f"({len(reached)}/{len(group)} reached)"
        else:
            ttt = f"not reached ({len(reached)}/{len(group)} reached)"
        speed = [v for v in (_number(r["speed-up vs DDP"]) for r in group) if v is not None]
        floors = [v for v in (_number(r["x floor"]) for r in group) if v is not None]
        out.append({"workload": workload, "network": network, "method": method, "seeds": len(group),
                    "time to target s": ttt,
                    "speed-up vs DDP": _spread(speed) if speed else "-",
                    "ms/step": _spread([r["ms/step"] for r in group]),
                    "x floor": _spread(floors) if floors else "-",
                    metric_key: _spread([r[metric_key] for r in group], 4),
                    "vs DDP, same epochs": " / ".join(str(r["vs DDP, same epochs"]) for r in group)})
    return out


def speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and network (rows of :func:`campaign_rows`): the fastest sparse method to the
    target (the least median time over seeds), DDP's and the best PowerSGD rank's times, and the
    fastest sparse method's speed-ups and step over the floor's. Each figure is taken within a seed,
    then its median over seeds (a float) is given, and beside it ``median (min-max)``."""
    out = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["network"]), []).append(row)

    def ttt(row: dict[str, Any] | None) -> float | None:
        return None if row is None else _number(row["time to target s"])

    for (workload, network), group in groups.items():
        seeds = sorted({r["seed"] for r in group})
        by_method: dict[str, dict[int, dict[str, Any]]] = {}
        for r in group:
            by_method.setdefault(r["method"], {})[r["seed"]] = r
        sparse = {m: runs for m, runs in by_method.items() if "@" in m}

        median_time = {m: statistics.median(ttt(runs.get(s)) or math.inf for s in seeds) for m, runs in sparse.items()}
        ranked = sorted((m for m in sparse if median_time[m] < math.inf), key=median_time.__getitem__)
        best = ranked[0] if ranked else None
        per_seed: dict[str, list[float]] = {"its": [], "ddp": [], "power": [], "vs ddp": [], "vs power": [],
                                            "x floor": []}
        deltas = []
        for seed in seeds:
            ddp_t = ttt(by_method.get("ddp", {}).get(seed))
            powers = [t for m, runs in by_method.items() if m.startswith("powersgd")
                      for t in [ttt(runs.get(seed))] if t is not None]
            power_t = min(powers) if powers else None
            mine = sparse[best].get(seed) if best else None
            best_t = ttt(mine)
            for name, value in (("its", best_t), ("ddp", ddp_t), ("power", power_t)):
                if value is not None:
                    per_seed[name].append(value)
            if best_t and ddp_t:
                per_seed["vs ddp"].append(ddp_t / best_t)
            if best_t and power_t:
                per_seed["vs power"].append(power_t / best_t)
            if mine is not None and _number(mine["x floor"]) is not None:
                per_seed["x floor"].append(mine["x floor"])
            if mine is not None:
                deltas.append(str(mine["vs DDP, same epochs"]))

        medians = {name: statistics.median(values) for name, values in per_seed.items() if values}
        spreads = {name: _spread(values) for name, values in per_seed.items() if values}
        ran = {m.split("-")[0] for m in by_method}
        out.append({"workload": workload, "network": network, "seeds": len(seeds),
                    "fastest sparse": best or "none reached the target",
                    "its time s": medians.get("its", "-"),
                    "DDP s": medians.get("ddp", "not reached" if "ddp" in ran else "not run"),
                    "best PowerSGD s": medians.get("power", "not reached" if "powersgd" in ran else "not run"),
                    "speed-up vs DDP": medians.get("vs ddp", "-"),
                    "vs DDP min-max": spreads.get("vs ddp", "-"),
                    "speed-up vs PowerSGD": medians.get("vs power", "-"),
                    "vs PowerSGD min-max": spreads.get("vs power", "-"),
                    "x floor": spreads.get("x floor", "-"),
                    "vs DDP, same epochs": " / ".join(deltas) if deltas else "-"})
    return out


def _plot_group(records: Sequence[dict[str, Any]], path: str) -> str:
    from sparsecomm.core.optional import require

    matplotlib = require("matplotlib", "the campaign's plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    camp, cfg = records[0]["campaign"], records[0]["config"]
    metric = camp["metric"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax in axes:
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # type: ignore[attr-defined]  # a ListedColormap
    for rec in sorted(records, key=_order):
        if rec["campaign"]["label"] == FLOOR:
            continue  # its ranks train apart: its curve is no data-parallel run's
        values = [metric_of(h, metric) for h in rec["history"]]
        style = {"linewidth": 2.5} if rec["campaign"]["label"] in ("ddp",) else {"linewidth": 1.2}
        axes[0].plot([h["train_time"] for h in rec["history"]], values, marker="o", markersize=2,
                     label=rec["campaign"]["label"], **style)
        axes[1].plot([h["epoch"] for h in rec["history"]], values, marker="o", markersize=2,
                     label=rec["campaign"]["label"], **style)
    for ax in axes:
        ax.axhline(camp["target"], color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    if metric == "perplexity":
        axes[0].set_yscale("log")
        top = max(metric_of(r["history"][0], metric) for r in records)
        axes[0].set_ylim(camp["target"] * 0.7, min(top * 1.1, camp["target"] * 6))
    axes[0].set_xlabel("training wall time (s, evaluation excluded)")
    axes[1].set_xlabel("epoch")
    axes[0].set_ylabel(f"test {metric}" + (" (%)" if metric == "accuracy" else ""))
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{cfg['model']} on {cfg['data']}, P={cfg['workers']}, {records[0]['network'].split(' (')[0]}, "
                 f"seed {_seed(records[0])}; target {camp['target']:g} (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_campaign_report(records: Sequence[dict[str, Any]], outdir: str, command: str | None = None,
                          title: str = "Time-to-accuracy campaign") -> dict[str, Any]:
    """Write ``campaign.md`` (the table) and one PNG per workload and network into ``outdir``."""
    if not records:
        raise ValueError("no campaign run records to report")
    os.makedirs(outdir, exist_ok=True)
    first_seed = min(_seed(r) for r in records)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in records:
        if _seed(rec) == first_seed and rec["campaign"]["label"] != FLOOR:
            groups.setdefault((rec["campaign"]["workload"], rec["config"]["net"] or "loopback"), []).append(rec)
    plots = [_plot_group(group, os.path.join(outdir, f"campaign-{safe_name(w)}-{safe_name(n)}.png"))
             for (w, n), group in sorted(groups.items())]
    rows = campaign_rows(records)
    summary = speedups(rows)
    aggregated = aggregate_rows(rows)
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"# {title}", ""]
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    lines += ["", f"Plots: seed {first_seed}. Figures over seeds {', '.join(map(str, seeds))}: median "
              "(least-most). x floor: the step time over the no-synchronization step's (nosync: DDP with "
              "torch's no-op hook, the same model, batch and P, nothing exchanged) of the same seed.", "",
              "Speed-up to target of the fastest sparse method:", "", markdown_table(summary), ""]
    busy = [r for r in records if r.get("load") and not r["load"]["quiet"]]
    if busy:
        lines += [f"{len(busy)} run(s) started above the load threshold after every redo (their record's "
                  "`load`): " + ", ".join(f"{r['campaign']['label']} seed {_seed(r)}" for r in busy), ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for row in aggregated:  # one table per workload: the metric columns differ (accuracy, perplexity)
        by_workload.setdefault(row["workload"], []).append(row)
    for workload, mine in by_workload.items():
        lines += [f"All methods, {workload} (over seeds):", "", markdown_table(mine), ""]
    per_run: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        per_run.setdefault(row["workload"], []).append(row)
    for workload, mine in per_run.items():
        lines += [f"Every run, {workload}:", "", markdown_table(mine), ""]
    path = os.path.join(outdir, "campaign.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return {"markdown": path, "plots": plots, "rows": rows, "summary": summary, "aggregated": aggregated}
