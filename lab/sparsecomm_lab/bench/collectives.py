"""`sparsecomm bench collectives`: time and bytes of the dense all-reduces, side by side in one run."""

from __future__ import annotations

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import cost
from sparsecomm.simulator.calibration import time_method_in_worker
from sparsecomm_lab.bench.common import (
    add_common_arguments,
    check_common,
    check_methods_option,
    configurations,
    network_label,
    summarize,
)

HELP = "time and bytes per rank of dense all-reduce methods (dense, ring, rabenseifner) for one P and size"


def add_arguments(parser) -> None:
    add_common_arguments(parser, workers=4, size="4M")
    parser.add_argument("--methods", default="dense,ring,rabenseifner", help="comma-separated method names")


def check(args) -> None:
    check_common(args)
    check_methods_option(args.methods)


def run(args) -> int:
    check(args)
    _, n, nets = check_common(args)
    rows = []
    for net, name in configurations([(net, name) for net in nets for name in check_methods_option(args.methods)],
                                    "collectives", lambda c: f"{c[1]} on {network_label(c[0])}"):
        per_rank = run_workers(args.workers, time_method_in_worker, name, {}, n, args.repeat,
                               args.warmup, net=net, timeout=args.timeout)
        s = summarize(per_rank)
        model = cost(name, P=args.workers, n=n, rank=0)
        rows.append({
            "network": network_label(net), "method": name, "P": args.workers, "n": n,
            "time (ms)": 1e3 * s["time_s"],
            "MB sent/rank (meter)": s["bytes_sent"] / 1e6 if name != "dense" else "n/a (inside gloo)",
            "MB sent/rank (model)": model.bytes_sent / 1e6,
            "rounds": model.rounds,
            "algbw (Gbit/s)": 8 * n * 4 / s["time_s"] / 1e9,
        })
    print(markdown_table(rows))
    print(f"\nmedian of {args.repeat} calls (after {args.warmup} warm-up) of the slowest rank; "
          f"algbw = n*4 bytes / time; P={args.workers}, n={n}, float32")
    return 0
