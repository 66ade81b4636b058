"""The decompression sweep (``merge.average_into``) of two builds of ``sparsecomm.transport._merge``, each
in fresh processes with PYTHONHASHSEED 0..7.

The seed changes what the interpreter allocates before the sweep, and with it where ``malloc`` puts the
sweep's scratch block. Built from 29e6e83 the sweep ran at one of two speeds by seed; from 6fca66c
(unchanged in this since) the scratch lies half a page from the output within a page, and every seed
gives the fast one (docs/results.md, "The sweep's two speeds"). The folders hold each build's
``_merge*.so`` (``python setup.py build_ext --inplace`` in each checkout, the file copied out).

    python docs/step-runs/merge-scratch/seeds.py OLD_DIR NEW_DIR

Each process: 25M float32 outputs, one sorted chunk of 1% random entries a call (250,000), the last call's
entries stale, divisor 1 (the sweep of a call at P = 1, 1%); the median of 8 calls after 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

CHILD = r"""
import importlib.util, statistics, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
path = next(Path(sys.argv[1]).glob("_merge*.so"))
spec = importlib.util.spec_from_file_location("sparsecomm.transport._merge", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules["sparsecomm.transport._merge"] = module
from sparsecomm.core.buffers import long_lived_empty
from sparsecomm.transport.merge import average_into
n, k = 25_000_000, 250_000
out = long_lived_empty((n,), dtype=torch.float32, device="cpu")
out.zero_()
chunks = [torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(c))[:k]).values.to(torch.int32)
          for c in range(4)]
values = torch.randn(k, generator=torch.Generator().manual_seed(9))
stale, times = "all", []
for call in range(10):
    start = time.perf_counter()
    stale, _ = average_into(out, [chunks[call % 4]], [values], 1, stale=stale)
    times.append(time.perf_counter() - start)
print(f"{statistics.median(times[2:]) * 1e3:.2f}")
"""


def main() -> int:
    folders = sys.argv[1:]
    if len(folders) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}")
    print("| build | " + " | ".join(f"seed {seed}" for seed in range(8)) + " |")
    print("| --- |" + " --- |" * 8)
    for name, folder in zip(["old", "new"], folders, strict=True):
        cells = []
        for seed in range(8):
            env = {**os.environ, "PYTHONHASHSEED": str(seed)}
            result = subprocess.run([sys.executable, "-c", CHILD, folder], env=env, capture_output=True, text=True,
                                    check=True)
            cells.append(result.stdout.strip() + " ms")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
