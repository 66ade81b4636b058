"""``sparsecomm bench agreement``: what the per-call agreement (:mod:`sparsecomm.transport.agreement`)
costs, per method, measured side by side.

Every call of a method first all-reduces a small header and sums the gradient once to detect NaN/Inf
(``Method._validate``). Two instances of each method run interleaved on the same gradient, each call
after a barrier: ``with`` is the library's call; ``without`` is the same call with the agreement
replaced, on that instance only, by the local checks alone (so it is unsafe, and exists only here).
The table shows rank 0's medians and minima of the whole-call times and the overhead
(with - without) / without of each, for every size given (default n = 1M and 25M, P = 4), and the
time of the non-finite check alone (the header's one pass over the gradient). ``agreement ms`` is the median
of ``stats.extra["time_agreement"]``, which also holds the wait for the slowest rank to arrive (a wait
that the call without agreement spends in its first message instead).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import MethodSpec, available_methods
from sparsecomm_lab.bench.common import parse_count

HELP = "cost of the per-call agreement header (and NaN/Inf scan): calls with and without it, interleaved"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count (default 4)")
    parser.add_argument("--size", "-n", nargs="+", default=["1M", "25M"],
                        help="gradient elements, one run per size (default 1M 25M)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per method and variant (default 20)")
    parser.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")


def _worker(names: list[str], n: int, density: float, repeat: int) -> dict[str, dict[str, list[float]]]:
    import time

    import torch.distributed as dist

    from sparsecomm.methods.agreement import count_nonfinite

    rank = dist.get_rank()
    base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    out: dict[str, dict[str, list[float]]] = {}
    checks = []
    for _ in range(repeat):
        start = time.perf_counter()
        count_nonfinite(base)
        checks.append(time.perf_counter() - start)
    out["<non-finite check>"] = {"check": checks}
    for name in names:
        spec = MethodSpec.at_density(name, density)
        variants = {"with": spec.build(), "without": spec.build()}
        variants["without"]._validate = lambda grad, layout: None  # type: ignore[method-assign]
        times: dict[str, list[float]] = {"with": [], "without": [], "agreement": []}
        for i in range(repeat + 1):
            for label, method in variants.items():
                grad = base.clone()
                dist.barrier()
                start = time.perf_counter()
                method(grad)
                elapsed = time.perf_counter() - start
                if i:  # the first round warms up
                    times[label].append(elapsed)
                    if label == "with":
                        times["agreement"].append(method.stats["time_agreement"])
        out[name] = times
    return out


def run(args: argparse.Namespace) -> int:
    names = args.methods or available_methods()
    for size in args.size:
        _run_size(args, names, parse_count(size))
    return 0


def _run_size(args: argparse.Namespace, names: list[str], n: int) -> None:
    results = run_workers(args.workers, _worker, names, n, args.density, args.repeat, timeout=1800)
    rows: list[dict[str, Any]] = []
    for name in names:
        t = results[0][name]
        med = {k: statistics.median(v) for k, v in t.items()}
        low = {k: min(v) for k, v in t.items()}
        rows.append({"method": name, "with ms (median)": 1e3 * med["with"], "without ms (median)": 1e3 * med["without"],
                     "overhead % (medians)": 100 * (med["with"] - med["without"]) / med["without"],
                     "overhead % (minima)": 100 * (low["with"] - low["without"]) / low["without"],
                     "agreement ms (median)": 1e3 * med["agreement"], "agreement ms (min)": 1e3 * low["agreement"]})
    check = results[0]["<non-finite check>"]["check"]
    print(f"P={args.workers}, n={n}, density={args.density}, {args.repeat} interleaved calls per variant "
          f"(rank 0); the non-finite check alone (one sum over the gradient, part of every agreement): "
          f"median {1e3 * statistics.median(check):.3f} ms, min {1e3 * min(check):.3f} ms\n")
    print(markdown_table(rows))
    print()
