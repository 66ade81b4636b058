"""``sparsecomm demo``: the campaign's comparison, live.

P = 4 local workers on an emulated 1 Gbit/s switch (loopback when the machine cannot emulate it,
said in the output) train the campaign's transformer (``gpt`` on ``python-source``, AdamW) with the
campaign's comparison, each arm at the learning rate the campaign found best for it on the shared
grid (``benchmarks/campaign-gpt/summary.json``): the no-synchronization floor, the campaign's fastest
form of torch's DDP on this network (plain, or in half precision where that was faster), the best
PowerSGD rank, and the recommended sparse recipe, over the campaign's budget, for which the learning
rates were tuned (``--steps`` cuts it, scaling the cosine schedule and the recipe's dense warm-up with
it). The target is the demo's own DDP run's validation loss at 75% of the budget (plain DDP's where
``--arms`` names it); every arm's time to it is measured here, on the emulated link, not composed.
The report gives each arm's step as a multiple of the floor's and the load average before its run.

To fit in 10 minutes on a 2-core machine, the floor (whose replicas train apart: its loss says
nothing) runs only the campaign's timing steps, and the arms other than DDP and the recipe stop at
the target (the comparison needs their time to it; DDP's and the recipe's runs go to the end, for
the final loss).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import time
from typing import Any, NamedTuple

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.netemu import emulated_net, unavailable_reason
from sparsecomm_lab import campaign
from sparsecomm_lab.campaign.analysis import median_spread, steps_to_target
from sparsecomm_lab.campaign.run import TIMING_STEPS
from sparsecomm_lab.training import save_record, train

HELP = "the campaign's fair comparison, live on an emulated 1 Gbit/s link: DDP, PowerSGD, sparse, the floor"

#: the campaign whose tuned learning rates the demo takes
SUMMARY = os.path.join("benchmarks", "campaign-gpt", "summary.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count (default 4)")
    parser.add_argument("--net", default="1gbit", help="emulated rate, or 'loopback' (default 1gbit)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: the campaign's budget, 600)")
    parser.add_argument("--arms", default=None, help="comma-separated arms (default: floor, the campaign's fastest "
                        "form of DDP on --net, its best PowerSGD rank, its recommended sparse arm)")
    parser.add_argument("--summary", default=SUMMARY, help="the campaign summary with the tuned lrs")
    parser.add_argument("--out", default=None, help="output folder (default runs/demo-<time>)")
    parser.add_argument("--copy-to", default=None, help="also copy the report and records here (e.g. "
                        "benchmarks/demo), replacing the files of an earlier demo there and keeping its README.md")
    campaign.add_quiet_arguments(parser, max_wait=0.0, redo=0)


def check(args: argparse.Namespace) -> None:
    if args.steps is not None and args.steps < 20:
        raise ValueError(f"--steps {args.steps} must be >= 20 (an evaluation every steps/12)")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers} must be >= 1")
    for path in (args.out, args.copy_to):
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.access(parent if os.path.isdir(parent) else os.path.dirname(parent) or ".", os.W_OK):
                raise ValueError(f"cannot write {path!r}: its folder is not writable")


class Tuned(NamedTuple):
    """What the demo takes from the campaign's summary."""

    lrs: dict[str, float]        # arm -> its best lr on the shared grid
    best_power: str              # the PowerSGD rank with the lowest final loss
    recommended: str             # the recommended sparse arm
    fastest_ddp: str             # the fastest form of DDP on the demo's network (plain "ddp" without figures)


def tuned(summary_path: str, net: str | None = None) -> Tuned:
    """:class:`Tuned` from the campaign's summary; without one, every arm at the workload's default lr
    (said by the caller) and plain DDP."""
    wl = campaign.workload("gpt")
    if not os.path.exists(summary_path):
        return Tuned({}, "powersgd-r4", wl.recommended, "ddp")
    with open(summary_path) as handle:
        data = json.load(handle)
    lrs = {name: arm["best_lr"] for name, arm in data["arms"].items() if arm.get("best_lr") is not None}
    finals = {name: min((v for v in arm["final"].values()), default=float("inf"))
              for name, arm in data["arms"].items() if name.startswith("powersgd")}
    best_power = min(finals, key=finals.__getitem__) if finals else "powersgd-r4"

    def ddp_time(arm: dict[str, Any]) -> float:  # median steps to the target x the main step on ``net``
        steps = sorted(math.inf if v is None else v for v in arm.get("steps_to_target", {}).values())
        step = arm.get("step_s", {}).get(net or "loopback", {}).get("main")
        return steps[len(steps) // 2] * step if steps and step else math.inf

    forms = {name: ddp_time(arm) for name, arm in data["arms"].items() if arm.get("options", {}).get("method") == "ddp"}
    fastest = min(forms, key=forms.__getitem__) if forms else "ddp"
    if forms.get(fastest, math.inf) >= forms.get("ddp", math.inf):  # no figures, or a tie: plain DDP
        fastest = "ddp"
    return Tuned(lrs, best_power, data["workload"]["recommended"], fastest)


def run(args: argparse.Namespace) -> int:
    wl = campaign.workload("gpt")
    if args.steps is None:
        args.steps = wl.steps
    net = emulated_net(args.net)
    if net is not None and unavailable_reason() is not None:
        print(f"note: cannot emulate {net} here ({unavailable_reason()}); running on loopback")
        net = None
    found = tuned(args.summary, net)
    names = args.arms.split(",") if args.arms else ["floor", found.fastest_ddp, found.best_power, found.recommended]
    arms = campaign.arms_of("gpt", names)
    ddp = reference_ddp(arms)
    out = args.out or os.path.join("runs", "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    eval_every = max(1, args.steps // 12)
    print(f"demo: {wl.model} on {wl.data}, P={args.workers}, net={net or 'loopback'}, {args.steps} steps; arms: "
          f"{', '.join(a.name for a in arms)}" + ("" if found.lrs else f" (no campaign summary at {args.summary}: "
                                                                    "every arm at the default lr)"), flush=True)
    quiet = campaign.quiet_policy(args)
    start = time.perf_counter()
    records: dict[str, dict[str, Any]] = {}
    for arm in arms:
        lr = found.lrs.get(arm.name, 1e-3)
        config = wl.config(arm, lr, 0, steps=args.steps, eval_every=eval_every, net=net, workers=args.workers)
        if arm.options.get("dense_warmup_steps"):  # the warm-up keeps its share of the shorter budget
            config.dense_warmup_steps = max(1, round(arm.options["dense_warmup_steps"] * args.steps / wl.steps))
        if arm.timed_only:  # the floor: its step time (its replicas train apart)
            config.steps = config.eval_every = min(args.steps, TIMING_STEPS)
        target = demo_target(records.get(ddp or ""), args.steps)
        if target is not None and arm.name not in (ddp, found.recommended) and not arm.timed_only:
            config.target_perplexity, config.stop_at_target = math.exp(target), True
        print(f"  {arm.name} (lr {lr:g}) ...", flush=True)
        record = campaign.quiet.train_quietly(config, train, quiet, lambda line: print(line, flush=True))
        save_record(record, out, f"{arm.name}.json")
        records[arm.name] = record
    report = write_demo_report(records, wl, out, args, net, ddp)
    print()
    print(report["table"])
    print(f"\nreport: {report['path']} (total {time.perf_counter() - start:.0f} s)")
    if args.copy_to:
        copy_result(out, args.copy_to)
        print(f"copied to {args.copy_to}")
    return 0


def reference_ddp(arms: list[campaign.Arm]) -> str | None:
    """The DDP run that sets the target: plain DDP where it runs, else the first other form of DDP."""
    forms = [arm.name for arm in arms if arm.options.get("method") == "ddp"]
    return "ddp" if "ddp" in forms else forms[0] if forms else None


def demo_target(ddp: dict[str, Any] | None, steps: int) -> float | None:
    """DDP's validation loss at the last evaluation at or before 75% of the budget (None before DDP ran)."""
    if ddp is None:
        return None
    every = max(1, steps // 12)
    at = round(0.75 * steps / every) * every
    return float([p["test_loss"] for p in ddp["history"] if p["step"] <= at][-1])


def copy_result(out: str, folder: str) -> None:
    """Make ``out``'s report and records ``folder``'s result: the files of an earlier demo there go, the
    folder's own README.md (its description and command) stays."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name == "README.md":
            continue
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    shutil.copytree(out, folder, dirs_exist_ok=True)


def write_demo_report(records: dict[str, dict[str, Any]], wl: campaign.Workload, out: str,
                      args: argparse.Namespace, net: str | None, ddp: str | None) -> dict[str, Any]:
    """``report.md`` in ``out``: the table (measured times to the demo's target, that of run ``ddp``)
    and the command."""
    target = demo_target(records.get(ddp or ""), args.steps)
    floor = records.get("floor")
    floor_ms = 1e3 * _median_step(floor) if floor else None
    stopped = [n for n, r in records.items()  # arms cut at the target before the budget's end
               if r["config"].get("stop_at_target") and r["history"][-1]["step"] < args.steps]
    rows = []
    times = {}
    for name, record in records.items():
        ms = 1e3 * _median_step(record)
        steps = steps_to_target(record, target, "loss") if target is not None and name != "floor" else None
        reached = next((p["train_time"] for p in record["history"] if p["step"] == steps), None) if steps else None
        times[name] = reached
        rows.append({"arm": name, "lr": f"{record['config']['lr']:g}",
                     "time to target s": "floor: trains apart" if name == "floor" else
                     "not reached" if reached is None else f"{reached:.1f}",
                     "steps to target": "-" if steps is None else steps, "ms/step": f"{ms:.0f}",
                     "x floor": "-" if not floor_ms else f"{ms / floor_ms:.2f}",
                     "final loss": "-" if name == "floor" else "stopped at the target" if name in stopped
                     else f"{record['history'][-1]['test_loss']:.4f}",
                     "load before": "-" if record.get("load") is None else f"{record['load']['before']:.2f}"})
    kinds = {arm.name: arm for arm in campaign.arms_of("gpt", list(records))}
    base = [t for n, t in times.items()  # torch's DDP in any form, and PowerSGD
            if t and (kinds[n].kind == "powersgd" or kinds[n].options.get("method") == "ddp")]
    sparse = [t for n, t in times.items() if t and kinds[n].kind == "sparse"]
    headline = ""
    if base and sparse:
        headline = (f"The sparse recipe reached the target {min(base) / min(sparse):.2f}x sooner than the best of DDP "
                    f"(in any form run here) and PowerSGD ({median_spread([min(base)])} s against "
                    f"{median_spread([min(sparse)])} s).")
    floor_steps = len(floor["steps"]) if floor else 0
    cuts = ([f"the floor ran {floor_steps} steps (its step time; its replicas train apart)"]
            if floor and floor_steps < args.steps else [])
    if stopped:
        cuts.append(f"{', '.join(stopped)} stopped at the target (the comparison needs their time to it)")
    table = markdown_table(rows)
    command = "sparsecomm demo " + " ".join(sys.argv[2:])
    lines = ["# sparsecomm demo", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `{command.strip()}`: "
             f"{wl.model} on {wl.data}, P = {args.workers}, {net or 'loopback'}, {args.steps} steps per run (the "
             f"campaign's budget is {wl.steps}), each arm at the campaign's best lr for it. Target: "
             + (f"{ddp}'s validation loss at 75% of the budget, {target:.4f}." if target is not None
                else "DDP's validation loss (DDP did not run)."),
             "", table, "", headline, ""]
    if ddp is not None and ddp != "ddp":
        lines += [f"DDP runs as {ddp}, {kinds[ddp].description}: the campaign's fastest form of DDP on this link, "
                  "so the comparison is with the strongest DDP; `--arms floor,ddp,...` adds plain DDP, whose run "
                  "then sets the target.", ""]
    lines += [f"To fit the demo in 10 minutes, {'; '.join(cuts)}.", ""] if cuts else []
    lines += ["`load before`: the 1-minute load average as an arm started; it includes the previous arm's own "
              "workers for about a minute after they end (`--max-wait` waits for it to settle first).", ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
    return {"path": path, "table": table + ("\n\n" + headline if headline else ""), "rows": rows}


def _median_step(record: dict[str, Any]) -> float:
    times = sorted(s["time"] for s in record["steps"][3:] if not s.get("warmup"))
    return times[len(times) // 2] if times else float("nan")
