"""``sparsecomm bench hierarchy``: sparse and dense methods on emulated nodes, inter-node bytes apart.

Shi et al. ([ShiCloud], section 3.2) build HiTopKComm for m nodes of L GPUs whose
ranks share one NIC per node. Here every layout runs on ``net="MxL:RATE"`` (see
:mod:`sparsecomm.launch.netemu`): the ranks of a node share a namespace and one rate-limited NIC, and
talk to each other over its loopback. The hierarchical methods (``hitopk``, ``torus2d``,
``twolevel``) take the layout from ``LOCAL_WORLD_SIZE``, which the launcher sets; the meter counts the
bytes whose other end is on another node (the NIC's) apart from the intra-node bytes.

Per layout, density and method: the slowest rank's median time per step; per node, the bytes its
ranks sent over the NIC (the busiest node) and inside the node; the most rounds of any rank; and,
for hitopk, the paper's predictions: eq. (9)'s NIC bytes per node (L streams of 2 s (m-1) rho d / L
bytes, values and indices), eq. (7) + (10)'s intra-node bytes per node, and eq. (9)'s time at the
NIC rate (alpha = 0: no delay is emulated). ``dense`` is torch's own all-reduce, whose internal
messages the meter cannot see (its bytes are shown as ``backend``).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.launch.netemu import parse_net, parse_rate, unavailable_reason
from sparsecomm.methods import is_sparse
from sparsecomm.methods.hitopk import paper_bytes
from sparsecomm.simulator.calibration import time_method_in_worker
from sparsecomm_lab.bench.common import parse_count, summarize

HELP = "hitopk, torus2d, tree, twolevel, topka, spardl, dense on emulated nodes: NIC and intra-node bytes"

METHODS = "hitopk,torus2d,tree,twolevel,topka,spardl,dense"


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", type=_comma_list, default=["2x4", "4x2"],
                        help="comma-separated NODESxLOCAL layouts (default 2x4,4x2)")
    parser.add_argument("--rate", default="1gbit", help="each node's NIC rate, a tc rate (default 1gbit)")
    parser.add_argument("--intra-rate", default=None,
                        help="rate inside a node (tc rate; default: loopback, unlimited)")
    parser.add_argument("--size", "-n", default="25M", help="gradient elements, e.g. 25M (default 25M)")
    parser.add_argument("--densities", type=lambda s: [float(d) for d in _comma_list(s)],
                        default=[0.001, 0.01], help="densities of the sparse methods (default 0.001,0.01)")
    parser.add_argument("--methods", type=_comma_list, default=_comma_list(METHODS),
                        help=f"methods to run (default {METHODS})")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls per method (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker group")


def _per_node(per_rank: list[dict[str, Any]], local_size: int, field: str) -> float:
    """The busiest node's median (over calls) sum of ``field`` over its ranks, in MB."""
    calls = len(per_rank[0]["stats"])
    nodes = len(per_rank) // local_size
    per_call = [max(sum(getattr(per_rank[node * local_size + j]["stats"][i], field) for j in range(local_size))
                    for node in range(nodes)) for i in range(calls)]
    return sorted(per_call)[len(per_call) // 2] / 1e6


def _row(layout: str, density: float | None, name: str, per_rank: list[dict[str, Any]], P: int, L: int,
         n: int, rate: float) -> dict[str, Any]:
    summary = summarize(per_rank)
    modelled = per_rank[0]["stats"][-1].modelled_bytes
    nic = _per_node(per_rank, L, "inter_node_bytes_sent")
    intra = _per_node(per_rank, L, "bytes_sent") - nic
    row: dict[str, Any] = {
        "layout": layout, "density": "-" if density is None else density, "method": name,
        "time/step (s)": summary["time_s"],
        "NIC MB sent/node": "backend" if modelled else nic,
        "intra MB sent/node": "backend" if modelled else intra,
        "rounds (max rank)": max(max(s.rounds for s in r["stats"]) for r in per_rank),
        "eq.9 NIC MB/node": "-", "eq.7+10 intra MB/node": "-", "eq.9 s at NIC rate": "-",
    }
    if name == "hitopk" and density is not None:
        paper = paper_bytes(P, n, density, L)
        row["eq.9 NIC MB/node"] = L * paper["eq9_inter"] / 1e6
        row["eq.7+10 intra MB/node"] = L * (paper["eq7_intra"] + paper["eq10_intra"]) / 1e6
        row["eq.9 s at NIC rate"] = L * paper["eq9_inter"] * 8 / rate
    return row


def check(args: argparse.Namespace) -> tuple[int, list[tuple[str, int, int]]]:
    """(n, [(layout, nodes, local)]) of the options; ValueError naming a bad one."""
    n = parse_count(args.size)
    if n < 1 or args.repeat < 1 or args.warmup < 0:
        raise ValueError("--size and --repeat must be positive, --warmup not negative")
    if not args.densities or not all(0 < d <= 1 for d in args.densities):
        raise ValueError(f"--densities={args.densities} must be numbers in (0, 1]")
    for name in args.methods:
        is_sparse(name)   # raises naming the known methods
    layouts = []
    for layout in args.layouts:
        parts = layout.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--layouts: {layout!r} must be NODESxLOCAL, e.g. 2x4")
        nodes, local = int(parts[0]), int(parts[1])
        parse_net(f"{layout}:{args.rate}" + (f"/{args.intra_rate}" if args.intra_rate else ""), nodes * local)
        layouts.append((layout, nodes, local))
    return n, layouts


def run(args: argparse.Namespace) -> int:
    n, layouts = check(args)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench hierarchy needs emulated nodes, unavailable here: {reason}")
    rate = parse_rate(args.rate)
    rows = []
    print(f"{os.cpu_count()} CPUs, load average (1 min) {os.getloadavg()[0]:.2f} at the start\n", flush=True)
    for layout, nodes, local in layouts:
        P = nodes * local
        net = f"{layout}:{args.rate}" + (f"/{args.intra_rate}" if args.intra_rate else "")
        for name in args.methods:
            sparse = is_sparse(name)
            for density in (args.densities if sparse else [None]):
                options = {} if density is None else {"density": density}
                per_rank = run_workers(P, time_method_in_worker, name, options, n, args.repeat, args.warmup,
                                       net=net, timeout=args.timeout)
                rows.append(_row(layout, density, name, per_rank, P, local, n, rate))
                print(f"  done: {layout} {name} density={density} "
                      f"{rows[-1]['time/step (s)']:.3f} s/step", flush=True)
    print()
    print(markdown_table(rows))
    print(f"\nn={n}, NIC rate {args.rate} per node, intra-node "
          f"{args.intra_rate or 'loopback (unlimited)'}; time: median over {args.repeat} calls (after "
          f"{args.warmup} warm-up) of the slowest rank; MB per node: the busiest node's ranks summed, "
          f"median over calls; eq. columns: Shi et al. eq. (7), (9), (10) with indices as large as values.")
    print("\nWinner (fastest) per layout and density (dense methods compete at every density):\n")
    print(markdown_table(_winners(rows, args.densities)))
    print(f"\n{os.cpu_count()} CPUs, load average (1 min) {os.getloadavg()[0]:.2f} at the end")
    return 0


def _winners(rows: list[dict[str, Any]], densities: list[float]) -> list[dict[str, Any]]:
    out = []
    for layout in dict.fromkeys(row["layout"] for row in rows):
        dense = [row for row in rows if row["layout"] == layout and row["density"] == "-"]
        for density in densities:
            pool = dense + [row for row in rows if row["layout"] == layout and row["density"] == density]
            if not pool:
                continue
            best = min(pool, key=lambda row: row["time/step (s)"])
            runner = sorted(pool, key=lambda row: row["time/step (s)"])[1:2]
            out.append({"layout": layout, "density": density, "fastest": best["method"],
                        "time/step (s)": best["time/step (s)"],
                        "runner-up": runner[0]["method"] if runner else "-",
                        "its time (s)": runner[0]["time/step (s)"] if runner else math.nan})
    return out
