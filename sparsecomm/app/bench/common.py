"""Shared pieces of the benchmarks: size parsing, networks, timing of a method inside workers."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...methods import Stats

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}


def parse_count(text: str) -> int:
    """An element count with a decimal suffix: '25M' -> 25_000_000, '1000' -> 1000, '2.5k' -> 2500.
    (Byte sizes of the network emulation are :func:`sparsecomm.app.netemu.parse_size`.)"""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"size {text!r} must be a number with an optional k/M/G suffix, e.g. 25M")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_networks(text: str) -> list[str | None]:
    """'loopback,1gbit' -> [None, '1gbit']."""
    nets: list[str | None] = []
    for item in text.split(","):
        item = item.strip()
        nets.append(None if item in ("", "none", "loopback", "lo") else item)
    return nets


def network_label(net: str | None) -> str:
    return "loopback" if net is None else f"tc {net}"


def add_common_arguments(parser, *, workers: int, size: str, repeat: int = 5) -> None:
    parser.add_argument("--workers", "-P", type=int, default=workers, help=f"worker count P (default {workers})")
    parser.add_argument("--size", "-n", default=size, help=f"gradient elements, e.g. 25M (default {size})")
    parser.add_argument("--net", default="loopback",
                        help="comma-separated networks: loopback and/or tc rates, e.g. loopback,1gbit")
    parser.add_argument("--repeat", type=int, default=repeat, help=f"timed calls per method (default {repeat})")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per worker group")


def time_method_in_worker(name: str, options: dict[str, Any], n: int, repeat: int, warmup: int,
                          seed: int = 0, layout: Sequence | None = None,
                          grad_fn=None) -> dict[str, Any]:
    """Worker function: build the method, run warm-up and timed calls on a fixed gradient.

    Returns this rank's per-call wall times (each call starts after a barrier), and the stats of the
    last call. The gradient buffer is allocated once; each call gets a fresh copy made before the
    clock starts.
    """
    import torch.distributed as dist

    from ...methods import make_method

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    base = torch.randn(n, generator=gen) if grad_fn is None else grad_fn(n, rank)
    work = torch.empty_like(base)
    method = make_method(name, **options)
    times, stats = [], []
    for i in range(warmup + repeat):
        work.copy_(base)
        dist.barrier()
        start = time.perf_counter()
        method(work, layout)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            stats.append(method.stats)
    return {"times": times, "stats": stats}


#: the :class:`~sparsecomm.methods.Stats` figures :func:`summarize` reports (medians of rank 0's calls)
_SUMMARIZED = ("bytes_sent", "bytes_recv", "rounds", "selected", "nnz_out", "density", "time_select", "time_comm",
               "time_decompress")


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over calls of the slowest rank's time, and rank 0's stats medians."""
    calls = len(per_rank[0]["times"])
    slowest = [max(r["times"][i] for r in per_rank) for i in range(calls)]
    stats0: list[Stats] = per_rank[0]["stats"]
    out: dict[str, Any] = {"time_s": statistics.median(slowest)}
    for key in _SUMMARIZED:
        out[key] = statistics.median(getattr(s, key) for s in stats0)
    out["max_bytes_sent"] = max(max(s.bytes_sent for s in r["stats"]) for r in per_rank)
    return out
