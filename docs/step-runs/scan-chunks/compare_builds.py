"""Two builds of the scan kernel (``sparsecomm.selection._scan``) side by side in one process.

Each build's extension file is loaded from its own folder; both scan the same vectors, calls alternating,
and must give the same candidates, count, sum and max. Used for docs/selectors.md and docs/results.md
("Candidates packed per chunk"): the folder ``old`` held the extension built from 29e6e83, ``new`` the one
built from 62823d3 (unchanged since; ``python setup.py build_ext --inplace`` in each checkout, then the
``sparsecomm/selection/_scan*.so`` copied out).

    python docs/step-runs/scan-chunks/compare_builds.py OLD_DIR NEW_DIR [--densities 0.001 0.01 0.03 0.05]

``SPARSECOMM_SCAN=avx2`` picks the AVX2 variant of both. Per density: the candidates the sampled floor
leaves (about 1.5x the selected count), then the medians over 6 calls (after one) of the scan that adds
``grad`` into ``residual`` and writes the sum to a third vector (error feedback's scan: "add") and of a
scan reading that sum alone ("read").
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from sparsecomm.core.buffers import long_lived_empty
from sparsecomm.selection.scan import kernel, sample_floor

N = 25_000_000
CAPACITY = 3_000_000


def load(folder: str):
    """The ``_scan`` extension in ``folder`` as a module of its own (its init function is ``PyInit__scan``)."""
    path = next(Path(folder).glob("_scan*.so"))
    spec = importlib.util.spec_from_file_location(f"{Path(folder).name}._scan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.03, 0.05])
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = {"old": load(args.old), "new": load(args.new)}
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"kernel {kernel()}, n = {N}, torch {torch.__version__}")
    grad = torch.empty(N)
    residual, acc = (long_lived_empty((N,), dtype=torch.float32, device="cpu") for _ in range(2))
    torch.randn(N, generator=torch.Generator().manual_seed(1), out=residual)
    residual.mul_(0.1)
    outputs = {name: (torch.empty(CAPACITY, dtype=torch.int32), torch.empty(CAPACITY)) for name in builds}
    print("| density | candidates | add: old ms | add: new ms | new/old | read: old ms | read: new ms | new/old |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for density in args.densities:
        times: dict[tuple[str, str], list[float]] = {}
        for call in range(args.calls):
            torch.randn(N, generator=torch.Generator().manual_seed(100 + call), out=grad)
            floor = sample_floor(residual, math.ceil(density * N), addend=grad)
            results = {}
            for name in (["old", "new"] if call % 2 else ["new", "old"]):
                idx, val = outputs[name]
                start = time.perf_counter()
                found = builds[name].scan_ge(residual.data_ptr(), N, floor, idx.data_ptr(), val.data_ptr(), CAPACITY,
                                             kernel(), grad.data_ptr(), acc.data_ptr())
                times.setdefault((name, "add"), []).append(time.perf_counter() - start)
                start = time.perf_counter()
                builds[name].scan_ge(acc.data_ptr(), N, floor, idx.data_ptr(), val.data_ptr(), CAPACITY, kernel(), 0, 0)
                times.setdefault((name, "read"), []).append(time.perf_counter() - start)
                results[name] = (found, idx[:found[0]].clone(), val[:found[0]].clone())
            (old, old_idx, old_val), (new, new_idx, new_val) = results["old"], results["new"]
            same = torch.equal(old_idx, new_idx) and torch.equal(old_val, new_val)
            if old[0] != new[0] or old[2] != new[2] or not same:
                print(f"the builds differ at density {density}, call {call}", file=sys.stderr)
                return 1
        ms = {key: statistics.median(values[1:]) * 1e3 for key, values in times.items()}
        print(f"| {density} | {old[0]} | {ms['old', 'add']:.2f} | {ms['new', 'add']:.2f} | "
              f"{ms['new', 'add'] / ms['old', 'add']:.3f} | {ms['old', 'read']:.2f} | {ms['new', 'read']:.2f} | "
              f"{ms['new', 'read'] / ms['old', 'read']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
