"""``sparsecomm bench step``: a method's work outside communication, in passes over the gradient.

For every sparse method, every density and every worker count P, each rank calls the method
``--repeat`` times (after ``--warmup`` calls; Ok-Topk without its 512 dense warm-up calls, so that its
sparse step is what is timed) on a fresh normal gradient of ``n`` elements (the same sequence of
gradients for every method: rank r's call t draws from a generator seeded with (r, t)), and
right before every call times one *pass* over the gradient, in wall time and in CPU time of the
calling thread: the fused scan
(:meth:`sparsecomm.selection.scan.Scratch.scan`: one read of ``x`` giving sum and max of
``|x|``, the C kernel where built), or ``torch.abs`` into a reused buffer and a sum where it is not.
Every phase of the call (``stats.time_select``, ``time_residual`` from ``stats.extra``,
``time_decompress``, ``time_comm`` and the rest) is divided by the median pass of the same run, so
the figures are ratios measured side by side on the same loaded machine.

A method's *non-communication* time is its whole call minus ``time_comm``: residual update,
selection, decompression and bookkeeping. Error feedback alone has a floor, timed beside each call
and reported as "EF floor": ``acc = residual + gradient`` written to a spare buffer by the same scan
(:meth:`~sparsecomm.selection.scan.Scratch.scan` with ``addend`` and ``dest``; ``torch.add`` where the
kernel is not built) reads two vectors and writes one, what every method with a residual must do;
the column gives what that costs on this machine. The output is written only where it is non-zero.
The floor's residual and spare buffer and the calls' ``out=`` tensor are allocated as the library's
own long-lived buffers are (:mod:`sparsecomm.core.buffers`: huge pages where the kernel offers them),
the gradient as the caller's is.
Figures are rank 0's medians; at P > 1 several processes share the CPU cores, so each pass and each
phase is slower than at P = 1 and the ratio is what compares.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from sparsecomm.cli.table import markdown_table
from sparsecomm.core.buffers import long_lived_empty
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import dense_warmup, sparse_methods
from sparsecomm.selection import scan
from sparsecomm_lab.bench.common import parse_count

HELP = "per-step work of every sparse method outside communication, in passes over the gradient"

#: rank r's call t gets the normal gradient of the generator seeded with ``_GRADIENT_SEED * (r + 1) + t``
_GRADIENT_SEED = 1_000_003

#: the phases reported, with the stats field (or ``extra`` key) each comes from
PHASES = (("select", "time_select"), ("residual", "time_residual"), ("decompress", "time_decompress"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="25M", help="gradient elements (default 25M)")
    parser.add_argument("--P", type=int, nargs="+", default=[1, 8], help="worker counts (default 1 8)")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001],
                        help="densities (default 0.01 0.001)")
    parser.add_argument("--methods", nargs="+", default=None, help="methods (default: every sparse method)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per method (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker group")


def one_pass(x: torch.Tensor, scratch: scan.Scratch) -> tuple[float, float]:
    """(wall, CPU) seconds of one pass over ``x``: the fused scan (sum and max of ``|x|``, no candidates)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    scratch.scan(x, math.inf, name="pass", check_finite=False)
    return time.perf_counter() - wall, time.thread_time() - cpu


def accumulate_floor(residual: torch.Tensor, grad: torch.Tensor, spare: torch.Tensor, scratch: scan.Scratch) -> float:
    """Wall seconds of error feedback's own work: ``spare = residual + grad`` in one scan that also
    checks finiteness, as :meth:`~sparsecomm.methods.base.Method.accumulate_to_spare` does."""
    wall = time.perf_counter()
    scratch.scan(residual, math.inf, name="floor", check_finite=True, addend=grad, dest=spare)
    return time.perf_counter() - wall


def _worker(n: int, densities: list[float], methods: list[str], repeat: int, warmup: int) -> dict[str, Any]:
    """On each rank: per (method, density), the per-call phase times and the passes timed beside them."""
    import torch.distributed as dist

    from sparsecomm.methods import make_method

    rank = dist.get_rank()
    base = torch.randn(n, generator=torch.Generator().manual_seed(17 + rank))
    grad = torch.empty_like(base)
    # result: out=, as the hook does (a group's output buffer, kept across calls: core.buffers)
    result = long_lived_empty(base.shape, dtype=base.dtype, device=base.device)
    # for the floor of error feedback: buffers like the methods' own (core.buffers)
    residual, spare = (long_lived_empty(base.shape, dtype=base.dtype, device=base.device) for _ in range(2))
    torch.mul(base, 0.1, out=residual)
    del base
    scratch = scan.Scratch()
    results: dict[str, Any] = {}
    for density in densities:
        for name in methods:
            # a method's own sparse step, not the dense all-reduces it starts with by default (Ok-Topk's 512)
            options: dict[str, Any] = {"density": density}
            if dense_warmup(name):
                options["warmup_steps"] = 0
            method = make_method(name, **options)
            rows = []
            for call in range(warmup + repeat):
                # a fresh gradient at every call, as in training: with one gradient repeated, the
                # entries error feedback never sends grow by it at every call, and a threshold reused
                # from an earlier call (Ok-Topk, RedSync, the controllers) then selects many times k
                torch.randn(n, generator=torch.Generator().manual_seed(_GRADIENT_SEED * (rank + 1) + call), out=grad)
                dist.barrier()
                seconds, cpu_pass = one_pass(grad, scratch)
                floor = accumulate_floor(residual, grad, spare, scratch)
                dist.barrier()
                cpu = time.thread_time()
                method(grad, out=result)
                cpu = time.thread_time() - cpu
                dist.barrier()  # no rank draws its next gradient while another one's call still runs
                if call >= warmup:
                    stats = method.stats
                    rows.append({"pass": seconds, "floor": floor, "cpu_pass": cpu_pass, "cpu": cpu,
                                 "select": stats.time_select,
                                 "residual": stats.extra.get("time_residual", 0.0),
                                 "decompress": stats.time_decompress, "comm": stats.time_comm,
                                 "total": stats.time_total, "capped": stats.capped})
            results[f"{name}@{density}"] = rows
            del method
    return results


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians over calls, in passes: by wall time, and by this thread's CPU time.

    Wall: each phase's wall time over the wall time of the pass timed just before the call. CPU: the
    call's CPU time on the calling thread over the pass's; a phase's CPU share is taken as its share of
    the call's wall time (the method runs on this one thread, torch uses one thread per worker), and
    the non-communication CPU figure is the call's CPU times the non-communication share of its wall
    time. On a loaded machine the CPU figures are the steadier: waiting for a core is not counted.
    """
    unit = statistics.median(r["pass"] for r in rows)
    out = {"pass_ms": unit * 1e3, "cpu_pass_ms": statistics.median(r["cpu_pass"] for r in rows) * 1e3}
    for key in ("select", "residual", "decompress", "comm", "total"):
        out[key] = statistics.median(r[key] for r in rows) / unit
    out["non_comm"] = statistics.median(r["total"] - r["comm"] for r in rows) / unit
    out["other"] = max(0.0, out["non_comm"] - out["select"] - out["residual"] - out["decompress"])
    out["floor"] = statistics.median(r["floor"] for r in rows) / unit

    def cpu_passes(share) -> float:
        return statistics.median(r["cpu"] / r["cpu_pass"] * share(r) for r in rows)

    for key in ("select", "residual", "decompress"):
        out[f"cpu_{key}"] = cpu_passes(lambda r, key=key: r[key] / r["total"])
    out["cpu_non_comm"] = cpu_passes(lambda r: (r["total"] - r["comm"]) / r["total"])
    out["cpu_total"] = cpu_passes(lambda r: 1.0)
    return out


def run(args: argparse.Namespace) -> int:
    n = parse_count(args.n)
    sparse = sparse_methods()
    methods = args.methods or sparse
    unknown = sorted(set(methods) - set(sparse))
    if unknown:
        raise SystemExit(f"not sparse methods: {unknown}; sparse methods: {', '.join(sparse)}")
    print(f"n = {n}, scan: {scan.kernel()}, torch {torch.__version__}, torch threads 1 per worker; "
          f"figures are multiples of one pass over the gradient (the fused scan), medians of rank 0's "
          f"{args.repeat} calls")
    rows = []
    for P in args.P:
        per_rank = run_workers(P, _worker, n, args.densities, methods, args.repeat, args.warmup,
                               timeout=args.timeout)
        for density in args.densities:
            for name in methods:
                s = summarize(per_rank[0][f"{name}@{density}"])
                rows.append({"method": name, "P": P, "density": density,
                             "select": round(s["cpu_select"], 1), "residual": round(s["cpu_residual"], 1),
                             "decompress": round(s["cpu_decompress"], 1),
                             "non-comm": round(s["cpu_non_comm"], 1), "whole call": round(s["cpu_total"], 1),
                             "EF floor": round(s["floor"], 1),
                             "pass CPU ms": round(s["cpu_pass_ms"], 1),
                             "wall: non-comm": round(s["non_comm"], 1), "wall: whole": round(s["total"], 1),
                             "pass wall ms": round(s["pass_ms"], 1)})
    print(markdown_table(rows))
    print("\nselect, residual, decompress, non-comm, whole call: CPU time of the calling thread in passes "
          "(phases split by their share of the call's wall time); wall: wall time over the pass's wall time; EF floor: "
          "error feedback alone (residual + gradient into a spare buffer, in the methods' scan: two vectors read, "
          "one written), wall time over the pass's")
    over = sorted({r["method"] for r in rows if r["P"] == 1 and r["non-comm"] > 4})
    if over:
        print(f"\nabove 4 passes outside communication at P = 1: {', '.join(over)}")
    floors = [r["EF floor"] for r in rows if r["P"] == 1]
    if floors:
        print(f"error feedback alone at P = 1 (EF floor): {min(floors)}-{max(floors)} passes")
    return 0
