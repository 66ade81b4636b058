"""Where SparDL's call goes at P = 6 on this 2-core machine (emulated 1 Gbit/s, n = 5M, density 1%).

Three measurements, printed as markdown with the date, the load and the tree:

1. Each rank's main-thread CPU time per call, by the method's own phase timers (their clock made the
   thread's CPU clock), and the process's CPU (gloo's threads included), at P = 2, 3, 4, 6: what the
   call costs the cores, whatever waits for what.
2. The machine's idle share (/proc/stat) over 30 back-to-back calls at P = 2, 4, 6: whether the cores
   are saturated (wall = CPU per rank x P / cores) or wait.
3. A probe of the scheduler alone (no torch, no gloo): k pinned processes on each of the two cores,
   each doing w ms of CPU work and then a round trip with its partner on the other core. Wall time
   per phase against k x w: whether rounds that follow work cost a wake-up wait when processes share
   a core.
4. The memory hierarchy: the least time per element of one streaming pass (``c = a + b``, then
   ``|c|``) at n = 0.25M .. 7M, in one process and in two at once: the sizes a calibration sees
   against those it predicts.

Run from the checkout: ``PYTHONPATH=. python docs/simulator/spardl-p6/measure.py``.
"""

import os
import socket
import statistics
import subprocess
import sys
import time
import types

import torch

import sparsecomm
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods.spec import MethodSpec

N, DENSITY, CALLS = 5_000_000, 0.01, 20


def _method(name):
    from sparsecomm.methods import make_method
    return make_method(name, **dict(MethodSpec.at_density(name, DENSITY).options))


def _warmed(name):
    """(gradient, work buffer, output buffer, method) in a worker, after two warm-up calls."""
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(dist.get_rank())
    grad = torch.randn(N, generator=gen)
    work, out = torch.empty_like(grad), torch.empty_like(grad)
    method = _method(name)
    for _ in range(2):
        work.copy_(grad)
        method(work, None, out=out)
    return grad, work, out, method


def _phase_worker(name):
    import torch.distributed as dist

    import sparsecomm.methods.base as base
    torch.set_num_threads(1)
    base.time = types.SimpleNamespace(perf_counter=time.thread_time)  # the phase timers read CPU time
    grad, work, out, method = _warmed(name)
    sums: dict[str, float] = {}
    for _ in range(CALLS):
        work.copy_(grad)
        dist.barrier()
        thread, process = time.thread_time(), time.process_time()
        method(work, None, out=out)
        sums["main thread"] = sums.get("main thread", 0.0) + time.thread_time() - thread
        sums["process"] = sums.get("process", 0.0) + time.process_time() - process
        stats = method.stats
        for key in ("time_select", "time_comm", "time_decompress"):
            sums[key[5:]] = sums.get(key[5:], 0.0) + getattr(stats, key)
        for key, value in stats.extra.items():
            if key.startswith("time_"):
                sums[key[5:]] = sums.get(key[5:], 0.0) + value
    return {key: value / CALLS for key, value in sums.items()}


def _cpu_ticks():
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _idle_worker(name):
    import torch.distributed as dist
    torch.set_num_threads(1)
    grad, work, out, method = _warmed(name)
    dist.barrier()
    before, start = _cpu_ticks(), time.perf_counter()
    for _ in range(30):
        work.copy_(grad)
        method(work, None, out=out)
    dist.barrier()
    after, wall = _cpu_ticks(), time.perf_counter() - start
    return [b - a for a, b in zip(before, after, strict=True)], wall / 30


def _probe_phase(per_core, work_s, phases=200):
    """Wall seconds per phase of the slowest of 2 x per_core pinned processes (see the docstring)."""
    pairs = [socket.socketpair() for _ in range(per_core)]
    read, write = os.pipe()
    pids = []
    for a, b in pairs:
        for core, sock in ((0, a), (1, b)):
            pid = os.fork()
            if pid == 0:
                os.sched_setaffinity(0, {core})
                start = time.perf_counter()
                for _ in range(phases):
                    begun = time.process_time()
                    while time.process_time() - begun < work_s:
                        pass
                    sock.send(b"x" * 8)
                    sock.recv(8)
                os.write(write, f"{time.perf_counter() - start:.6f}\n".encode())
                os._exit(0)
            pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(write)
    times = [float(x) for x in os.read(read, 1 << 16).split()]
    os.close(read)
    for a, b in pairs:
        a.close()
        b.close()
    return max(times) / phases


def main():
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, tree {tree}, sparsecomm from "
          f"{os.path.dirname(sparsecomm.__file__)}, 1-minute load {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} cores. Command: `PYTHONPATH=. python docs/simulator/spardl-p6/measure.py`\n")
    print(f"## 1. CPU per rank and call (ms, mean of the ranks' means over {CALLS} calls), n = {N:,}, 1 Gbit/s\n")
    keys = ["main thread", "process", "select", "comm", "decompress", "agreement", "residual"]
    print("| method | P | " + " | ".join(keys) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in keys) + " |")
    for P in (2, 3, 4, 6):
        for name in ("spardl", "topka"):
            ranks = run_workers(P, _phase_worker, name, net="1gbit", timeout=600)
            row = [f"{1e3 * statistics.mean(r.get(k, 0.0) for r in ranks):.2f}" for k in keys]
            print(f"| {name} | {P} | " + " | ".join(row) + " |")
    print("\n## 2. The cores' idle share over 30 back-to-back calls (wall per call includes the gradient's copy)\n")
    print("| method | P | wall per call (ms) | user | system | idle | softirq |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for P in (2, 4, 6):
        for name in ("spardl", "topka"):
            ticks, wall = run_workers(P, _idle_worker, name, net="1gbit", timeout=600)[0]
            total = sum(ticks)
            share = [f"{100 * ticks[i] / total:.0f}%" for i in (0, 2, 3, 6)]
            print(f"| {name} | {P} | {1e3 * wall:.1f} | " + " | ".join(share) + " |")
    print("\n## 3. The scheduler probe: ms per phase of k pinned processes per core, w ms of CPU then a round trip\n")
    print("| w (ms) | k = 1 | k = 2 | k = 3 | k = 2: beyond 2 w + round trip | k = 3: beyond 3 w + round trip |")
    print("| --- | --- | --- | --- | --- | --- |")
    for work_ms in (1, 2, 4):
        w = work_ms / 1e3
        one, two, three = (_probe_phase(k, w) for k in (1, 2, 3))
        trip = one - w
        print(f"| {work_ms} | {1e3 * one:.2f} | {1e3 * two:.2f} | {1e3 * three:.2f} | "
              f"{1e3 * (two - 2 * w - trip):.2f} | {1e3 * (three - 3 * w - trip):.2f} |")
    memory_table()


def _pass_ns(n, reps=15):
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.add(a, b, out=c)
        c.abs_()
        best = min(best, time.perf_counter() - start)
    return 1e9 * best / n


def _knee(processes, sizes):
    read, write = os.pipe()
    pids = []
    for i in range(processes):
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            row = [_pass_ns(n) for n in sizes]
            if i == 0:
                os.write(write, " ".join(f"{x:.3f}" for x in row).encode())
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(write)
    row = [float(x) for x in os.read(read, 4096).split()]
    os.close(read)
    return row


def memory_table():
    sizes = [250_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 7_000_000]
    print("\n## 4. One streaming pass (c = a + b, |c|), ns per element, least of 15\n")
    print("| processes | " + " | ".join(f"{n / 1e6:g}M" for n in sizes) + " |")
    print("| --- | " + " | ".join("---" for _ in sizes) + " |")
    for processes in (1, 2):
        print(f"| {processes} | " + " | ".join(f"{x:.2f}" for x in _knee(processes, sizes)) + " |")


if __name__ == "__main__":
    sys.exit(main())
