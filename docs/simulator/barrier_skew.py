"""How far apart P colocated workers leave a barrier: the spread of their clocks' start in a timed call.

Every timed call of the calibration and of ``bench simvalidate`` starts on each rank when it leaves a
barrier (after copying the gradient, about one pass over it), and a call's time is its slowest
rank's, from that rank's own start. This measures the spread of the ranks' exits from such a barrier
(the latest exit less the earliest, on the machine's shared monotonic clock), after the same kind of
work (``--work`` passes of ``x += 1`` over ``-n`` elements) or none, at each P, under the emulated
rate of the validation (``--net``, default 1gbit; ``loopback`` for none).

    .venv/bin/python docs/simulator/barrier_skew.py --net 1gbit -P 2 3 4 6 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch


def worker(calls: int, n: int, work: int) -> list[float]:
    import torch.distributed as dist

    x = torch.randn(n)
    exits = []
    for _ in range(calls):
        for _ in range(work):
            x.add_(1.0)
        dist.barrier()
        exits.append(time.perf_counter())
    return exits


def main() -> None:
    from sparsecomm import run_workers
    from sparsecomm.experiments.bench.common import parse_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", default="1gbit")
    parser.add_argument("-P", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("-n", default="5M")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    n = parse_count(args.n)
    net = None if args.net == "loopback" else args.net
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} cores, net {args.net}, n = {n}, {args.calls} barriers (the first 5 not counted)")
    print("| P | work before the barrier | median spread (ms) | least (ms) | largest (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for P in args.P:
        for work in (0, 1):
            exits = run_workers(P, worker, args.calls, n, work, net=net, timeout=300)
            spread = [max(r[c] for r in exits) - min(r[c] for r in exits) for c in range(5, args.calls)]
            print(f"| {P} | {'one pass' if work else 'none'} | {1e3 * statistics.median(spread):.2f} | "
                  f"{1e3 * min(spread):.2f} | {1e3 * max(spread):.2f} |")


if __name__ == "__main__":
    main()
