"""Shared pieces of the benchmarks: networks, option checks, progress, summaries of a method's timed calls
(sizes are parsed by :func:`sparsecomm.cli.options.parse_count`, the timing inside workers is
:func:`sparsecomm.simulator.calibration.time_method_in_worker`).

Every bench module defines ``check(args)``: the CLI calls it before ``run`` and before any worker
starts, and a ``ValueError`` is one line ``sparsecomm bench NAME: error: ...`` with exit status 2. A
bench's defaults hold at any worker count P (defaults that depend on P, such as SparDL's team
counts, are derived from it).
"""

from __future__ import annotations

import statistics
from typing import Any

from sparsecomm.cli.options import parse_count
from sparsecomm.methods import Stats, available_methods


def parse_networks(text: str, workers: int | None = None) -> list[str | None]:
    """'loopback,1gbit' -> [None, '1gbit']; every other item is checked as a ``net=`` spelling
    (:func:`sparsecomm.launch.netemu.parse_net` at ``workers`` ranks, or as a rate when P is not known):
    ValueError naming the item."""
    from sparsecomm.launch.netemu import LOOPBACK, parse_net, parse_rate

    nets: list[str | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == LOOPBACK:
            nets.append(None)
            continue
        if workers is not None:
            parse_net(item, workers)
        elif ":" not in item:
            parse_rate(item)
        nets.append(item)
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


def check_common(args) -> tuple[int, int, list[str | None]]:
    """(P, n, networks) of :func:`add_common_arguments`'s options; ValueError naming a bad one."""
    P, n = args.workers, parse_count(args.size)
    if P < 1:
        raise ValueError(f"--workers={P} must be >= 1")
    if n < 1:
        raise ValueError(f"--size={args.size} must be at least 1 element")
    if args.repeat < 1 or args.warmup < 0:
        raise ValueError(f"--repeat={args.repeat} must be >= 1 and --warmup={args.warmup} >= 0")
    return P, n, parse_networks(args.net, P)


def check_methods_option(text: str) -> list[str]:
    """Method names of a ``--methods`` option ('all' or comma-separated); ValueError ("unknown method
    ...; valid names: ...") otherwise."""
    from sparsecomm.simulator.model import check_methods

    return available_methods() if text.strip() == "all" else check_methods(x for x in text.split(",") if x.strip())


def check_density(density: float) -> None:
    if not 0 < density <= 1:
        raise ValueError(f"--density={density} must lie in (0, 1]")


def configurations(items, bench: str, label=str):
    """``items`` with progress output: each configuration is announced before it runs
    (:func:`sparsecomm.experiments.progress.progress_iter`, on stderr)."""
    from sparsecomm_lab.progress import progress_iter

    return progress_iter(items, f"bench {bench}", label)


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
