"""SIDCo's second exponential stage, two ways side by side in one process, on the view one scan builds.

The view is :func:`sparsecomm.methods.sidco.sidco_view`'s at n = 25M, 1% (two stages: the first keeps
10%, so its candidates are about a tenth of the gradient). Its second stage needs the mean excess of the
magnitudes above the first threshold:

* copy: the exceedances gathered from the candidates, widened to float64, less the threshold, their mean
  (the code before 67490cc);
* count and sum: ``MagnitudeView.count_and_sum_ge``, one read of the candidates (the C ``sum_ge``).

Alternating, medians of 9 calls; the two thresholds are printed with their relative difference.

    python docs/step-runs/avx2-sketch/sidco_stage.py
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import time

import torch

from sparsecomm.methods.sidco import sidco_view
from sparsecomm.selection.scan import Scratch, above_float32


def main() -> None:
    torch.set_num_threads(1)
    n, density = 25_000_000, 0.01
    gen = torch.Generator().manual_seed(0)
    residual, grad, acc = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen), torch.empty(n)
    p = math.sqrt(density)
    _, view = sidco_view(residual, density, "exponential", 2, Scratch(), check_finite=True, addend=grad, dest=acc)
    first = view.mean * math.log(1 / p)
    above = above_float32(first)

    def copy() -> float:
        samples = view.values_ge(above, view.n_candidates).double() - first
        return first + float(samples.mean()) * math.log(1 / p)

    def count_and_sum() -> float:
        number, total = view.count_and_sum_ge(above)
        return first + (total / number - first) * math.log(1 / p)

    times: dict[str, list[float]] = {"copy": [], "count and sum": []}
    found = {}
    for _ in range(9):
        for name, step in (("copy", copy), ("count and sum", count_and_sum)):
            start = time.perf_counter()
            found[name] = step()
            times[name].append(time.perf_counter() - start)
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"load {os.getloadavg()[0]:.2f} at {time.strftime('%H:%M', time.gmtime())} UTC, tree {tree}")
    print(f"n = {n}, density {density}: {view.n_candidates} candidates, first threshold {first:.6f}\n")
    print("| second stage | ms (median of 9) | threshold |")
    print("| --- | --- | --- |")
    for name, seconds in times.items():
        print(f"| {name} | {statistics.median(seconds) * 1e3:.2f} | {found[name]!r} |")
    print(f"\nrelative difference of the thresholds: {abs(found['copy'] - found['count and sum']) / found['copy']:.1e}")


if __name__ == "__main__":
    main()
