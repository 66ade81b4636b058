"""``sparsecomm bench exdyna``: ExDyna against its comparators on a stream of gradients.

Each method runs ``--warmup`` + ``--steps`` steps in its own worker group on the same stationary
stream: at every step rank r draws fresh i.i.d. normal gradients of standard deviation ``--scale``
(think learning rate x gradient; the scale decides where the thresholds of ``exdyna`` and
``threshold``, which start at 1 / (2 sqrt(k)), stand relative to the data; ``--scale auto`` puts
that first threshold at the two-sided normal quantile of the density, so step 1 selects about d n
per rank). Error feedback makes
the residuals random walks, so every threshold method goes through a transient of the order of
1/density steps before its density settles; run enough steps (``--plot``) to see it.

Table, per network and method: median over the timed steps of the slowest rank's time per step,
its split (rank 0), rank 0's bytes sent, mean actual density (output non-zeros / n) and mean
padding overhead f(t) over the timed steps, and the last step's density. ``--plot PATH`` draws
the actual density of every method at every step (warm-up included) into a PNG.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import MethodSpec
from sparsecomm_lab.bench.common import (
    check_density,
    check_methods_option,
    configurations,
    network_label,
    parse_count,
    parse_networks,
)

HELP = "ExDyna vs Top-k, CLT-k, hard threshold, SIDCo, dense: time per step and actual density over steps"

DEFAULT_METHODS = "exdyna,topk,cltk,threshold,sidco,dense"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=8, help="worker count P (default 8)")
    parser.add_argument("--size", "-n", default="25M", help="gradient elements, e.g. 25M (default 25M)")
    parser.add_argument("--density", type=float, default=0.001, help="user-set density (default 0.001)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated (default {DEFAULT_METHODS})")
    parser.add_argument("--net", default="loopback",
                        help="comma-separated networks: loopback and/or tc rates, e.g. loopback,1gbit")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--scale", default="auto",
                        help="standard deviation of the gradients, or 'auto' (default): the scale at which "
                             "the first threshold 1/(2 sqrt(k)) selects the user density of fresh gradients")
    parser.add_argument("--plot", default=None, help="write a PNG of density over steps to this path")
    parser.add_argument("--timeout", type=float, default=3000.0, help="seconds per worker group")


def _stream_worker(name: str, options: dict[str, Any], n: int, steps: int, scale: float) -> list[dict[str, float]]:
    """Worker: run ``steps`` steps of method ``name`` on fresh N(0, scale^2) gradients; per-step stats."""
    import torch.distributed as dist

    from sparsecomm.methods import make_method

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1_000_003 * rank + 17)
    grad, result = torch.empty(n), torch.empty(n)
    method = make_method(name, **options)
    records = []
    for _ in range(steps):
        torch.randn(n, generator=gen, out=grad).mul_(scale)
        dist.barrier()
        start = time.perf_counter()
        method(grad, out=result)
        elapsed = time.perf_counter() - start
        s = method.stats
        records.append({"time": elapsed, "density": s["density"], "bytes_sent": s["bytes_sent"],
                        "padding_overhead": s.get("padding_overhead", 1.0),
                        "time_select": s.get("time_select", 0.0), "time_comm": s.get("time_comm", 0.0),
                        "time_decompress": s.get("time_decompress", 0.0)})
    return records


def auto_scale(n: int, density: float) -> float:
    """Standard deviation s with P(|N(0, s^2)| >= 1 / (2 sqrt(k))) = density, k = ceil(density n)."""
    k = max(1, math.ceil(density * n))
    quantile = float(torch.special.ndtri(torch.tensor(1 - density / 2, dtype=torch.float64)))
    return 1 / (2 * math.sqrt(k)) / quantile


def _row(net: str | None, name: str, per_rank: list[list[dict[str, float]]], warmup: int) -> dict[str, Any]:
    timed = range(warmup, len(per_rank[0]))
    slowest = [max(rank[i]["time"] for rank in per_rank) for i in timed]
    rank0 = [per_rank[0][i] for i in timed]
    return {
        "network": network_label(net), "method": name,
        "time/step (ms)": 1e3 * statistics.median(slowest),
        "select (ms)": 1e3 * statistics.median(r["time_select"] for r in rank0),
        "comm (ms)": 1e3 * statistics.median(r["time_comm"] for r in rank0),
        "MB sent (rank 0)": ("gloo-internal" if name == "dense"
                             else statistics.median(r["bytes_sent"] for r in rank0) / 1e6),
        "mean density": statistics.mean(r["density"] for r in rank0),
        "last density": rank0[-1]["density"],
        "mean f(t)": statistics.mean(r["padding_overhead"] for r in rank0),
    }


def _plot(path: str, curves: dict[str, list[float]], density: float, title: str) -> None:
    from sparsecomm.core.optional import require

    matplotlib = require("matplotlib", "the density plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=name, linewidth=1.2)
    ax.axhline(density, color="black", linestyle="--", linewidth=0.8, label=f"user density {density:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("actual density (output non-zeros / n)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check(args) -> None:
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} must be >= 1")
    if parse_count(args.size) < 1:
        raise ValueError(f"--size={args.size} must be at least 1 element")
    check_density(args.density)
    check_methods_option(args.methods)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.scale != "auto":
        try:
            float(args.scale)
        except ValueError:
            raise ValueError(f"--scale={args.scale!r} must be a number or 'auto'") from None
    parse_networks(args.net, args.workers)


def run(args) -> int:
    check(args)
    n = parse_count(args.size)
    names = check_methods_option(args.methods)
    nets = parse_networks(args.net, args.workers)
    scale = auto_scale(n, args.density) if args.scale == "auto" else float(args.scale)
    rows, curves = [], {}
    for net, name in configurations([(net, name) for net in nets for name in names], "exdyna",
                                    lambda c: f"{c[1]} on {network_label(c[0])}"):
        options = dict(MethodSpec.at_density(name, args.density).options)
        per_rank = run_workers(args.workers, _stream_worker, name, options, n, args.warmup + args.steps,
                               scale, net=net, timeout=args.timeout)
        rows.append(_row(net, name, per_rank, args.warmup))
        if net == nets[0]:
            curves[name] = [r["density"] for r in per_rank[0]]
    print(markdown_table(rows))
    print(f"\nP={args.workers}, n={n}, user density {args.density:g}, gradients N(0, {scale:.3g}^2) fresh "
          f"every step; {args.steps} timed steps after {args.warmup} warm-up; time: median of the slowest "
          f"rank; split, bytes, densities: rank 0 (identical on every rank)")
    if args.plot:
        _plot(args.plot, curves, args.density,
              f"P={args.workers}, n={n}, {network_label(nets[0])}, gradients N(0, {scale:.3g}^2)")
        print(f"\ndensity over steps written to {args.plot}")
    return 0
