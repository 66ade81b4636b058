"""What the cores' estimate of the simulator rests on: per call, the slowest rank's wall time against
each rank's process CPU, at P = 2, 3 and 6 forked workers on this machine's cores, n = 5M, emulated
1 Gbit/s, density 1% (the held-out points of docs/simulator.md).

For each method and P: the least over 8 calls of the slowest rank's wall time (as the validation
measures it), the least over calls of a rank's process CPU (every thread), the largest over ranks,
and the wire time of the method's cost formula at the link's fitted rate (1 Gbit/s: 8 ns a byte;
the slowest sampled rank's bytes). With P ranks on C cores the cores' estimate is P / C x CPU +
wire (the bytes' copies aside): the report puts it beside the wall time.

Run from the repository root as root (the emulated links need network namespaces):
    PYTHONPATH=. python docs/simulator/cores/measure.py > docs/simulator/cores/report.md
"""

import os
import subprocess
import time

import torch

from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import cost
from sparsecomm.methods.base import selection_count
from sparsecomm.simulator.model import layout_options

METHODS = ["dense", "spardl", "topka", "exdyna", "topkdsa", "topk", "hitopk", "cltk"]
N, DENSITY, CALLS, BYTE_S = 5_000_000, 0.01, 8, 8e-9


def worker(methods, n, calls):
    import torch.distributed as dist

    from sparsecomm.methods import make_method
    from sparsecomm.methods.spec import MethodSpec

    torch.set_num_threads(1)
    base = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    work, result = torch.empty_like(base), torch.empty_like(base)
    out = {}
    for name in methods:
        method = make_method(name, **MethodSpec.at_density(name, DENSITY).options)
        rows = []
        for call in range(calls + 1):  # the first call warms up
            work.copy_(base)
            dist.barrier()
            cpu, start = time.process_time(), time.perf_counter()
            method(work, None, out=result)
            if call:
                rows.append((time.perf_counter() - start, time.process_time() - cpu))
        out[name] = rows
    return out


def wire_s(name, P):
    k = selection_count(DENSITY, N) if name != "dense" else 0
    options = layout_options(name, P, "1gbit", True)
    return max(cost(name, P=P, n=N, k=k, rank=r, density=DENSITY, **options).bytes_sent for r in range(P)) * BYTE_S


def main():
    cores = len(os.sched_getaffinity(0))
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, tree {tree}, 1-minute load "
          f"{os.getloadavg()[0]:.2f}, {cores} cores. Command: `PYTHONPATH=. python docs/simulator/cores/measure.py`\n")
    print(f"n = {N:,}, 1 Gbit/s, density {DENSITY}; least of {CALLS} calls. Estimate: P / {cores} x CPU + wire.\n")
    print("| method | P | wall (ms) | CPU per rank (ms) | wire (ms) | estimate (ms) | estimate / wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    results = {P: run_workers(P, worker, METHODS, N, CALLS, net="1gbit", timeout=900) for P in (2, 3, 6)}
    for name in METHODS:
        for P, ranks in results.items():
            wall = min(max(rank[name][c][0] for rank in ranks) for c in range(CALLS))
            cpu = max(min(row[1] for row in rank[name]) for rank in ranks)
            wire = wire_s(name, P)
            estimate = max(1.0, P / cores) * cpu + wire
            print(f"| {name} | {P} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {wire * 1e3:.1f} | {estimate * 1e3:.1f} "
                  f"| {estimate / wall:.2f} |")


if __name__ == "__main__":
    main()
