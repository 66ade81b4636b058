"""`sparsecomm simulate`: project each method's time to worker counts one machine cannot hold.

Uses the alpha-beta formulas of :mod:`sparsecomm.core.cost` (rank 0's figures; for data-dependent
sparse methods the formula's upper bound). alpha and beta come from the command line, or are fitted
with ``--calibrate`` from ring and Rabenseifner all-reduce runs of several sizes measured here
(loopback or an emulated ``--net``).
"""

from __future__ import annotations

import math
import re

from ...core.cost import fit_alpha_beta
from ...methods import available_costs, cost
from ..report_table import markdown_table

HELP = "project per-step communication time of each method to large P with the alpha-beta cost model"

_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|ns)?\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*$", re.I)


def parse_seconds(text: str) -> float:
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"alpha={text!r} must be a time such as 50us, 1.5ms or 0.002")
    scale = {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[match.group(2)]
    return float(match.group(1)) * scale


def parse_bandwidth(text: str) -> float:
    """'10gbit' -> seconds per byte."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"bandwidth={text!r} must be a rate such as 1gbit or 100mbit")
    bits = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    return 8.0 / bits


def add_arguments(parser) -> None:
    parser.add_argument("--workers", default="8,16,32,64,128", help="comma-separated worker counts")
    parser.add_argument("--size", default="25M", help="gradient elements n (default 25M)")
    parser.add_argument("--density", type=float, default=0.01, help="k = ceil(density * n)")
    parser.add_argument("--methods", default="dense,ring,rabenseifner,spardl,topka,exdyna",
                        help="comma-separated methods (those without a formula are skipped, with a note)")
    parser.add_argument("--alpha", default="50us", help="latency per round (default 50us)")
    parser.add_argument("--bandwidth", default="10gbit", help="link rate (default 10gbit)")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit alpha and beta from all-reduce runs measured here instead")
    parser.add_argument("--net", default=None, help="with --calibrate: emulated rate, e.g. 1gbit")


def _calibrate(net):
    from ..bench.common import summarize, time_method_in_worker
    from ..launcher import run_workers

    samples = []
    for P in (2, 4):
        for n in (1_000, 250_000, 2_000_000):
            for name in ("ring", "rabenseifner"):
                s = summarize(run_workers(P, time_method_in_worker, name, {}, n, 3, 1, net=net, timeout=600))
                model = cost(name, P=P, n=n, rank=0)
                samples.append((model.rounds, model.bytes_sent, s["time_s"]))
    return fit_alpha_beta(samples)


def run(args) -> int:
    from ..bench.common import parse_count

    n = parse_count(args.size)
    if not 0 < args.density <= 1:
        raise SystemExit(f"--density={args.density} must lie in (0, 1]")
    k = math.ceil(args.density * n)
    if args.calibrate:
        alpha, beta = _calibrate(args.net)
        source = f"fitted here ({'loopback' if args.net is None else 'tc ' + args.net})"
    else:
        alpha, beta = parse_seconds(args.alpha), parse_bandwidth(args.bandwidth)
        source = "given"
    known = set(available_costs())
    rows, skipped = [], []
    for name in args.methods.split(","):
        if name not in known:
            skipped.append(name)
            continue
        for P in (int(p) for p in args.workers.split(",")):
            c = cost(name, P=P, n=n, k=k, rank=0)
            rows.append({"method": name, "P": P, "rounds": c.rounds, "MB sent/rank": c.bytes_sent / 1e6,
                         "bound" if not c.exact else "exact": "upper bound" if not c.exact else "exact",
                         "time (ms)": 1e3 * c.time(alpha, beta)})
    print(markdown_table(rows, ["method", "P", "rounds", "MB sent/rank", "time (ms)"]))
    print(f"\nn={n}, k={k}, alpha={alpha * 1e6:.1f} us, beta={beta * 1e9:.3f} ns/byte ({source})")
    if skipped:
        print(f"no cost formula for: {', '.join(skipped)}")
    return 0
