"""The count-sketch kernels' variants side by side in one process (S2 Reducer's insert and query).

The sketch S2 Reducer builds at n = 25M and 1% (k = 250,000; three rows of ceil(0.5 k / 3) columns),
its insert of k selected elements and its query of the union's blocks of 32 elements (4% and 8% of n:
the union at P = 4 and 8 when the ranks' blocks hardly overlap), each variant of
``sparsecomm.transport.merge.sketch_variants()`` in turn on the same inputs, alternating, medians of
7 calls; the outputs are checked bit for bit against the first variant's.

    python docs/step-runs/avx2-sketch/variants.py
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import time

import torch

from sparsecomm.methods.s2reducer import sketch_shape
from sparsecomm.selection.sketch import CountSketch
from sparsecomm.transport import merge


def main() -> None:
    torch.set_num_threads(1)
    n, density, block = 25_000_000, 0.01, 32
    k = math.ceil(density * n)
    rows, cols = sketch_shape(k, 0.5, 3)
    sketch = CountSketch(n, rows, cols, seed=7)
    keys = sketch._keys()
    gen = torch.Generator().manual_seed(0)
    indices = torch.sort(torch.randperm(n, generator=gen)[:k]).values
    values = torch.randn(k, generator=gen)
    table = torch.randn(rows, cols, generator=gen)
    variants = merge.sketch_variants()
    print(f"load {os.getloadavg()[0]:.2f} at {time.strftime('%H:%M', time.gmtime())} UTC, tree "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
    print(f"n = {n}, k = {k}, sketch {rows} x {cols} ({rows * cols * 4 / 1e3:.0f} KB), variants {variants}\n")
    print("| work | elements | " + " | ".join(f"{v} ms" for v in variants) + " | "
          + " | ".join(f"{v}/{variants[-1]}" for v in variants[:-1]) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in variants) + " | "
          + " | ".join("---" for _ in variants[:-1]) + " |")

    def insert(variant: str) -> torch.Tensor:
        out = sketch.empty_table(torch.float32)
        merge.sketch_insert(keys, out, indices, values, variant=variant)
        return out

    cases = [("insert", k, insert)]
    for share in (0.04, 0.08):
        blocks = torch.sort(torch.randperm(math.ceil(n / block), generator=gen)[:int(share * n / block)]).values
        cases.append((f"query ({share:.0%} of n)", blocks.numel() * block,
                      lambda variant, b=blocks: merge.sketch_query_blocks(keys, table, b, block, n, variant=variant)))
    for work, elements, run in cases:
        times: dict[str, list[float]] = {v: [] for v in variants}
        reference = run(variants[0])
        for _ in range(7):
            for variant in variants:
                start = time.perf_counter()
                result = run(variant)
                times[variant].append(time.perf_counter() - start)
                assert torch.equal(result.view(torch.int32), reference.view(torch.int32)), variant
        medians = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        print(f"| {work} | {elements} | " + " | ".join(f"{medians[v]:.2f}" for v in variants) + " | "
              + " | ".join(f"{medians[v] / medians[variants[-1]]:.3f}" for v in variants[:-1]) + " |")


if __name__ == "__main__":
    main()
