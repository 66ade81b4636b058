"""``sparsecomm campaign``: the time-to-quality campaign of one workload (:mod:`sparsecomm_lab.campaign`).

Phases (``--phase``, default ``all``): ``convergence`` (every arm at every learning rate of the grid,
seed 0, then each arm's best rate at seeds 1 and 2; loopback), ``timing`` (each arm's step time on
each emulated network, waiting for a quiet machine), ``confirm`` (three full runs of the recommended arm
per network), ``report`` (``report.md``, ``summary.json`` and the plot in ``--report``). Every phase
skips the runs whose records exist under ``--out``, so the campaign resumes where it stopped.
"""

from __future__ import annotations

import argparse
import shlex

from sparsecomm_lab import campaign

HELP = "the time-to-quality campaign of a workload: a shared lr grid, 3 seeds, timed networks, a report"

PHASES = ("convergence", "timing", "confirm", "report")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="gpt", help=f"one of {', '.join(campaign.WORKLOADS)} (default gpt)")
    parser.add_argument("--phase", default="all", help=f"comma-separated from {', '.join(PHASES)}, or all")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the workload's arms (default: all)")
    parser.add_argument("--nets", default="100mbit,1gbit", help="emulated networks of the timing and confirmation")
    parser.add_argument("--out", default=None, help="records folder (default benchmarks/campaign-WORKLOAD/runs)")
    parser.add_argument("--report", default=None, help="report folder (default benchmarks/campaign-WORKLOAD)")
    campaign.add_quiet_arguments(parser, max_wait=600.0, redo=2)


def check(args: argparse.Namespace) -> None:
    campaign.workload(args.workload)
    phases = PHASES if args.phase == "all" else tuple(p.strip() for p in args.phase.split(","))
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"--phase {args.phase!r}: unknown {unknown}; choose from {', '.join(PHASES)} or all")
    args.phases = phases
    args.arm_list = campaign.arms_of(args.workload, args.arms.split(",") if args.arms else None)
    args.net_list = [n.strip() for n in args.nets.split(",") if n.strip()]
    args.out = args.out or f"benchmarks/campaign-{args.workload}/runs"
    args.report = args.report or f"benchmarks/campaign-{args.workload}"


def run(args: argparse.Namespace) -> int:
    wl = campaign.workload(args.workload)
    echo = lambda line: print(line, flush=True)  # noqa: E731
    quiet = campaign.quiet_policy(args)
    if "convergence" in args.phases:
        campaign.run_convergence(args.out, wl, args.arm_list, echo=echo)
    if "timing" in args.phases:
        # without --arms, the timing phase picks its arms itself (exploration arms are not timed)
        campaign.run_timing(args.out, wl, args.net_list, args.arm_list if args.arms else None, quiet=quiet, echo=echo)
    if "confirm" in args.phases:
        arm = next(a for a in campaign.arms_of(wl.name) if a.name == wl.recommended)
        campaign.run_confirmation(args.out, wl, args.net_list, arm, quiet=quiet, echo=echo)
    if "report" in args.phases:
        records = campaign.load_records(args.out, wl)
        analysed = campaign.analyse(records, wl, args.net_list)
        # the command that makes the whole campaign (every phase; each resumes), whichever phase ran here
        command = f"sparsecomm campaign --workload {wl.name} --nets {','.join(args.net_list)}"
        if args.arms:
            command += f" --arms {shlex.quote(args.arms)}"
        print(f"report: {campaign.write_report(analysed, records, args.report, command)}")
    return 0
