"""``sparsecomm bench agreement``: what the per-call agreement (:mod:`sparsecomm.transport.agreement`)
costs against the whole call, per method.

Every call of a method first all-reduces a small header (and sums the gradient once to detect
NaN/Inf); the method records the seconds of that in ``stats.extra["time_agreement"]`` and the whole
call in ``stats.time_total``. Both come from the same calls, so the ratio needs no second run: the
table shows, for each method, the medians over calls of rank 0's agreement time, whole-call time and
their ratio (issue 16 asks for < 2 % at n = 1M).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from ...methods import available_methods, method_class
from ..launcher import run_workers
from ..report_table import markdown_table
from .common import parse_count

HELP = "cost of the per-call agreement header (and NaN/Inf scan) against the whole call, per method"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count (default 4)")
    parser.add_argument("--size", "-n", default="1M", help="gradient elements (default 1M)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per method (default 10)")
    parser.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")


def _worker(names: list[str], n: int, density: float, repeat: int) -> dict[str, list[tuple[float, float]]]:
    import torch.distributed as dist

    from ...methods import make_method

    rank = dist.get_rank()
    base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    out: dict[str, list[tuple[float, float]]] = {}
    for name in names:
        options: dict[str, Any] = {"density": density} if method_class(name).sparse else {}
        method = make_method(name, **options)
        samples = []
        for i in range(repeat + 1):
            dist.barrier()
            method(base.clone())
            if i:  # the first call warms up
                samples.append((method.stats["time_agreement"], method.stats.time_total))
        out[name] = samples
    return out


def run(args: argparse.Namespace) -> int:
    names = args.methods or available_methods()
    n = parse_count(args.size)
    results = run_workers(args.workers, _worker, names, n, args.density, args.repeat, timeout=1800)
    rows: list[dict[str, Any]] = []
    for name in names:
        samples = results[0][name]
        agreement = statistics.median(a for a, _ in samples)
        total = statistics.median(t for _, t in samples)
        ratio = statistics.median(a / t for a, t in samples)
        rows.append({"method": name, "agreement ms": 1e3 * agreement, "call ms": 1e3 * total,
                     "agreement / call %": 100 * ratio})
    print(f"P={args.workers}, n={n}, density={args.density}, {args.repeat} calls per method (medians, rank 0)\n")
    print(markdown_table(rows))
    return 0
