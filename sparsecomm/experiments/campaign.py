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
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cli.table import markdown_table
from ..methods import available_methods, method_class
from .training import TrainConfig, save_record, train

__all__ = ["Workload", "WORKLOADS", "RunSpec", "RECIPES", "plan", "plan_low_density", "plan_recipes", "best_sparse",
           "run_campaign", "campaign_rows", "write_campaign_report", "speedups", "load_campaign", "metric_of",
           "safe_name"]

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
WORKLOADS: dict[str, Workload] = {
    "fashion": Workload("fashion", "vgg-fc", "fashion-mnist", "accuracy", target=72.0, max_epochs=1,
                        evals_per_epoch=6, data_options={"train_size": 4096, "test_size": 1000}),
    "lstm": Workload("lstm", "word-lstm", "fortunes-words", "perplexity", target=750.0, max_epochs=1,
                     evals_per_epoch=6, data_options={"train_size": 1920, "test_size": 200}),
}


@dataclass(frozen=True)
class RunSpec:
    """One run of the campaign."""

    workload: str
    net: str | None
    method: str
    density: float = 0.01
    powersgd_rank: int = 2
    recipe: str = ""  # a key of RECIPES, "" for the recommended one (training.sparse_recipe, docs/recipe.md)

    @property
    def label(self) -> str:
        if self.method == "powersgd":
            return f"powersgd-r{self.powersgd_rank}"
        label = f"{self.method}@{self.density:g}" if _is_sparse(self.method) else self.method
        return f"{label}+{self.recipe}" if self.recipe else label


#: sparse-training recipes compared by ``bench time_to_accuracy --recipe METHOD`` (docs/campaign.md,
#: docs/recipe.md): the DDP comm hook with the optimizer's momentum, without and with a dense warm-up
#: of 10% of the steps (6 of the LSTM's 60); DGC momentum correction with factor masking (Lin et al.
#: 2018, section 3.2; SparseSynchronizer, momentum-free optimizer), without and with that warm-up.
#: A run without a recipe takes the recommended one (:func:`training.sparse_recipe`).
RECIPES: dict[str, dict[str, Any]] = {
    "hook": {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 0},
    "warmup": {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 6},
    "mc": {"sync": "synchronizer", "momentum_correction": True},
    "mc-warmup": {"sync": "synchronizer", "momentum_correction": True, "dense_warmup_steps": 6},
}


def _is_sparse(method: str) -> bool:
    return method not in ("ddp", "powersgd") and method_class(method).sparse


def safe_name(text: str) -> str:
    """``text`` with every run of characters outside ``[A-Za-z0-9._-]`` replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def sparse_methods() -> list[str]:
    return [m for m in available_methods() if method_class(m).sparse]


def _check(workloads: Sequence[str], methods: Sequence[str] | None) -> list[str]:
    unknown = [m for m in methods or () if m not in ("ddp", "powersgd") and m not in available_methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: ddp, powersgd, {', '.join(available_methods())}")
    missing = [w for w in workloads if w not in WORKLOADS]
    if missing:
        raise ValueError(f"unknown workload(s) {missing}; available: {', '.join(WORKLOADS)}")
    return list(methods) if methods is not None else ["ddp", "powersgd"] + sparse_methods()


def plan(workloads: Sequence[str], nets: Sequence[str | None], methods: Sequence[str] | None = None,
         density: float = 0.01, powersgd_ranks: Sequence[int] = (2, 4)) -> list[RunSpec]:
    """The first stage, in order: per workload and network, DDP, PowerSGD at each rank and each
    sparse method at ``density``. ``methods`` (names, ``ddp`` and ``powersgd`` included) restricts
    the plan; ``None`` takes them all."""
    chosen = _check(workloads, methods)
    runs: list[RunSpec] = []
    for workload in workloads:
        for net in nets:
            if "ddp" in chosen:
                runs.append(RunSpec(workload, net, "ddp"))
            if "powersgd" in chosen:
                runs += [RunSpec(workload, net, "powersgd", powersgd_rank=r) for r in powersgd_ranks]
            runs += [RunSpec(workload, net, m, density) for m in chosen if m not in ("ddp", "powersgd")
                     and _is_sparse(m)]
    return runs


def plan_low_density(workloads: Sequence[str], nets: Sequence[str | None], out: str,
                     methods: Sequence[str] | None = None, density: float = 0.001, best: int = 4,
                     from_density: float = 0.01) -> list[RunSpec]:
    """The second stage: the ``best`` sparse methods of the finished first-stage runs under
    ``out`` (:func:`best_sparse`, per workload and network) at ``density``."""
    chosen = _check(workloads, methods)
    return [RunSpec(workload, net, m, density) for workload in workloads for net in nets
            for m in [m for m in best_sparse(out, workload, net, from_density) if m in chosen][:best]]


def plan_recipes(workloads: Sequence[str], nets: Sequence[str | None], method: str,
                 density: float = 0.01) -> list[RunSpec]:
    """``method`` under every recipe of :data:`RECIPES` (the campaign's own run of ``method`` takes
    the recommended one), per workload and network."""
    _check(workloads, [method])
    return [RunSpec(workload, net, method, density, recipe=name) for workload in workloads for net in nets
            for name in RECIPES]


def record_path(out: str, spec: RunSpec) -> str:
    return os.path.join(out, spec.workload, safe_name(spec.net or "loopback"), safe_name(spec.label) + ".json")


def _target(camp: dict[str, Any]) -> float:
    """The target of a record's workload: the registry's (:data:`WORKLOADS`, which the report
    applies to runs made before a target changed; runs never stop at the target), else the record's."""
    known = WORKLOADS.get(camp["workload"])
    return known.target if known is not None and known.metric == camp["metric"] else camp["target"]


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


def best_sparse(out: str, workload: str, net: str | None, density: float = 0.01) -> list[str]:
    """Sparse methods with a finished run at ``density`` on ``workload`` / ``net``, fastest to the
    target first (those that never reached it last, by their final metric)."""
    scored = []
    for method in sparse_methods():
        path = record_path(out, RunSpec(workload, net, method, density))
        if not os.path.exists(path):
            continue
        with open(path) as handle:
            record = json.load(handle)
        metric, target = record["campaign"]["metric"], _target(record["campaign"])
        ttt, _ = time_and_epochs_to_target(record["history"], metric, target)
        final = metric_of(record["history"][-1], metric)
        scored.append((ttt is None, ttt or 0.0, -final if metric == "accuracy" else final, method))
    return [s[-1] for s in sorted(scored)]


def run_campaign(specs: Sequence[RunSpec], out: str, overrides: dict[str, Any] | None = None,
                 trainer: Callable[[TrainConfig], dict[str, Any]] = train,
                 echo: Callable[[str], None] = log.warning,
                 workloads: dict[str, Workload] | None = None) -> list[str]:
    """Train every run of ``specs`` whose record file is missing; returns the record paths.

    ``overrides`` go into every :class:`TrainConfig` (e.g. ``workers``, or ``epochs`` for a
    shorter budget than the workload's ``max_epochs``); ``workloads`` replaces :data:`WORKLOADS`
    (the demo's shorter budgets, the tests' tiny models).
    """
    paths = []
    for i, spec in enumerate(specs, start=1):
        path = record_path(out, spec)
        paths.append(path)
        if os.path.exists(path):
            echo(f"[{i}/{len(specs)}] {spec.workload} {spec.net or 'loopback'} {spec.label}: done before, skipped")
            continue
        wl = (workloads or WORKLOADS)[spec.workload]
        config = wl.config(method=spec.method, density=spec.density, powersgd_rank=spec.powersgd_rank,
                           net=spec.net, stop_at_target=False, **(RECIPES[spec.recipe] if spec.recipe else {}),
                           **(overrides or {}))
        echo(f"[{i}/{len(specs)}] {spec.workload} {spec.net or 'loopback'} {spec.label} ...")
        record = trainer(config)
        record["campaign"] = {"workload": spec.workload, "metric": wl.metric, "target": wl.target,
                              "label": spec.label}
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


def _order(record: dict[str, Any]) -> tuple:
    label = record["campaign"]["label"]
    kind = 0 if label == "ddp" else 1 if label.startswith("powersgd") else 2
    return (record["campaign"]["workload"], record["config"]["net"] or "", kind, -record["config"]["density"], label)


def _metric_at_epoch(history: Sequence[dict[str, Any]], epoch: float, metric: str) -> float | None:
    points = [h for h in history if h["epoch"] <= epoch + 1e-9]
    return metric_of(points[-1], metric) if points else None


def campaign_rows(records: Sequence[dict[str, Any]], by_network: bool = True) -> list[dict[str, Any]]:
    """One row per run: time and epochs to target, speed-up against DDP (same workload and
    network; any network with ``by_network=False``, for the metric columns of runs whose
    trajectory does not depend on it), ms per step, final metric, and the difference to DDP after
    the same epochs."""
    rows = []
    ddp = {(r["campaign"]["workload"], r["config"]["net"] if by_network else None): r
           for r in records if r["campaign"]["label"] == "ddp"}
    for rec in sorted(records, key=_order):
        camp, net = rec["campaign"], rec["config"]["net"]
        metric, target = camp["metric"], _target(camp)
        ttt, ett = time_and_epochs_to_target(rec["history"], metric, target)
        base = ddp.get((camp["workload"], net if by_network else None))
        base_ttt = time_and_epochs_to_target(base["history"], metric, target)[0] if base else None
        final = metric_of(rec["history"][-1], metric)
        epoch = rec["history"][-1]["epoch"]
        delta: Any = "-"
        if base is not None:
            common = min(epoch, base["history"][-1]["epoch"])
            mine, theirs = (_metric_at_epoch(rec["history"], common, metric),
                            _metric_at_epoch(base["history"], common, metric))
            if mine is not None and theirs is not None:
                delta = (f"{mine - theirs:+.1f} points" if metric == "accuracy"
                         else f"{100 * (mine / theirs - 1):+.1f}%")
        steps = rec["epochs"]
        rows.append({
            "workload": f"{rec['config']['model']} / {rec['config']['data']}",
            "network": net or "loopback",
            "method": camp["label"],
            "time to target s": "not reached" if ttt is None else ttt,
            "speed-up vs DDP": (base_ttt / ttt) if (ttt and base_ttt) else "-",
            "epochs to target": "-" if ett is None else ett,
            "ms/step": 1e3 * sum(e["time_per_step"] for e in steps) / len(steps),
            f"final {metric}": final,
            "epochs run": epoch,
            "vs DDP, same epochs": delta,
            "MB sent/step": (sum(e["bytes_per_step"] for e in steps) / len(steps) / 1e6
                             if camp["label"] not in ("ddp",) and not camp["label"].startswith("powersgd")
                             else "not metered"),  # torch's own all-reduce bypasses sparsecomm's meter
        })
    return rows


def speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and network (rows of :func:`campaign_rows`): the fastest method to the target,
    DDP's and the best PowerSGD's times, and the speed-ups of the fastest sparse method."""
    out = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["network"]), []).append(row)

    def ttt(row: dict[str, Any] | None) -> float | None:
        value = None if row is None else row["time to target s"]
        return value if isinstance(value, float) else None

    for (workload, network), group in groups.items():
        ddp = next((r for r in group if r["method"] == "ddp"), None)
        power = sorted((r for r in group if r["method"].startswith("powersgd") and ttt(r)), key=lambda r: ttt(r) or 0)
        sparse = sorted((r for r in group if "@" in r["method"] and ttt(r)), key=lambda r: ttt(r) or 0)
        best = sparse[0] if sparse else None
        ddp_t, power_t, best_t = ttt(ddp), ttt(power[0] if power else None), ttt(best)
        out.append({"workload": workload, "network": network,
                    "fastest sparse": best["method"] if best else "none reached the target",
                    "its time s": best_t if best_t else "-",
                    "DDP s": ddp_t if ddp_t else ("not reached" if ddp else "not run"),
                    "best PowerSGD s": power_t if power_t else ("not reached" if any(
                        r["method"].startswith("powersgd") for r in group) else "not run"),
                    "speed-up vs DDP": ddp_t / best_t if ddp_t and best_t else "-",
                    "speed-up vs PowerSGD": power_t / best_t if power_t and best_t else "-",
                    "vs DDP, same epochs": best["vs DDP, same epochs"] if best else "-"})
    return out


def _plot_group(records: Sequence[dict[str, Any]], path: str) -> str:
    from ..core.optional import require

    matplotlib = require("matplotlib", "the campaign's plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    camp, cfg = records[0]["campaign"], records[0]["config"]
    metric = camp["metric"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax in axes:
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # type: ignore[attr-defined]  # a ListedColormap
    for rec in sorted(records, key=_order):
        values = [metric_of(h, metric) for h in rec["history"]]
        style = {"linewidth": 2.5} if rec["campaign"]["label"] in ("ddp",) else {"linewidth": 1.2}
        axes[0].plot([h["train_time"] for h in rec["history"]], values, marker="o", markersize=2,
                     label=rec["campaign"]["label"], **style)
        axes[1].plot([h["epoch"] for h in rec["history"]], values, marker="o", markersize=2,
                     label=rec["campaign"]["label"], **style)
    for ax in axes:
        ax.axhline(_target(camp), color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    if metric == "perplexity":
        axes[0].set_yscale("log")
        top = max(metric_of(r["history"][0], metric) for r in records)
        axes[0].set_ylim(_target(camp) * 0.7, min(top * 1.1, _target(camp) * 6))
    axes[0].set_xlabel("training wall time (s, evaluation excluded)")
    axes[1].set_xlabel("epoch")
    axes[0].set_ylabel(f"test {metric}" + (" (%)" if metric == "accuracy" else ""))
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{cfg['model']} on {cfg['data']}, P={cfg['workers']}, {records[0]['network'].split(' (')[0]}; "
                 f"target {_target(camp):g} (dashed)")
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
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["campaign"]["workload"], rec["config"]["net"] or "loopback"), []).append(rec)
    plots = [_plot_group(group, os.path.join(outdir, f"campaign-{safe_name(w)}-{safe_name(n)}.png"))
             for (w, n), group in sorted(groups.items())]
    rows = campaign_rows(records)
    summary = speedups(rows)
    lines = [f"# {title}", ""]
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    lines += ["", "Speed-up to target of the fastest sparse method:", "", markdown_table(summary), ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for row in rows:  # one table per workload: the metric columns differ (accuracy, perplexity)
        by_workload.setdefault(row["workload"], []).append(row)
    for workload, mine in by_workload.items():
        lines += [f"All runs, {workload}:", "", markdown_table(mine), ""]
    path = os.path.join(outdir, "campaign.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return {"markdown": path, "plots": plots, "rows": rows, "summary": summary}
