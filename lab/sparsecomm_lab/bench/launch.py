"""`sparsecomm bench launch`: wall time of run_workers(P, no-op), start to results, per P."""

from __future__ import annotations

import statistics
import time

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm_lab.bench.common import configurations, network_label, parse_networks

HELP = "start-up time of the local launcher (fork + gloo process group + exit) per worker count"


def _noop() -> int:
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    parser.add_argument("--repeat", type=int, default=5, help="launches per worker count (median reported)")
    parser.add_argument("--net", default="loopback", help="comma-separated networks, e.g. loopback,1gbit")


def check(args) -> None:
    from sparsecomm.cli.simulate import parse_workers

    parse_workers(args.workers)
    if args.repeat < 1:
        raise ValueError(f"--repeat={args.repeat} must be >= 1")
    for P in parse_workers(args.workers):
        parse_networks(args.net, P)


def run(args) -> int:
    from sparsecomm.cli.simulate import parse_workers

    check(args)
    rows = []
    for net, P in configurations([(net, P) for net in parse_networks(args.net) for P in parse_workers(args.workers)],
                                 "launch", lambda c: f"P={c[1]} on {network_label(c[0])}"):
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            run_workers(P, _noop, net=net, timeout=120)
            times.append(time.perf_counter() - start)
        rows.append({"network": network_label(net), "P": P, "median (s)": statistics.median(times),
                     "min (s)": min(times), "max (s)": max(times)})
    print(markdown_table(rows))
    print(f"\n{args.repeat} launches each: fork P workers, init gloo over a FileStore, run a no-op, "
          f"collect results, reap (and, with a tc network, build and tear down the namespaces)")
    return 0
