"""Per-call time of every sparse method with its long-lived buffers on 4 KiB pages and on huge pages.

One worker (P = 1, torch threads 1) holds two instances of each method: one whose buffers (residual,
spare residual, and the ``out=`` tensor a hook group would pass) were allocated with the advice of
:mod:`sparsecomm.core.buffers` switched off, and one with it. Both are called on the same fresh
normal gradient of n elements at every call, in alternating order, after three untimed calls each;
the table gives the median wall time of each over ``--calls`` calls and their ratio. The two
instances share the process, its gradient and the machine's state, so the ratio compares the pages
alone. Usage, from the repository root:

    .venv/bin/python docs/step-runs/huge-pages/compare.py [--n 25M] [--density 0.01] [--calls 16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time


def _worker(n: int, density: float, calls: int, methods: list[str]) -> list[dict]:
    import torch

    import sparsecomm.core.buffers as buffers
    from sparsecomm import make_method
    from sparsecomm.methods import dense_warmup

    advise = buffers._advise_huge_pages
    grad = torch.empty(n)
    rows = []
    for name in methods:
        options = {"density": density, **({"warmup_steps": 0} if dense_warmup(name) else {})}
        instances = {}
        for pages in ("4 KiB", "huge"):
            buffers._advise_huge_pages = advise if pages == "huge" else (lambda t: None)
            method = make_method(name, **options)
            out = buffers.long_lived_empty(n, dtype=torch.float32, device="cpu")
            for call in range(3):
                torch.randn(n, generator=torch.Generator().manual_seed(call), out=grad)
                method(grad, out=out)
            instances[pages] = (method, out, [])
        buffers._advise_huge_pages = advise
        for call in range(calls):
            torch.randn(n, generator=torch.Generator().manual_seed(100 + call), out=grad)
            order = ("4 KiB", "huge") if call % 2 else ("huge", "4 KiB")
            for pages in order:
                method, out, times = instances[pages]
                start = time.perf_counter()
                method(grad, out=out)
                times.append(time.perf_counter() - start)
        small, huge = (statistics.median(instances[p][2]) for p in ("4 KiB", "huge"))
        rows.append({"method": name, "small": small, "huge": huge})
        del instances
    return rows


def main() -> None:
    from sparsecomm import available_methods, run_workers
    from sparsecomm.cli.options import parse_count
    from sparsecomm.methods import is_sparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="25M")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--calls", type=int, default=16)
    args = parser.parse_args()
    n = parse_count(args.n)
    methods = [m for m in available_methods() if is_sparse(m)]
    load = os.getloadavg()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows, = run_workers(1, _worker, n, args.density, args.calls, methods, timeout=3600)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
        thp = setting.read().strip()
    print(f"{when}; load average before the run {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; n = {n}, density "
          f"{args.density}, P = 1, medians of {args.calls} calls; transparent huge pages: {thp}")
    print("$ .venv/bin/python docs/step-runs/huge-pages/compare.py " +
          f"--n {args.n} --density {args.density} --calls {args.calls}\n")
    print("| method | 4 KiB pages (ms) | huge pages (ms) | huge / 4 KiB |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {1e3 * r['small']:.2f} | {1e3 * r['huge']:.2f} | {r['huge'] / r['small']:.3f} |")
    ratios = sorted(r["huge"] / r["small"] for r in rows)
    print(f"\nmedian ratio {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
