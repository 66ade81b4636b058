"""``sparsecomm bench sparse_allreduce``: time, bytes and rounds of the sparse all-reduce methods of
SparDL's comparison ([SparDL], section V-B, Fig. 8 and Table I): spardl, topka, topkdsa, gtopk, oktopk
and the dense all-reduce, per worker count P and density, on an emulated link.

Per (P, density, method): the slowest rank's median seconds per call, its select / communicate /
decompress split (rank 0), bytes sent per call (rank 0 and the largest rank, from the meter; ``dense``
is torch's native all-reduce, whose bytes are the ring formula's), rounds per rank, and SparDL's
communication ratio: (MB sent, largest rank, of the method) / (that of spardl). Methods run one after
another in this process tree, one worker group each, interleaved over ``--rounds`` rounds, and the
medians taken over all rounds.

Every call gets a fresh gradient (i.i.d. normal, seeded by rank and call, drawn before the clock
starts), so the error-feedback residuals evolve as in training rather than doubling a fixed vector.
Ok-Topk runs without its dense warm-up (``warmup_steps=0``) and after ``--warmup`` untimed calls, so
the timed calls reuse its thresholds and regions, as in 31 of every 32 of its calls.
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
from sparsecomm.launch.netemu import unavailable_reason
from sparsecomm_lab.bench.common import network_label, parse_count, parse_networks

HELP = "SparDL Fig. 8: spardl, topka, topkdsa, gtopk, oktopk, dense at P = 4, 6, 8 (time, bytes, rounds)"

METHODS = ("spardl", "topka", "topkdsa", "topkdsa/split", "gtopk", "oktopk", "dense")
#: a row label -> (registered method, options besides density); "topkdsa/split" is SparCML's split
#: all-gather, the variant whose cost SparDL's Table I lists for TopkDSA ((P + 2 log P) alpha)
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "oktopk": ("oktopk", {"warmup_steps": 0}),
    "topkdsa/split": ("topkdsa", {"algorithm": "split_allgather"}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", default="4,6,8", help="comma-separated worker counts (default 4,6,8)")
    parser.add_argument("--size", "-n", default="25M", help="gradient elements (default 25M, SparDL's Fig. 8)")
    parser.add_argument("--densities", default="0.01,0.001", help="comma-separated densities (default 0.01,0.001)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    parser.add_argument("--net", default="1gbit", help="loopback or a tc rate, e.g. 1gbit (default)")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls per worker group (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the methods (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker group")


def fresh_gradient_worker(name: str, options: dict[str, Any], n: int, repeat: int, warmup: int) -> dict[str, Any]:
    """Worker: ``warmup + repeat`` calls, each on a new gradient drawn before a barrier and the clock."""
    import torch.distributed as dist

    from sparsecomm.methods import make_method

    rank = dist.get_rank()
    method = make_method(name, **options)
    grad, result = torch.empty(n), torch.empty(n)
    times, stats = [], []
    for i in range(warmup + repeat):
        grad.normal_(generator=torch.Generator().manual_seed(rank * 1_000_003 + i))
        dist.barrier()
        start = time.perf_counter()
        method(grad, out=result)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            stats.append(method.stats)
    return {"times": times, "stats": stats}


def _measure(P: int, n: int, name: str, density: float, args: argparse.Namespace, net: str | None) -> dict[str, Any]:
    method, extra = _VARIANTS.get(name, (name, {}))
    options = {} if method == "dense" else {"density": density, **extra}
    per_rank = run_workers(P, fresh_gradient_worker, method, options, n, args.repeat, args.warmup,
                           net=net, timeout=args.timeout)
    calls = len(per_rank[0]["times"])
    stats0 = per_rank[0]["stats"]
    return {
        "times": [max(r["times"][i] for r in per_rank) for i in range(calls)],
        "select": [s.time_select for s in stats0], "comm": [s.time_comm for s in stats0],
        "decompress": [s.time_decompress for s in stats0],
        "sent0": [s.bytes_sent for s in stats0],
        "sent_max": [max(r["stats"][i].bytes_sent for r in per_rank) for i in range(calls)],
        "rounds": [max(r["stats"][i].rounds for r in per_rank) for i in range(calls)],
    }


def run(args: argparse.Namespace) -> int:
    workers = [int(p) for p in args.workers.split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    n = parse_count(args.size)
    if any(p < 1 for p in workers) or n < 1 or args.repeat < 1 or args.rounds < 1:
        raise SystemExit("--workers, --size, --repeat and --rounds must be positive")
    if any(not 0 < d <= 1 for d in densities):
        raise SystemExit(f"--densities={args.densities}: each must be in (0, 1]")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: {unknown} not among {METHODS}")
    net = parse_networks(args.net)[0]
    if net is not None and unavailable_reason() is not None:
        print(f"Network emulation is unavailable here ({unavailable_reason()}); loopback only.\n")
        net = None
    rows = []
    for P in workers:
        for density in densities:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for _ in range(args.rounds):
                for name in methods:
                    runs[name].append(_measure(P, n, name, density, args, net))
            merged = {m: {key: [v for r in runs[m] for v in r[key]] for key in runs[m][0]} for m in methods}
            base = statistics.median(merged["spardl"]["sent_max"]) if "spardl" in merged else None
            base_t = statistics.median(merged["spardl"]["times"]) if "spardl" in merged else None
            for name in methods:
                m = merged[name]
                sent_max = statistics.median(m["sent_max"])
                t = statistics.median(m["times"])
                rows.append({
                    "P": P, "density": density, "k": math.ceil(density * n), "method": name,
                    "time/call (s)": t,
                    "select (s)": statistics.median(m["select"]), "comm (s)": statistics.median(m["comm"]),
                    "decompress (s)": statistics.median(m["decompress"]),
                    "MB sent rank 0": statistics.median(m["sent0"]) / 1e6, "MB sent max rank": sent_max / 1e6,
                    "rounds": max(m["rounds"]),
                    "bytes / spardl's": "-" if not base else sent_max / base,
                    "time / spardl's": "-" if not base_t else t / base_t,
                })
    print(markdown_table(rows))
    print(f"\nn={n}, network {network_label(net)}; time: median over {args.rounds} round(s) x {args.repeat} "
          f"timed calls (after {args.warmup} untimed) of the slowest rank; 'MB sent max rank': the largest rank's "
          f"metered payload per call (dense: the ring formula's, gloo's own traffic is not metered); rounds: the "
          f"most of any rank")
    return 0
