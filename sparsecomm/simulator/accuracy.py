"""What each method, density and recipe cost in quality in the time-to-quality campaigns: the table
behind ``sparsecomm advise``'s accuracy check.

The table (``accuracy_table.json`` beside this module) is generated from the campaigns' records, not
typed and not parsed from a report: run

    make accuracy-table      # python -m sparsecomm.simulator.accuracy benchmarks/campaign-*/summary.json

Each campaign's ``summary.json`` (written by the lab's ``sparsecomm campaign``) gives, per workload and
arm (a method at a density with a recipe and an optimizer), the final validation metric per seed at
the arm's best learning rate, and the steps to the target (DDP's metric at 75% of the budget). The
table keeps, per arm: its ``loss`` against DDP's (percent of DDP's final loss for a loss metric, accuracy
points lost for an accuracy metric; positive is worse; the median over seeds), whether most seeds
reached the target, and its median steps to it over DDP's (``steps_factor``).

A (method, density) is **within tolerance** on a workload when one of its recipes there lost at most
``tolerance`` beyond the reference (DDP, or the best PowerSGD rank) and reached the target;
:func:`assess` gives the verdict over the workloads that measured it (the worst), or over the one
workload named (a model like the user's), with its best recipe's steps to the target over DDP's.
Where no campaign measured it, the verdict is ``None``: accuracy unknown, which ``advise`` says
plainly and ranks after the measured candidates.

Per workload the table also keeps the campaign's measured goals on each network (``measured``: the
recommended arm's time to the target against the best torch baseline's and against the limit), which
``advise --like`` quotes: a prediction of the step is not a measured time to quality.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TABLE_PATH", "build_table", "load_table", "check_workload", "assess", "Assessment", "baselines_sooner",
           "measured_goals", "main"]

#: the generated table shipped with the package
TABLE_PATH = Path(__file__).with_name("accuracy_table.json")


def _entry(arm: dict[str, Any], ddp_steps: float | None, metric: str) -> dict[str, Any]:
    options = arm.get("options", {})
    steps = [s for s in arm.get("steps_to_target", {}).values()]
    reached = [s for s in steps if s is not None]
    # the campaign's median over the seeds, a seed that missed the target counting as never reaching it
    median = statistics.median(math.inf if s is None else s for s in steps) if steps else math.inf
    gap = arm.get("final_vs_ddp")
    recipe = [k for k in ("freeze_adam_variance", "momentum_correction", "dense_fallback") if options.get(k)]
    if options.get("sync") == "local":
        recipe.append(f"local_steps={options.get('local_steps')}")
    return {
        "method": str(options.get("method", "")), "density": options.get("density"),
        "sync": options.get("sync", "ddp"), "recipe": "+".join(recipe) or "hook", "kind": arm.get("kind"),
        "optimizer": arm.get("optimizer"),
        "loss": None if gap is None else 100.0 * gap,
        "reached": bool(steps) and len(reached) * 2 > len(steps),
        "steps_factor": median / ddp_steps if median < math.inf and ddp_steps else None,
        "seeds": len(arm.get("final", {})),
    }


def _measured(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The campaign's goals on each network where its recommended arm and its best baseline (a form of
    torch's DDP or PowerSGD) were compared: the recommended arm's speed-up over that baseline (under 1:
    the baseline reached the target sooner) and its time over the limit."""
    measured = []
    for goal in summary.get("goals", []):
        speedup, name = goal.get("speed-up vs best baseline"), goal.get("best of DDP/PowerSGD")
        if isinstance(speedup, (int, float)) and speedup > 0 and name in summary["arms"]:
            x_limit = goal.get("x limit")
            measured.append({"network": goal["network"], "recommended": goal["recommended"], "baseline": name,
                             "description": summary["arms"][name].get("description", name), "speedup": speedup,
                             "x_limit": x_limit if isinstance(x_limit, (int, float)) else None})
    return measured


def build_table(summaries: Sequence[dict[str, Any]], sources: Sequence[str] = ()) -> dict[str, Any]:
    """The accuracy table from campaign summaries (see the module docstring)."""
    table: dict[str, Any] = {"sources": list(sources), "workloads": {}}
    for summary in summaries:
        wl = summary["workload"]
        runs = {name: _entry(arm, summary.get("ddp_steps_to_target"), wl["metric"])
                for name, arm in summary["arms"].items() if arm.get("kind") != "floor" and arm.get("final")
                # a dense_fallback branch pinned to the dense all-reduce measures DDP's quality, not the method's
                and arm.get("options", {}).get("dense_fallback_decision") != "dense"}
        if wl["name"] in table["workloads"]:
            raise ValueError(f"two campaign summaries of workload {wl['name']!r}")
        table["workloads"][wl["name"]] = {"model": wl["model"], "data": wl["data"], "metric": wl["metric"],
                                          "runs": runs, "measured": _measured(summary)}
    if not table["workloads"]:
        raise ValueError("no campaign summaries to build the accuracy table from")
    return table


def load_table(path: str | Path = TABLE_PATH) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"accuracy table {str(path)!r} cannot be read: {err}") from None


def baselines_sooner(table: dict[str, Any], workload: str | None = None) -> list[str]:
    """One line per campaign network where a torch baseline beat the campaign's recommended arm to the
    target (``workload``: that workload's alone)."""
    return [f"in the {name} campaign ({entry['model']}), {m['baseline']} ({m['description']}) reached DDP's "
            f"target {1.0 / m['speedup']:.2f}x sooner than {m['recommended']} over {m['network']}: on a model like "
            f"it, try that first"
            for name, entry in table["workloads"].items() if workload is None or name == workload
            for m in entry["measured"] if m["speedup"] < 1]


def measured_goals(table: dict[str, Any], workload: str) -> list[str]:
    """One line per network of ``workload``'s campaign where its recommended arm reached the target: how
    much sooner than the best torch baseline, and its time over the limit (the floor's step x DDP's steps,
    the soonest any synchronization could get there)."""
    entry = table["workloads"].get(workload, {})
    return [f"in the {workload} campaign ({entry['model']}), {m['recommended']} reached DDP's target over "
            f"{m['network']} {m['speedup']:.2f}x sooner than {m['baseline']} (the fastest of torch's DDP and "
            f"PowerSGD there), in {m['x_limit']:.2f}x the soonest possible time"
            for m in entry.get("measured", []) if m["speedup"] >= 1 and m["x_limit"] is not None]


@dataclass(frozen=True)
class Assessment:
    """A (method, density)'s quality in the campaigns: ``ok`` within tolerance on every workload that
    measured it (None: not measured, accuracy unknown), ``steps_factor`` its steps to the target over
    DDP's (the worst workload; inf when it did not reach the target), ``recipe`` the recipe that did
    best, and ``note``, what the verdict rests on."""

    ok: bool | None
    steps_factor: float
    note: str
    recipe: str = ""


def _unit(metric: str) -> str:
    return " points" if metric == "accuracy" else "% loss"


def check_workload(table: dict[str, Any], workload: str | None) -> None:
    """Refuse a ``workload`` name that the table does not hold (None: every workload)."""
    if workload is not None and workload not in table["workloads"]:
        raise ValueError(f"workload {workload!r} is not in the accuracy table; measured: "
                         f"{', '.join(sorted(table['workloads']))}")


def assess(table: dict[str, Any], method: str, density: float | None, tolerance: float = 1.0,
           reference: str = "ddp", optimizer: str | None = None, workload: str | None = None) -> Assessment:
    """How ``method`` at ``density`` (None or 1: dense) did in the campaigns, with its best recipe there;
    ``optimizer`` (``"adamw"``, ``"sgd"``) keeps only the runs made with it, ``workload`` (a campaign
    workload's name) only that workload's."""
    if reference not in ("powersgd", "ddp"):
        raise ValueError(f"reference={reference!r} must be 'powersgd' or 'ddp'")
    check_workload(table, workload)
    if not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    verdicts, factors, notes, recipes = [], [], [], []
    for name_of_workload, entry in table["workloads"].items():
        if workload is not None and name_of_workload != workload:
            continue
        runs = entry["runs"]
        candidates = [(name, r) for name, r in runs.items() if r["method"] == method
                      and (r["density"] == density or (density is None or density >= 1) and r["density"] in (None, 1))
                      and (optimizer is None or str(r.get("optimizer", "")).lower().startswith(optimizer))]
        if not candidates:
            continue
        powersgd = [r["loss"] for r in runs.values() if r["method"] == "powersgd" and r["loss"] is not None]
        allowed = (max(0.0, min(powersgd)) if reference == "powersgd" and powersgd else 0.0) + tolerance
        name, best = min(candidates, key=lambda c: (not c[1]["reached"], math.inf if c[1]["loss"] is None
                                                    else c[1]["loss"]))
        ok = best["loss"] is not None and best["loss"] <= allowed + 1e-9 and best["reached"]
        verdicts.append(ok)
        factors.append(best["steps_factor"] if best["reached"] and best["steps_factor"] else
                       (1.0 if best["reached"] else math.inf))
        recipes.append(f"{name} ({best['optimizer']})")
        what = "" if best["reached"] else "did not reach the target, "
        if best["loss"] is None:
            notes.append(f"{name_of_workload}: {name}: no figure")
        else:
            notes.append(f"{name_of_workload}: {name}, {best['optimizer']}: {what}{best['loss']:+.1f}"
                         f"{_unit(entry['metric'])} vs DDP (allowed {allowed:.1f})")
    if not verdicts:
        label = method if density is None or density >= 1 else f"{method}@{density:g}"
        return Assessment(None, 1.0, f"{label}: no campaign measured it (accuracy unknown)")
    return Assessment(all(verdicts), max(factors), "; ".join(notes), ", ".join(recipes))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparsecomm.simulator.accuracy SUMMARY.json... [-o OUT.json]``: write the table
    (default: the package's ``accuracy_table.json``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    out = TABLE_PATH
    if "-o" in args:
        i = args.index("-o")
        out, args = Path(args[i + 1]), args[:i] + args[i + 2:]
    if not args:
        print("usage: python -m sparsecomm.simulator.accuracy SUMMARY.json... [-o OUT.json]", file=sys.stderr)
        return 2
    summaries = [json.loads(Path(a).read_text()) for a in args]
    table = build_table(summaries, sources=args)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {sum(len(w['runs']) for w in table['workloads'].values())} arms over "
          f"{len(table['workloads'])} workloads from {', '.join(args)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
