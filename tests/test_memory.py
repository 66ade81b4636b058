"""Memory of every method (issue 16, item 6), in gradient-sized buffers (4n bytes for float32):

* kept between calls, for a method with a residual: at most 2 (the residual and, for a method that
  accumulates before its call's checks on CPU, ``Method.accumulates``, its spare residual);
* at peak during a call, counting the caller's gradient and the returned output: at most 4, and 5
  for a method that keeps the spare residual.

Measured as resident memory in forked workers (``run_workers``) of a fresh interpreter per method,
after a warm-up of the method on a small gradient (libraries, communication buffers), independent of
how torch allocates: the peak is Linux's ``VmHWM``, reset before the measured calls by writing 5 to
``/proc/self/clear_refs``; glibc's ``mmap`` threshold is pinned at 128 KiB (``mallopt``) so that a
freed buffer goes back to the kernel at once instead of counting as kept, and the heap is trimmed
(``malloc_trim``) before each reading. The fresh interpreter (``python tests/test_memory.py --row``)
matters: workers forked from a long pytest run inherit its heap, whose large free chunks glibc hands
out before it maps anything, so a call's freed temporaries stayed resident and were read at peak
(topka and spardl at n = 1M read 5.4-5.75 gradients, 7.3 once, in full `make test` runs here and
in CI, against 4.3-4.5). Transparent huge pages are turned off for the workers
(``PR_SET_THP_DISABLE``), so that where the kernel's setting is ``always`` a buffer the method
touches only in part (the agreement's 4 MiB receive buffers) is not read in 2 MiB pages (spardl's
peak read 4.9 with ``always``). ``python tests/test_memory.py`` prints the table of benchmarks/memory.
"""

import ctypes
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from sparsecomm import available_methods, make_method, run_workers
from sparsecomm.methods import dense_warmup, method_class

N = 5_000_000
DENSITY = 0.01
_M_MMAP_THRESHOLD = -3
_PR_SET_THP_DISABLE = 41


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def measure(name, n, calls=3):
    """Worker: (kept between calls, peak during calls), in units of one gradient (n elements)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    options = {"density": DENSITY} if method_class(name).sparse else {}
    if dense_warmup(name):  # Ok-Topk: its own calls, not its 512 dense warm-up all-reduces
        options["warmup_steps"] = 0
    warm = make_method(name, **options)  # libraries, communication buffers: not per-gradient memory
    for _ in range(2):
        warm(torch.randn(20_000))
    del warm
    method = make_method(name, **options)
    unit = 4 * n / 1024  # KiB of one float32 gradient
    gen = torch.Generator().manual_seed(dist.get_rank())
    dist.barrier()
    libc.malloc_trim(0)
    base = _status_kib("VmRSS")
    grad = torch.randn(n, generator=gen)
    method(grad.clone())  # first call: buffers built, one-time checks
    dist.barrier()
    libc.malloc_trim(0)
    before = _status_kib("VmRSS")  # the caller's gradient + what the method keeps
    _reset_peak()
    peak = 0
    for _ in range(calls):
        out = method(grad)
        peak = max(peak, _status_kib("VmHWM"))
        del out
    dist.barrier()
    libc.malloc_trim(0)
    kept = _status_kib("VmRSS") - base - 4 * n / 1024  # less the caller's gradient
    return {"kept": kept / unit, "peak": (peak - base) / unit, "before": (before - base) / unit,
            "spare": method.accumulates}


def _measured_row(name, n, P):
    per_rank = run_workers(P, measure, name, n, timeout=600)
    return {"kept": max(r["kept"] for r in per_rank), "peak": max(r["peak"] for r in per_rank),
            "spare": per_rank[0]["spare"]}


def _row(name, n=N, P=2):
    """:func:`_measured_row` in a fresh interpreter (see the module docstring), max over the ranks."""
    proc = subprocess.run([sys.executable, __file__, "--row", name, str(n), str(P)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


#: methods whose peak is known to exceed 4 gradients, and why (docs/memory.md)
OVER_PEAK = {
    "redsync": "sampled binary search gathers up to a quarter of n as candidates (12 bytes each) when it searches",
    "hitopk": "stage 1's ring reduce-scatter (transport layer) holds a full-length copy of the gradient",
    "oktopk": "fed one gradient every call, the residual grows past the threshold Ok-Topk reuses between "
              "estimations (adjusted 1.2% a call): 11-13x k selected, about 20% of n gathered as candidates",
}


#: methods known to keep more than 2.2 gradients between calls, why, and their ceiling (docs/memory.md)
OVER_KEPT = {
    "sidco": ("its two-stage fit gathers, in one scan, every element above a floor under the first stage's "
              "threshold (density^(1/2) of n, 10% at 1%); the scan's buffers for them are kept", 2.5),
    "oktopk": ("fed one gradient every call it selects 11-13x k (see OVER_PEAK), and last_sent keeps the "
               "int64 index of every entry the last call sent (0.19 gradients at n = 5M)", 2.4),
}


def _check(name, figures, n):
    if method_class(name).has_residual:
        # 2 buffers + index arrays and scratch: 20% of a gradient, plus 1 MiB that does not scale with n
        ceiling = OVER_KEPT[name][1] if name in OVER_KEPT else 2.2
        assert figures["kept"] <= ceiling + 2 ** 20 / (4 * n), (name, figures)
    if name in OVER_PEAK:
        pytest.xfail(OVER_PEAK[name])
    assert figures["peak"] <= (5.2 if figures["spare"] else 4.2), (name, figures)


@pytest.mark.parametrize("name", ["topka", "spardl"])
def test_memory_of_two_methods_at_one_million(name):
    """The quick version (the full table at n = 5M is the slow test below)."""
    _check(name, _row(name, 1_000_000), 1_000_000)


@pytest.mark.slow
@pytest.mark.parametrize("name", available_methods())
def test_memory_at_five_million(name):
    _check(name, _row(name), N)


if __name__ == "__main__" and sys.argv[1:2] == ["--row"]:  # one method's row, for _row
    print(json.dumps(_measured_row(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
elif __name__ == "__main__":  # the table of benchmarks/memory
    P = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(f"n = {N}, density {DENSITY}, P = {P}; gradient-sized buffers (4n = {4 * N / 2 ** 20:.1f} MiB), "
          "max over ranks")
    print("| method | residual | kept between calls | peak during a call (with gradient and output) |")
    print("| --- | --- | --- | --- |")
    for method_name in available_methods():
        row = _row(method_name, N, P)
        print(f"| {method_name} | {'yes' if method_class(method_name).has_residual else 'no'} | "
              f"{row['kept']:.2f} | {row['peak']:.2f} |")
        sys.stdout.flush()
