"""What posting the agreement's receives before the local work saves, per call, measured side by side.

``Communicator.prepost_agreement`` (called by every method that agrees after its local work, on gloo
and MPI) posts the agreement's receives as the call begins. This script times the same method with and
without it, in interleaved pairs of worker groups (without, with, without, with, ...), so that both
sample the machine over the same minutes: P workers with gloo on loopback, each call timed between a
barrier and its return, a call's time its slowest rank's, each group's figure the median of its
timed calls (fresh gradients, drawn before the clock, as ``compare_per_call.py`` does). "without"
replaces ``prepost_agreement`` by a no-op in the workers; nothing else differs. The outputs are
compared call by call: the same bits either way.

    .venv/bin/python docs/baselines/prepost_ab.py --methods topka spardl -P 4 -n 1M --pairs 6
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch


def worker(name: str, n: int, calls: int, warmup: int, prepost: bool) -> tuple[list[float], list[torch.Tensor]]:
    import torch.distributed as dist

    from sparsecomm import make_method
    from sparsecomm.transport.comm import Communicator

    if not prepost:
        Communicator.prepost_agreement = lambda self: None  # type: ignore[method-assign]
    rank = dist.get_rank()
    method = make_method(name, density=0.01, **({"teams": 1} if name == "spardl" else {}))
    seconds, outputs = [], []
    for call in range(warmup + calls):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(1000 * call + rank))
        dist.barrier()
        start = time.perf_counter()
        out = method(grad)
        if call >= warmup:
            seconds.append(time.perf_counter() - start)
            outputs.append(out)
    return seconds, outputs[-3:]


def main() -> None:
    from sparsecomm import run_workers
    from sparsecomm.experiments.bench.common import parse_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["topka", "spardl"])
    parser.add_argument("-P", type=int, default=4)
    parser.add_argument("-n", default="1M")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--calls", type=int, default=27)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    n = parse_count(args.n)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
          f"{os.getloadavg()[0]:.2f}, torch {torch.__version__}, P = {args.P}, n = {n}, density 0.01, "
          f"{args.pairs} pairs of groups, median of {args.calls} calls each (slowest rank), ms")
    for name in args.methods:
        figures: dict[bool, list[float]] = {False: [], True: []}
        same = True
        for _ in range(args.pairs):
            results = {}
            for prepost in (False, True):
                per_rank = run_workers(args.P, worker, name, n, args.calls, args.warmup, prepost, timeout=600)
                per_call = [max(r[0][c] for r in per_rank) for c in range(args.calls)]
                figures[prepost].append(1e3 * statistics.median(per_call))
                results[prepost] = [r[1] for r in per_rank]
            same &= all(torch.equal(a, b) for ra, rb in zip(results[False], results[True], strict=True)
                        for a, b in zip(ra, rb, strict=True))
        without, with_ = statistics.median(figures[False]), statistics.median(figures[True])
        print(f"{name}: without {' '.join(f'{x:.1f}' for x in figures[False])} (median {without:.1f}); "
              f"with {' '.join(f'{x:.1f}' for x in figures[True])} (median {with_:.1f}); "
              f"with / without {with_ / without:.2f}; same bits: {same}")


if __name__ == "__main__":
    main()
