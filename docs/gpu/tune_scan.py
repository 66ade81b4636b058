"""The Triton scan's launch shape, timed on a GPU: alternatives of ``triton_scan.SHAPE`` against
the default, one knob at a time and a few combinations.

Every shape is checked first: its candidates must equal ``torch.nonzero(|x| >= floor)`` and its
count the exact count. Times are medians of synchronized calls of ``scan_ge`` (statistics, prefix
sum, gather and the copy of the figures), in memory passes of the same GPU; the shapes are timed in
turn, in several rounds, and each keeps its least median (the calls are bounded by the host, whose
jitter moves a median by more than most knobs do).

    python3 docs/gpu/tune_scan.py --sizes 25M,64M
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch

from sparsecomm.experiments.bench.select import _device_median_seconds, _size_list
from sparsecomm.selection import triton_scan

ALTERNATIVES = {"tiles": [8, 32], "gather_tile": [256, 512], "stats_warps": [8], "gather_warps": [2, 8],
                "pinned": [False]}
COMBINATIONS = [{"gather_tile": 256, "gather_warps": 1}, {"gather_tile": 256, "gather_warps": 2},
                {"gather_tile": 512, "gather_warps": 2}]


def _time_shape(shape: dict, cases: list, repeat: int) -> list[float]:
    """Passes per case under ``shape`` (after checking its results)."""
    triton_scan.SHAPE.update(shape)
    passes = []
    for x, floor, want, t_pass in cases:
        buffers = triton_scan._Buffers()
        count, _, _, idx, _ = triton_scan.scan_ge(x, floor, buffers)
        assert count == want.numel() and torch.equal(idx, want), (shape, x.numel(), floor)
        call = functools.partial(triton_scan.scan_ge, x, floor, buffers)
        passes.append(_device_median_seconds(call, repeat, x.device) / t_pass)
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25M,64M")
    parser.add_argument("--densities", default="0.001,0.01")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases, labels = [], []
    for n in _size_list(args.sizes):
        x = torch.randn(n, generator=gen, device="cuda")
        t_pass = _device_median_seconds(functools.partial(torch.empty_like(x).copy_, x), args.repeat, x.device) / 2
        for density in (float(d) for d in args.densities.split(",")):
            k = math.ceil(density * n)
            floor = float(torch.topk(x.abs(), k, sorted=False).values.min())
            cases.append((x, floor, torch.nonzero(x.abs() >= floor).squeeze(1), t_pass))
            labels.append(f"n={n} d={density}")
    default = dict(triton_scan.SHAPE)
    shapes = {"default": default}
    for key, values in ALTERNATIVES.items():
        shapes.update({f"{key}={value}": {**default, key: value} for value in values})
    shapes.update({", ".join(f"{k}={v}" for k, v in change.items()): {**default, **change} for change in COMBINATIONS})
    best: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for label, shape in shapes.items():
            passes = _time_shape(shape, cases, args.repeat)
            best[label] = passes if label not in best else [min(a, b) for a, b in zip(best[label], passes, strict=True)]
    triton_scan.SHAPE.update(default)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; scan_ge in memory passes, least median of "
          f"{args.repeat} over {args.rounds} rounds; default shape {default}")
    print("| shape | " + " | ".join(labels) + " | mean |")
    print("| --- |" + " --- |" * (len(labels) + 1))
    for label, passes in best.items():
        print(f"| {label} | {' | '.join(f'{p:.2f}' for p in passes)} | {statistics.mean(passes):.2f} |")


if __name__ == "__main__":
    main()
