"""Where a selector's time goes on a GPU: device kernels against host gaps.

For each selector, size and density: the median wall time of a synchronized call (as
``sparsecomm bench select --device cuda`` times it), then a torch.profiler trace of a few calls,
summarized per call: time the GPU was busy in kernels and copies, the number of kernel launches, of
device-to-host copies (each one a synchronization) and the busiest host operations. A call whose
wall time far exceeds its busy time is limited by the host (launches, synchronizations, Python), not
by the GPU's memory.

    python3 docs/gpu/profile_selectors.py --sizes 25M,64M --densities 0.001,0.01
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
from torch.profiler import ProfilerActivity, profile

from sparsecomm import selectors
from sparsecomm.experiments.bench.select import _device_median_seconds, _make, _size_list


def _profile(fn, calls: int) -> str:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    busy = sum(e.device_time for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / calls
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / calls
    syncs = sum(1 for e in events if e.name in ("cudaMemcpyAsync", "cudaStreamSynchronize",
                                                  "cudaDeviceSynchronize", "cudaMemcpy")) / calls
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:8]
    ops = ", ".join(f"{a.key} {a.self_cpu_time_total / calls:.0f}us x{a.count / calls:g}" for a in top)
    gpu_top = sorted((a for a in prof.key_averages() if a.device_time_total > 0),
                     key=lambda a: a.device_time_total, reverse=True)[:5]
    kern = ", ".join(f"{a.key[:40]} {a.device_time_total / calls:.0f}us x{a.count / calls:g}" for a in gpu_top)
    return f"busy {busy:.0f} us, {kernels:g} device events, {syncs:g} memcpy/sync calls | host: {ops} | gpu: {kern}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25M,64M")
    parser.add_argument("--densities", default="0.001,0.01")
    parser.add_argument("--selectors", default=",".join(selectors.available()))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for n in _size_list(args.sizes):
        x = torch.randn(n, generator=gen, device="cuda")
        t_pass = _device_median_seconds(functools.partial(torch.empty_like(x).copy_, x), args.repeat, x.device) / 2
        for density in (float(d) for d in args.densities.split(",")):
            k = math.ceil(density * n)
            a = x.abs()
            t_topk = _device_median_seconds(functools.partial(torch.topk, a, k, sorted=False), args.repeat, x.device)
            print(f"\n## n={n} density={density} pass {1e6 * t_pass:.1f} us, torch.topk {1e6 * t_topk:.0f} us")
            for selector in args.selectors.split(","):
                call = functools.partial(_make(selector, x, k), x, k)
                t = _device_median_seconds(call, args.repeat, x.device)
                print(f"{selector}: wall {1e6 * t:.0f} us = {t / t_pass:.2f} passes; {_profile(call, args.calls)}",
                      flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
