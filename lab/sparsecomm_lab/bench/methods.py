"""`sparsecomm bench methods`: every method side by side on one gradient size, density and network.

Per method: median time per call of the slowest rank, its split into select / communicate /
decompress (rank 0), measured bytes sent by rank 0 against the cost model's figure, rounds, and the
output density. Each method runs in its own worker group, one after another in this process tree.
"""

from __future__ import annotations

import math

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import MethodSpec, available_costs, cost
from sparsecomm.simulator.calibration import time_method_in_worker
from sparsecomm_lab.bench.common import (
    add_common_arguments,
    check_common,
    check_density,
    check_methods_option,
    configurations,
    network_label,
    summarize,
)

HELP = "compare methods side by side: time split, bytes (meter vs. model), rounds, output density"


def add_arguments(parser) -> None:
    add_common_arguments(parser, workers=4, size="1M", repeat=3)
    parser.add_argument("--density", type=float, default=0.01, help="density of the sparse methods (default 0.01)")
    parser.add_argument("--methods", default="all", help="comma-separated names, or 'all' (default)")


def check(args) -> None:
    check_common(args)
    check_density(args.density)
    check_methods_option(args.methods)


def run(args) -> int:
    check(args)
    _, n, nets = check_common(args)
    names = check_methods_option(args.methods)
    k = math.ceil(args.density * n)
    formulas = set(available_costs())
    rows = []
    for net, name in configurations([(net, name) for net in nets for name in names], "methods",
                                    lambda c: f"{c[1]} on {network_label(c[0])}"):
        options = dict(MethodSpec.at_density(name, args.density).options)
        s = summarize(run_workers(args.workers, time_method_in_worker, name, options, n, args.repeat,
                                  args.warmup, net=net, timeout=args.timeout))
        model = cost(name, P=args.workers, n=n, k=k, rank=0, **options) if name in formulas else None
        rows.append({
            "network": network_label(net), "method": name,
            "density": options.get("density", 1.0),
            "time (ms)": 1e3 * s["time_s"],
            "select (ms)": 1e3 * s.get("time_select", 0.0),
            "comm (ms)": 1e3 * s.get("time_comm", 0.0),
            "decompress (ms)": 1e3 * s.get("time_decompress", 0.0),
            "MB sent (meter)": "gloo-internal" if name == "dense" else s["bytes_sent"] / 1e6,
            "MB sent (model)": "-" if model is None else
            (f"{model.bytes_sent / 1e6:.4g}" + ("" if model.exact else " (bound)")),
            "rounds": s["rounds"],
            "output density": s.get("density", 0.0),
        })
    print(markdown_table(rows))
    print(f"\nP={args.workers}, n={n}, k={k} per rank for sparse methods; median of {args.repeat} calls "
          f"(after {args.warmup} warm-up) of the slowest rank; split and bytes from rank 0")
    return 0
