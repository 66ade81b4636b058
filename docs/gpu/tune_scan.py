"""The Triton scan's launch shape, timed on a GPU: each alternative of ``triton_scan.SHAPE`` against
the default, one knob at a time, then the best of each knob together.

Every shape is checked first: its candidates must equal ``torch.nonzero(|x| >= floor)`` and its
count the exact count. Times are medians of synchronized calls of ``scan_ge`` (statistics, prefix
sum, gather and the copy of the figures), in memory passes of the same GPU.

    python3 docs/gpu/tune_scan.py --sizes 25M,64M
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import torch

from sparsecomm.experiments.bench.select import _size_list
from sparsecomm.selection import triton_scan

ALTERNATIVES = {"tiles": [4, 8, 32], "stats_warps": [8], "gather_warps": [2, 8], "skip_empty": [False],
                "pinned": [False]}


def _wall(fn, repeat: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_shape(shape: dict, cases: list, repeat: int) -> list[float]:
    """Passes per case under ``shape`` (after checking its results)."""
    triton_scan.SHAPE.update(shape)
    passes = []
    for x, floor, want, t_pass in cases:
        buffers = triton_scan._Buffers()
        count, _, _, idx, _ = triton_scan.scan_ge(x, floor, buffers)
        assert count == want.numel() and torch.equal(idx, want), (shape, x.numel(), floor)
        passes.append(_wall(functools.partial(triton_scan.scan_ge, x, floor, buffers), repeat) / t_pass)
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25M,64M")
    parser.add_argument("--densities", default="0.001,0.01")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases, labels = [], []
    for n in _size_list(args.sizes):
        x = torch.randn(n, generator=gen, device="cuda")
        t_pass = _wall(functools.partial(torch.empty_like(x).copy_, x), args.repeat) / 2
        for density in (float(d) for d in args.densities.split(",")):
            k = math.ceil(density * n)
            floor = float(torch.topk(x.abs(), k, sorted=False).values.min())
            cases.append((x, floor, torch.nonzero(x.abs() >= floor).squeeze(1), t_pass))
            labels.append(f"n={n} d={density}")
    default = dict(triton_scan.SHAPE)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; scan_ge in memory passes, median of "
          f"{args.repeat}; default shape {default}")
    print("| shape | " + " | ".join(labels) + " | mean |")
    print("| --- |" + " --- |" * (len(labels) + 1))
    base = _time_shape(default, cases, args.repeat)
    print(f"| default | {' | '.join(f'{p:.2f}' for p in base)} | {statistics.mean(base):.2f} |", flush=True)
    best = dict(default)
    best_mean = {key: statistics.mean(base) for key in ALTERNATIVES}
    for key, values in ALTERNATIVES.items():
        for value in values:
            passes = _time_shape({**default, key: value}, cases, args.repeat)
            mean = statistics.mean(passes)
            print(f"| {key}={value} | {' | '.join(f'{p:.2f}' for p in passes)} | {mean:.2f} |", flush=True)
            if mean < best_mean[key] * 0.97:  # a knob moves only for a clear gain
                best[key], best_mean[key] = value, mean
    passes = _time_shape(best, cases, args.repeat)
    print(f"| best of each: {best} | {' | '.join(f'{p:.2f}' for p in passes)} | {statistics.mean(passes):.2f} |")
    triton_scan.SHAPE.update(default)


if __name__ == "__main__":
    main()
