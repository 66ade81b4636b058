"""merge_sum side by side: the binary-heap merge (the C file of commit f17e858, built apart) against
the blocked sweep, alternating calls on the same chunks, in one process.

Build the old kernel first (it is not kept in the repository's build):

    git show f17e858:sparsecomm/transport/_merge.c > /tmp/oldmerge/_merge.c
    gcc -shared -fPIC -O3 -ffp-contract=off -I$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])") \
        /tmp/oldmerge/_merge.c -o /tmp/oldmerge/_merge$(python3-config --extension-suffix)

    PYTHONPATH=. python docs/step-runs/merge-sum/compare.py /tmp/oldmerge

Prints, per number of chunks P (50K sorted random indices each in n = 5M, float32 values: HiTopKComm's
union of P selections at 1% of 5M), the least and median of 31 calls of each, and whether the two
give the same bits.
"""

import glob
import importlib.machinery
import importlib.util
import statistics
import sys
import time

import torch

from sparsecomm.transport import merge

torch.set_num_threads(1)
path = glob.glob(sys.argv[1] + "/_merge*.so")[0]
loader = importlib.machinery.ExtensionFileLoader("_merge", path)
spec = importlib.util.spec_from_loader("_merge", loader)
old = importlib.util.module_from_spec(spec)
loader.exec_module(old)
new = merge._compiled
n, k = 5_000_000, 50_000
g = torch.Generator().manual_seed(0)
import sparsecomm  # noqa: E402

print(f"sparsecomm from {sparsecomm.__file__}")
print(f"torch {torch.__version__}; n = {n}, {k} pairs per chunk; least / median of 31 calls (ms)")
print("| P | heap (f17e858) | blocked sweep | ratio of medians | same bits |")
print("| --- | --- | --- | --- | --- |")
for P in (2, 3, 4, 6, 8):
    idx = [torch.sort(torch.randperm(n, generator=g)[:k].int()).values for _ in range(P)]
    val = [torch.randn(k, generator=g) for _ in range(P)]
    times = {"old": [], "new": []}
    results = {}
    for call in range(32):
        for label, module in (("old", old), ("new", new)) if call % 2 else (("new", new), ("old", old)):
            merge._compiled = module
            start = time.perf_counter()
            results[label] = merge.merge_sum(idx, val)
            if call:
                times[label].append(time.perf_counter() - start)
    merge._compiled = new
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(results["old"], results["new"], strict=True))
    o, w = times["old"], times["new"]
    print(f"| {P} | {min(o) * 1e3:.2f} / {statistics.median(o) * 1e3:.2f} | {min(w) * 1e3:.2f} / "
          f"{statistics.median(w) * 1e3:.2f} | {statistics.median(w) / statistics.median(o):.2f} | {same} |")
