"""The campaign's report: ``report.md`` (tables, goals, command), ``summary.json`` (the figures, which
``sparsecomm advise``'s accuracy table is built from) and one plot per workload."""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
from typing import Any

from sparsecomm.cli.table import markdown_table

from .analysis import Campaign, median_spread, median_with_misses
from .run import CONFIRM_REPEATS, TIMING_REPEATS

__all__ = ["write_report", "summary", "result_rows", "grid_rows"]

#: what the campaign asks of the recommended sparse arm (the goals of the time-to-quality protocol)
LIMIT_FACTOR = 1.25
SPEEDUP = 2.0
ROOM = 2.5
QUALITY = 0.01


def _optimizer(camp: Campaign, name: str) -> str:
    options = camp.arms[name].arm.options
    opt = camp.workload.optimizer(camp.arms[name].arm)
    if options.get("freeze_adam_variance"):
        return "AdamW, v frozen after warm-up"
    if options.get("momentum_correction"):
        return "SGD, DGC momentum correction"
    return {"adamw": "AdamW", "sgd": "SGD + momentum"}.get(opt, opt)


def grid_rows(camp: Campaign) -> list[dict[str, Any]]:
    """Arm x learning rate: the final metric at seed 0 (the best one marked)."""
    rows = []
    for name, result in camp.arms.items():
        if result.arm.timed_only or result.arm.is_policy or not result.grid:  # a policy's grids are its branches'
            continue
        row: dict[str, Any] = {"arm": name, "optimizer": _optimizer(camp, name)}
        for lr in sorted({lr for grid in camp.workload.lr_grids.values() for lr in grid}):
            value = result.grid.get(lr)
            if lr not in camp.workload.grid(result.arm):
                continue
            text = "-" if value is None else "diverged" if math.isnan(value) else f"{value:.4g}"
            row[f"lr {lr:g}"] = f"**{text}**" if lr == result.best_lr else text
        rows.append(row)
    return rows


def result_rows(camp: Campaign, net: str) -> list[dict[str, Any]]:
    """One row per arm on ``net``: best lr, steps and composed time to the target (median over seeds,
    least-most), step time and its multiple of the floor's, the final metric and its gap to DDP's."""
    floor = camp.arms.get("floor")
    floor_s = floor.step_s[net][1] if floor is not None and net in floor.step_s else None
    limit = camp.limit(net)
    rows = []
    for name in camp.arms:
        if name in camp.branch_names():  # a policy's branch: shown in the policy's row where it took it
            continue
        result = camp.result(name, net)
        if not (result.arm.timed_only or result.grid or result.step_s):  # not trained in this run: said apart
            continue
        main = result.step_s.get(net, (None, None))[1]
        times = result.times(net)
        steps = [s for s in result.steps.values() if s is not None]
        gap = camp.final_vs_ddp(name, net)
        reached = f"{len(steps)}/{len(result.steps)}" if result.steps else "-"
        took = {"method": " (kept the method)", "dense": " (fell back to dense)"}.get(result.decision.get(net, ""), "")
        rows.append({
            "arm": name + took + (" (exploration)" if result.arm.explore_lrs is not None else ""),
            "optimizer": _optimizer(camp, name),
            "best lr": "-" if result.best_lr is None else f"{result.best_lr:g}",
            "steps to target": "floor: trains apart" if result.arm.timed_only else
            f"{median_with_misses(list(result.steps.values()))} [{reached}]" if steps else f"not reached [{reached}]",
            "ms/step": "-" if main is None else f"{1e3 * main:.0f}",
            "x floor": "-" if main is None or not floor_s else f"{main / floor_s:.2f}",
            "time to target s": "-" if result.arm.timed_only else
            median_with_misses([result.time_to_target(net, seed) for seed in sorted(result.steps)]) if times
            else "not reached",
            "x limit": "-" if not times or limit is None else f"{result.median_time(net) / limit:.2f}",
            f"final {camp.workload.metric}": median_spread(list(result.final.values()), 4) if result.final else "-",
            "vs DDP": "-" if gap is None or name == "ddp" else f"{100 * gap:+.1f}%",
            "load": "-" if result.load.get(net) is None else f"{result.load[net]:.2f}",
        })
    return rows


def goals(camp: Campaign, net: str) -> dict[str, Any]:
    """The recommended arm against the campaign's goals on ``net``, measured."""
    name = camp.workload.recommended
    result = camp.result(name, net)
    mine = result.median_time(net)
    limit = camp.limit(net)
    base_name, base = camp.best_baseline(net)
    gap = camp.final_vs_ddp(name, net)
    out: dict[str, Any] = {"network": net, "recommended": name, "time to target s": mine, "limit s": limit,
                           "best of DDP/PowerSGD": base_name, "its time s": base}
    if limit and mine < math.inf:
        out["x limit"] = mine / limit
        out["within 1.25x the limit"] = mine <= LIMIT_FACTOR * limit
    if base < math.inf and mine < math.inf:
        out["speed-up vs best baseline"] = base / mine
        if limit and base >= ROOM * limit:
            out["2x sooner than the best baseline"] = base / mine >= SPEEDUP
        else:
            out["2x sooner than the best baseline"] = "no room (the best baseline is under 2.5x the limit)"
    if gap is not None:
        out["final vs DDP"] = gap
        out["within 1% of DDP"] = gap <= QUALITY
    return out


def summary(camp: Campaign) -> dict[str, Any]:
    """The figures as data (``summary.json``): per arm its configuration, best lr, steps to target
    and final metric per seed, step times per network; the target, DDP's plateau, the goals."""
    wl = camp.workload

    def figures(r: Any, name: str, net: str | None = None) -> dict[str, Any]:
        return {"grid": {f"{lr:g}": v for lr, v in r.grid.items()}, "best_lr": r.best_lr,
                "steps_to_target": {str(s): v for s, v in r.steps.items()},
                "final": {str(s): v for s, v in r.final.items()}, "final_vs_ddp": camp.final_vs_ddp(name, net)}

    def arm_entry(name: str, r: Any) -> dict[str, Any]:
        entry = {"kind": r.arm.kind, "description": r.arm.description, "options": r.arm.options,
                 "optimizer": _optimizer(camp, name),
                 "dense_twin": r.arm.dense_twin,
                 "step_s": {net: {"warmup": w, "main": m} for net, (w, m) in r.step_s.items()},
                 "timing_runs": r.timing_runs}
        if not r.arm.is_policy:
            return {**entry, **figures(r, name)}
        # a policy has no figures of its own: per network, the branch it took
        return {**entry, "grid": {}, "best_lr": None, "steps_to_target": {}, "final": {}, "final_vs_ddp": None,
                "by_network": {net: {"decision": r.decision.get(net), **figures(camp.result(name, net), name, net)}
                               for net in r.step_s}}

    return {
        "workload": {"name": wl.name, "model": wl.model, "data": wl.data, "metric": wl.metric, "steps": wl.steps,
                     "eval_every": wl.eval_every, "lr_grids": {k: list(v) for k, v in wl.lr_grids.items()},
                     "recommended": wl.recommended},
        "target": camp.target, "ddp_plateau": camp.plateau, "ddp_steps_to_target": camp.ddp_steps,
        "arms": {name: arm_entry(name, r) for name, r in camp.arms.items()},
        "goals": [goals(camp, net) for net in camp.nets],
        "confirmations": camp.confirmations,
    }


def _plot(camp: Campaign, records: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = camp.workload
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for record in records:
        c = record["campaign"]
        result = camp.arms.get(c["arm"])
        if (c["phase"] != "convergence" or c["seed"] != 0 or result is None or c["lr"] != result.best_lr
                or result.arm.explore_lrs is not None):  # the exploration arms are in the tables only
            continue
        if c["arm"] in camp.branch_names() and c["arm"] not in camp.branches_taken():  # a branch no net took
            continue
        values = [p["test_loss"] if wl.metric == "loss" else p["test_accuracy"] for p in record["history"]]
        ax.plot([p["step"] for p in record["history"]], values, label=f"{c['arm']} (lr {c['lr']:g})",
                linewidth=2.5 if c["arm"] == "ddp" else 1.3)
    if camp.target is not None:
        ax.axhline(camp.target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss" if wl.metric == "loss" else "validation accuracy (%)")
    if wl.metric == "loss" and camp.target is not None:
        ax.set_ylim(camp.target * 0.9, camp.target * 1.6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{wl.model} on {wl.data}, P = 4, seed 0, each arm at its best lr (explorations left out); "
                 "target dashed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _departures(camp: Campaign) -> list[str]:
    """The report's sentence naming the arms the campaign ran on fewer seeds than the protocol's, did
    not time, or timed in fewer runs, so that a reader sees where a row rests on less (exploration arms
    say so themselves)."""
    wl, branched = camp.workload, camp.branch_names()
    trained = [r for r in camp.arms.values() if not r.arm.timed_only and not r.arm.is_policy]
    untrained = [r.arm.name for r in trained if not r.grid]
    listed = [r for r in trained if r.arm.explore_lrs is None and r.arm.name not in branched]
    fewer = [r.arm.name for r in listed if r.final and len(r.final) < len(wl.seeds_of(r.arm))]
    untimed = [r.arm.name for r in listed if r.final and not r.step_s]
    timed: dict[str, dict[str, int]] = {}  # net -> arm -> its timing runs there
    for r in camp.arms.values():
        for net, n in r.timing_runs.items():
            if r.arm.name not in branched:
                timed.setdefault(net, {})[r.arm.name] = n
    timed_less = []
    for net, runs in timed.items():
        for n in sorted({n for n in runs.values() if n < TIMING_REPEATS}):
            names = [name for name, m in runs.items() if m == n]
            who = "every arm" if len(names) == len(runs) else ", ".join(names)
            timed_less.append(f"{who} on {net} ({n} run{'s' if n > 1 else ''})")
    said = []
    if untrained:
        said.append(f"not trained (no row): {', '.join(untrained)}")
    if fewer:
        said.append(f"ran at seed 0 alone (its row says [n/1]): {', '.join(fewer)}")
    if untimed:
        said.append(f"not timed (no step time or time to the target): {', '.join(untimed)}")
    if timed_less:
        said.append(f"step times from fewer than {TIMING_REPEATS} timing runs: {', '.join(timed_less)}")
    checked_less = [f"{net} ({c['runs']} run{'s' if c['runs'] > 1 else ''})" for net, c in camp.confirmations.items()
                    if c["runs"] < CONFIRM_REPEATS]
    if checked_less:
        said.append(f"the composition checked by fewer than {CONFIRM_REPEATS} full runs: {', '.join(checked_less)}")
    return [f"**Departures from the protocol in this run.** {'; '.join(said)}.", ""] if said else []


def write_report(camp: Campaign, records: list[dict[str, Any]], outdir: str, command: str) -> str:
    """Write ``report.md``, ``summary.json`` and the plot into ``outdir``; returns the report's path."""
    os.makedirs(outdir, exist_ok=True)
    wl = camp.workload
    data = summary(camp)
    data["command"] = command
    data["written"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    with open(os.path.join(outdir, "summary.json"), "w") as handle:
        json.dump(data, handle, indent=1, default=str)
    plot = _plot(camp, records, os.path.join(outdir, f"{wl.name}.png"))
    loads = [r.get("load", {}).get("before") for r in records if r["campaign"]["phase"] != "convergence"]
    loads = [x for x in loads if x is not None]
    lines = [f"# Campaign {wl.name}: {wl.model} on {wl.data}", "",
             f"Written {data['written']} by `{command}`. P = 4 workers; {wl.steps} optimizer steps per run "
             f"(cosine schedule), validation every {wl.eval_every} steps.", ""]
    if camp.target is not None:
        lines += [f"**Target**: DDP's validation {wl.metric} at 75% of the budget, {camp.target:.4g} (median over "
                  f"its seeds at its best lr). DDP's improvement over the last fifth of the budget: "
                  f"{100 * (camp.plateau or 0):.2f}% (the protocol asks for under 1%).", ""]
    if wl.note:
        lines += [f"**This comparison**: {wl.note}.", ""]
    lines += ["**Protocol.** Every arm trains at every learning rate of the grid with seed 0 on loopback; its best "
              "lr (final metric) then trains seeds 1 and 2. The metric after a given step does not depend on the "
              "link or the load (the runs are deterministic), so the time to the target is composed: steps to "
              "the target x the step time measured on each emulated network on a quiet machine (dense warm-up "
              f"steps at the warm-up's step time): the median of {TIMING_REPEATS} short timing runs, made in rounds "
              "(every arm once, then again) so that a slow spell of the machine falls on every arm alike; `load` "
              "is the highest load average before an arm's timing runs. The median of "
              f"{CONFIRM_REPEATS} full runs per network checks the composition. `x limit`: the time over the "
              "limit, the floor's step x DDP's steps to the target.", ""]
    lines += _departures(camp)
    if plot:
        lines += [f"![{os.path.basename(plot)}]({os.path.basename(plot)})", ""]
    for net in camp.nets:
        lines += [f"## {net}", "", markdown_table(result_rows(camp, net)), ""]
        g = goals(camp, net)
        shown = {k: f"{100 * v:+.2f}%" if k == "final vs DDP" else _fmt(v) for k, v in g.items()}
        lines += ["Goals of the recommended arm, measured:", "", markdown_table([shown]), ""]
    if camp.confirmations:
        rows = [{"network": net, **{k: _fmt(v) if v is not None else "not reached" if k in ("measured", "composed")
                                    else "-" for k, v in c.items()}} for net, c in camp.confirmations.items()]
        lines += ["## The composition, checked by full runs", "",
                  "`measured`: the full runs' training time to the target on the emulated network (their median; "
                  "a run that misses the target counts as never reaching it); `load`: the highest load before them; "
                  "`composed`: "
                  "steps to target x step times from the timing runs (seed 0; where seed 0 does not reach the "
                  "target, the check has nothing to compare).", "", markdown_table(rows), ""]
    lines += ["## The learning-rate grid (final metric, seed 0; best in bold)", "", markdown_table(grid_rows(camp)), ""]
    if loads:
        lines += [f"Load average before the timed runs: {min(loads):.2f}-{max(loads):.2f} "
                  f"(median {statistics.median(loads):.2f}).", ""]
    path = os.path.join(outdir, "report.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
    return path


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.3g}"
    return value
