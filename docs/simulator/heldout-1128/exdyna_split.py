"""ExDyna and TopkA per rank, at the calibration's point and at two held-out ones (1 Gbit/s, 1%): each
rank's least work over calls (wall less ``time_comm``, the calibration's estimator) and its median
call, communication, decompression and selection, and the bytes it sent; calls as the calibration
makes them (:func:`sparsecomm.simulator.calibration.method_runs`: a fixed gradient, one warm-up call).

    python docs/simulator/heldout-1128/exdyna_split.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

from sparsecomm.launch.launcher import run_workers
from sparsecomm.simulator.calibration import method_runs


def _worker(methods: list[str], n: int, repeat: int) -> list:
    import torch
    torch.set_num_threads(1)
    return method_runs(methods, [n], 0.01, repeat)


def _ms(values) -> str:
    return ", ".join(f"{v * 1e3:.2f}" for v in values)


def main() -> None:
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"load {os.getloadavg()[0]:.2f} at {time.strftime('%H:%M', time.gmtime())} UTC, tree {tree}, 1gbit\n")
    print("| P | n | method | least work per rank (ms) | median call | median comm | median decompress "
          "| median select | bytes sent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for P, n, repeat in [(2, 1_000_000, 10), (3, 5_000_000, 5), (6, 5_000_000, 5)]:
        records = run_workers(P, _worker, ["exdyna", "topka"], n, repeat, net="1gbit", timeout=600)
        for i, run in enumerate(records[0]):
            ranks = [r[i] for r in records]
            work = [min(t - c for t, c in zip(r["times"], r["time_comm"], strict=True)) for r in ranks]
            print(f"| {P} | {n} | {run['method']} | {_ms(work)} | {_ms(statistics.median(r['times']) for r in ranks)} "
                  f"| {_ms(statistics.median(r['time_comm']) for r in ranks)} "
                  f"| {_ms(statistics.median(r['time_decompress']) for r in ranks)} "
                  f"| {_ms(statistics.median(r['time_select']) for r in ranks)} "
                  f"| {', '.join(str(r['bytes_sent']) for r in ranks)} |")


if __name__ == "__main__":
    main()
