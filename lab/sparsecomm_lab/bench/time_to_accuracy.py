"""``sparsecomm bench time_to_accuracy``: the time-to-accuracy campaign (:mod:`sparsecomm.experiments.campaign`).

P workers (default 4) on each communication-heavy workload (``fashion``: the wide-FC VGG on
Fashion-MNIST, accuracy; ``lstm``: the word-level LSTM on the fortunes, perplexity), on each
emulated network (default 1 Gbit/s and 100 Mbit/s): the no-synchronization floor (``nosync``, DDP
with torch's no-op hook), plain DDP, DDP + PowerSGD rank 2 and 4 (one DDP bucket), every sparse
method at 1%, then the four fastest of those at 0.1%; for each of 3 seeds. Each run trains for the
workload's epoch budget (3 epochs), evaluated several times per epoch; the table gives the training
wall time to the target, the step as a multiple of the floor's, and the median over seeds with the
least and the most. Before each run the load average is recorded; the campaign waits for it to fall
to ``--max-load-per-core`` x cores and redoes a run started above it (the protocol of
:mod:`sparsecomm.experiments.campaign`). Runs go one after the other in one process tree, so ratios are
comparable on a noisy machine; a run whose record exists under ``--out`` is skipped (resume).
``--methods``, ``--workloads`` and ``--nets`` run a subset; ``--report`` writes the table and the
plots (metric against wall time and against epochs) there.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from sparsecomm.cli.table import markdown_table
from sparsecomm_lab import campaign
from sparsecomm_lab.bench.common import parse_networks
from sparsecomm_lab.training import recipe_densities_text

HELP = "time to a target accuracy/perplexity: DDP vs PowerSGD vs every sparse method (resumable campaign)"

log = logging.getLogger(__name__)


def _echo(line: str) -> None:
    print(line, flush=True)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count (default 4)")
    parser.add_argument("--workloads", default="fashion,lstm",
                        help=f"comma-separated, from {', '.join(campaign.WORKLOADS)} (default fashion,lstm)")
    parser.add_argument("--nets", "--net", default="1gbit,100mbit",
                        help="comma-separated emulated rates (loopback for none; default 1gbit,100mbit)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset: ddp, powersgd, sparse method names (default: all)")
    parser.add_argument("--density", type=float, default=None,
                        help=f"density of every sparse run (default: each method's recipe density, "
                        f"{recipe_densities_text()})")
    parser.add_argument("--low-density", default="0.001",
                        help="densities for the best sparse methods after the first stage ('' for none; default 0.001)")
    parser.add_argument("--best", type=int, default=4, help="how many sparse methods run at --low-density (default 4)")
    parser.add_argument("--powersgd-ranks", default="2,4",
                        help="PowerSGD ranks besides 2 and 4, which always run (default 2,4)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epoch budget of every run (default: the workload's, 3)")
    parser.add_argument("--seeds", default=",".join(map(str, campaign.SEEDS)),
                        help="comma-separated seeds; every run is made for each (default %(default)s)")
    campaign.add_quiet_arguments(parser)
    parser.add_argument("--out", default="runs/campaign", help="run records; existing ones are skipped "
                        "(default runs/campaign)")
    parser.add_argument("--report", default=None, help="write campaign.md and the plots into this folder "
                        "(default <out>/report)")
    parser.add_argument("--recipe", default=None, metavar="METHOD",
                        help="instead of the campaign: DDP and METHOD under each sparse-training recipe "
                        "(hook; momentum correction; momentum correction after a dense warm-up)")
    parser.add_argument("--report-only", action="store_true", help="write the report from the existing runs, "
                        "train nothing")


def run(args: argparse.Namespace) -> int:
    workloads = [w for w in args.workloads.split(",") if w]
    nets = parse_networks(args.nets)
    methods = [m for m in args.methods.split(",") if m] if args.methods else None
    ranks = [int(r) for r in args.powersgd_ranks.split(",") if r]
    overrides: dict = {"workers": args.workers}
    if args.epochs is not None:
        overrides["epochs"] = args.epochs
    try:
        if not all(s.strip().isdigit() for s in args.seeds.split(",") if s.strip()):
            raise ValueError(f"--seeds {args.seeds!r} must be comma-separated integers >= 0, e.g. 0,1,2")
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        quiet = campaign.quiet_policy(args)
        if args.recipe:
            first = campaign.plan_recipes(workloads, nets, args.recipe, density=args.density, seeds=seeds)
            low = []
        else:
            first = campaign.plan(workloads, nets, methods, density=args.density, powersgd_ranks=ranks, seeds=seeds)
            low = _floats(args.low_density)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.report_only:
        campaign.run_campaign(first, args.out, overrides, echo=_echo, quiet=quiet)
        for density in low:
            second = campaign.plan_low_density(workloads, nets, args.out, methods, density=density,
                                               best=args.best, from_density=args.density, seeds=seeds)
            campaign.run_campaign(second, args.out, overrides, echo=_echo, quiet=quiet)
    records = campaign.load_campaign(args.out)
    records = [r for r in records if r["campaign"]["workload"] in workloads
               and (r["config"]["net"] in nets) and r["campaign"].get("seed", 0) in seeds]
    if not records:
        print(f"no finished runs under {args.out}")
        return 1
    command = "sparsecomm bench time_to_accuracy " + shlex.join(sys.argv[3:])  # quoted: --low-density "" shows
    paths = campaign.write_campaign_report(records, args.report or f"{args.out}/report", command=command.strip())
    print(markdown_table(paths["rows"]))
    print(f"\nreport: {paths['markdown']}")
    return 0
