"""Rabenseifner's all-reduce with its middle two rounds as one exchange (the library's, since
2026-11-28) against the textbook schedule (recursive halving, then recursive doubling: 2 log2 p'
rounds; kept here only as the reference), side by side: calls alternate between the two in one
process group. Rows: the all-reduce alone on n float32 values, and ExDyna and CLT-k calls (n = 1M,
density 1%), whose values' all-reduce is Rabenseifner's, with the textbook schedule swapped in for
the reference calls. Medians and least of the slowest rank's time per call, in ms.

    python docs/step-runs/rabenseifner-middle/compare.py [--nets loopback,1gbit] [-P 2,4] [--calls 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

from sparsecomm.launch.launcher import run_workers
from sparsecomm.transport import collectives as C


def textbook_rabenseifner(comm, x: torch.Tensor) -> torch.Tensor:
    """The schedule before the change, for P a power of two (the driver's P): every halving step and
    every doubling step a round of its own."""
    P, r = comm.size, comm.rank
    if P & (P - 1):
        raise ValueError(f"the textbook reference here takes P a power of two, not {P}")
    out = x.clone()
    steps = C._halving_segments(x.numel(), P, r) if P > 1 else []
    for mask, keep_lo, keep_hi, send_lo, send_hi in steps:
        incoming = torch.empty(keep_hi - keep_lo, dtype=x.dtype)
        comm.sendrecv(out[send_lo:send_hi], r ^ mask, incoming, r ^ mask)
        out[keep_lo:keep_hi] += incoming
    for mask, keep_lo, keep_hi, send_lo, send_hi in reversed(steps):
        comm.sendrecv(out[keep_lo:keep_hi], r ^ mask, out[send_lo:send_hi], r ^ mask)
    return out


def _worker(calls: int) -> dict:
    import torch.distributed as dist

    from sparsecomm import Communicator
    from sparsecomm.methods import make_method

    torch.set_num_threads(1)
    comm = Communicator()
    merged = C._ALLREDUCES["rabenseifner"]
    out: dict = {}
    cases = [(f"all-reduce n={n}", n, None) for n in (10_000, 100_000)] + \
            [(f"{m} n=1M 1%", 1_000_000, m) for m in ("exdyna", "cltk")]
    for label, n, method_name in cases:
        x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        methods = {v: make_method(method_name, density=0.01) for v in ("textbook", "merged")} if method_name else {}
        times: dict[str, list[float]] = {"textbook": [], "merged": []}
        for call in range(calls + 1):
            for variant in ("textbook", "merged") if call % 2 else ("merged", "textbook"):
                C._ALLREDUCES["rabenseifner"] = textbook_rabenseifner if variant == "textbook" else merged
                grad = x.clone()
                dist.barrier()
                start = time.perf_counter()
                if method_name:
                    methods[variant](grad)
                else:
                    C._ALLREDUCES["rabenseifner"](comm, grad)
                if call:
                    times[variant].append(time.perf_counter() - start)
        C._ALLREDUCES["rabenseifner"] = merged
        out[label] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nets", default="loopback,1gbit")
    parser.add_argument("-P", default="2,4")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, tree {tree}, load {os.getloadavg()[0]:.2f}, "
          f"{args.calls} calls of each, alternating; slowest rank per call, ms\n")
    print("| network | P | case | textbook median | merged median | textbook least | merged least |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for net in args.nets.split(","):
        for P in (int(p) for p in args.P.split(",")):
            ranks = run_workers(P, _worker, args.calls, net=None if net == "loopback" else net, timeout=900)
            for label in ranks[0]:
                slowest = {v: [max(r[label][v][i] for r in ranks) * 1e3 for i in range(args.calls)]
                           for v in ("textbook", "merged")}
                print(f"| {net} | {P} | {label} | {statistics.median(slowest['textbook']):.2f} "
                      f"| {statistics.median(slowest['merged']):.2f} | {min(slowest['textbook']):.2f} "
                      f"| {min(slowest['merged']):.2f} |")


if __name__ == "__main__":
    main()
