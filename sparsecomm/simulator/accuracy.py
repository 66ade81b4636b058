"""What each method and density cost in accuracy in the time-to-accuracy campaign: the table behind
``sparsecomm advise``'s accuracy check.

The table (``accuracy_table.json`` beside this module) is generated, not typed: run

    python -m sparsecomm.simulator.accuracy benchmarks/campaign-methods/report.md

(``make accuracy-table``), which reads the per-run tables of a campaign report (the lab's
``campaign.write_campaign_report``: its "All runs" or "Every run" tables) and writes, per workload,
each run's loss against DDP after the same epochs ("vs DDP, same epochs": accuracy points lost, or
perplexity percent gained; positive is worse), whether it reached the workload's target and in how
many epochs. Several seeds of one run give the median.

A (method, density) is **within tolerance** on a workload when its loss is at most the reference's
loss plus the tolerance: the reference is the best PowerSGD rank of the same campaign (a sparse
method worth recommending loses no more than PowerSGD's best rank, give or take the tolerance), or
DDP (loss 0). :func:`assess` gives the worst over the workloads the campaign measured, and the
epochs to the target over DDP's (time to accuracy is step time times that). A run that sent as much
as a dense one (a dense warm-up that outlasted the budget) gives no verdict: its accuracy is not its
sparse one.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TABLE_PATH", "parse_campaign_report", "load_table", "assess", "Assessment", "main"]

#: the generated table shipped with the package
TABLE_PATH = Path(__file__).with_name("accuracy_table.json")

_DELTA = re.compile(r"^([+-]?\d+(?:\.\d+)?)(%| points)$")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_campaign_report(text: str, source: str = "") -> dict[str, Any]:
    """The accuracy table from a campaign report's markdown (see the module docstring)."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    metrics: dict[str, str] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("| workload |"):
            i += 1
            continue
        header = _cells(lines[i])
        i += 2
        wanted = {"network", "method", "time to target s", "epochs to target", "vs DDP, same epochs"}
        final = next((h for h in header if h.startswith("final ")), None)
        per_run = wanted <= set(header) and final is not None and "seeds" not in header
        while i < len(lines) and lines[i].startswith("|"):
            if per_run:
                row = dict(zip(header, _cells(lines[i]), strict=True))
                label = row["method"]
                if "+" not in label and label != "nosync":  # recipes and the floor are not methods' accuracy
                    workload = row["workload"]
                    metrics[workload] = final.removeprefix("final ")  # type: ignore[union-attr]
                    match = _DELTA.match(row["vs DDP, same epochs"])
                    delta = float(match.group(1)) if match else None
                    loss = None if delta is None else (-delta if metrics[workload] == "accuracy" else delta)
                    reached = _number(row["time to target s"]) is not None
                    runs.setdefault((workload, label), []).append(
                        {"loss": loss, "reached": reached, "epochs": _number(row["epochs to target"]),
                         "network": row["network"], "seed": row.get("seed", "0"),
                         "megabytes": _number(row.get("MB sent/step", ""))})
            i += 1
    table: dict[str, Any] = {"source": source, "workloads": {}}
    for (workload, label), found in sorted(runs.items()):
        # the trajectory does not depend on the network (the same seed trains the same steps): one
        # entry per seed, the median over seeds
        by_seed = {r["seed"]: r for r in found}
        losses = [r["loss"] for r in by_seed.values() if r["loss"] is not None]
        epochs = [r["epochs"] for r in by_seed.values() if r["epochs"] is not None]
        reached_in = sum(r["reached"] for r in by_seed.values())
        megabytes = [r["megabytes"] for r in by_seed.values() if r["megabytes"] is not None]
        method, _, density = label.partition("@")
        entry = {"label": label, "method": method.split("-r")[0] if method.startswith("powersgd") else method,
                 "density": float(density) if density else None,
                 "loss": statistics.median(losses) if losses else None,
                 "reached": reached_in * 2 > len(by_seed), "epochs_to_target": statistics.median(epochs) if epochs
                 else None, "seeds": len(by_seed),
                 "megabytes_per_step": statistics.median(megabytes) if megabytes else None}
        table["workloads"].setdefault(workload, {"metric": metrics[workload], "runs": {}})["runs"][label] = entry
    if not table["workloads"]:
        raise ValueError(f"no per-run campaign table found in {source or 'the text'}")
    for entry in table["workloads"].values():
        _mark_dense_runs(entry["runs"])
    return table


#: a sparse run that sent more than this many times the median of its density's runs ran dense
DENSE_TRAFFIC_FACTOR = 5.0


def _mark_dense_runs(runs: dict[str, dict[str, Any]]) -> None:
    """Mark (``ran_dense``) the sparse runs whose metered traffic is more than
    :data:`DENSE_TRAFFIC_FACTOR` times the median of the runs at their density: they synchronized
    densely for the whole budget (a dense warm-up that outlasted it, e.g. Ok-Topk's public default of
    512 warm-up calls), so their accuracy is not their sparse one."""
    by_density: dict[float, list[float]] = {}
    for r in runs.values():
        if r["density"] is not None and r["megabytes_per_step"] is not None:
            by_density.setdefault(r["density"], []).append(r["megabytes_per_step"])
    for r in runs.values():
        mine = r["megabytes_per_step"]
        r["ran_dense"] = bool(r["density"] is not None and mine is not None
                              and mine > DENSE_TRAFFIC_FACTOR * statistics.median(by_density[r["density"]]))


def load_table(path: str | Path = TABLE_PATH) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"accuracy table {str(path)!r} cannot be read: {err}") from None


@dataclass(frozen=True)
class Assessment:
    """A (method, density)'s accuracy in the campaign: ``ok`` within tolerance on every workload
    measured (None: not measured), ``epochs_factor`` its epochs to the target over DDP's (the worst
    workload; inf when it did not reach the target), and ``note``, what the verdict rests on."""

    ok: bool | None
    epochs_factor: float
    note: str


def _unit(metric: str) -> str:
    return " points" if metric == "accuracy" else "% perplexity"


def _verdict(runs: dict[str, dict[str, Any]], entry: dict[str, Any], allowed: float) -> tuple[bool, float]:
    """(within ``allowed`` and reached the target, epochs to the target over DDP's) of one run entry."""
    ok = entry["loss"] is not None and entry["loss"] <= allowed + 1e-9 and entry["reached"]
    ddp = runs.get("ddp", {}).get("epochs_to_target")
    if not entry["reached"]:
        return ok, math.inf
    return ok, entry["epochs_to_target"] / ddp if ddp and entry["epochs_to_target"] else 1.0


def assess(table: dict[str, Any], method: str, density: float | None, tolerance: float = 0.5,
           reference: str = "powersgd") -> Assessment:
    """How ``method`` at ``density`` (None: a dense method) did in the campaign (module docstring).

    A density the campaign did not run is judged from the method's other densities there, on the
    assumption that accuracy does not improve as the density falls: below a density that lost more
    than allowed it is presumed to lose more; above one within tolerance, to be within it too (with
    that density's epochs to the target, an upper bound); otherwise it is unknown."""
    if reference not in ("powersgd", "ddp"):
        raise ValueError(f"reference={reference!r} must be 'powersgd' or 'ddp'")
    if not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    label = method if density is None or density >= 1 else f"{method}@{density:g}"
    verdicts, factors, notes = [], [], []
    for workload, entry in table["workloads"].items():
        runs = entry["runs"]
        powersgd = [r["loss"] for r in runs.values() if r["method"] == "powersgd" and r["loss"] is not None]
        allowed = (max(0.0, min(powersgd)) if reference == "powersgd" and powersgd else 0.0) + tolerance
        unit = _unit(entry["metric"])
        mine = runs.get(label)
        if mine is None and density is not None:
            measured = [r for r in runs.values() if r["method"] == method and r["density"] is not None
                        and not r.get("ran_dense")]
            denser_bad = [r for r in measured if r["density"] >= density and not _verdict(runs, r, allowed)[0]]
            sparser_ok = [r for r in measured if r["density"] <= density and _verdict(runs, r, allowed)[0]]
            if denser_bad:
                r = min(denser_bad, key=lambda r: r["density"])
                verdicts.append(False)
                factors.append(math.inf)
                notes.append(f"{workload}: not run at {density:g}; at {r['density']:g} it already lost "
                             f"{r['loss']:+.1f}{unit} (allowed {allowed:.1f}), a lower density is presumed worse")
            elif sparser_ok:
                r = max(sparser_ok, key=lambda r: r["density"])
                verdicts.append(True)
                factors.append(_verdict(runs, r, allowed)[1])
                notes.append(f"{workload}: not run at {density:g}; within tolerance at {r['density']:g}, a "
                             f"higher density is presumed no worse")
            elif any(r["method"] == method and r.get("ran_dense") for r in runs.values()):
                notes.append(f"{workload}: not run at {density:g}, and its campaign run ran dense (its traffic)")
            continue
        if mine is None:
            continue
        if mine.get("ran_dense"):
            notes.append(f"{workload}: ran dense in the campaign (its traffic), its sparse accuracy unknown")
            continue
        ok, factor = _verdict(runs, mine, allowed)
        verdicts.append(ok)
        factors.append(factor)
        what = "did not reach the target, " if not mine["reached"] else ""
        notes.append(f"{workload}: {what}lost {mine['loss']:+.1f}{unit} vs DDP (allowed {allowed:.1f})"
                     if mine["loss"] is not None else f"{workload}: {what}no loss figure")
    if not verdicts:
        return Assessment(None, 1.0, "; ".join(notes) or f"{label}: not in the campaign (accuracy unknown)")
    return Assessment(all(verdicts), max(factors), "; ".join(notes))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparsecomm.simulator.accuracy REPORT.md [OUT.json]``: write the table (default: the
    package's ``accuracy_table.json``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m sparsecomm.simulator.accuracy CAMPAIGN_REPORT.md [OUT.json]", file=sys.stderr)
        return 2
    source, out = Path(args[0]), Path(args[1]) if len(args) > 1 else TABLE_PATH
    table = parse_campaign_report(source.read_text(), source=str(source))
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {sum(len(w['runs']) for w in table['workloads'].values())} runs over "
          f"{len(table['workloads'])} workloads from {source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
