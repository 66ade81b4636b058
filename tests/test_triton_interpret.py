"""The GPU selection kernels (``triton_scan``) checked on the CPU, in Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the checks run in a subprocess started
with ``TRITON_INTERPRET=1`` and the scan implementation forced to ``triton`` (``SPARSECOMM_SCAN``).
Skipped where Triton is not installed (CPU builds of torch come without it; `pip install triton`).
On a GPU the same code runs compiled: ``tests/test_gpu.py`` (`make test-gpu`).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (pip install triton to check the GPU kernels here)")

_SCRIPT = textwrap.dedent("""
    import math
    import numpy as np
    import torch
    from sparsecomm import selection as selectors
    from sparsecomm.selection import scan, triton_scan

    assert scan.kernel() == "triton", scan.kernel()
    gen = torch.Generator().manual_seed(0)
    # the scan: statistics and the candidates in increasing order, at floors with many, few, no hits
    for n in (1, 1000, 16384, 16385, 50_003):
        x = torch.randn(n, generator=gen)
        for floor in (0.0, 1.5, 3.0, math.inf):
            count, total, top, idx, val = triton_scan.scan_ge(x, floor, triton_scan._Buffers())
            want = torch.nonzero(x.abs() >= floor).squeeze(1)
            assert count == want.numel() and torch.equal(idx, want), (n, floor)
            assert torch.equal(val, x.abs()[want]), (n, floor)
            assert math.isclose(total, float(x.abs().double().sum()), rel_tol=1e-12), (n, floor)
            assert top == float(x.abs().max()), (n, floor)
    # one buffer set across calls: outputs sized from the last count, too small when it grows
    # (and every gather tile the launch shape allows)
    x = torch.randn(70_001, generator=gen)
    for piece in (256, 512, 1024):
        triton_scan.SHAPE["gather_tile"] = piece
        buffers = triton_scan._Buffers()
        for floor in (3.0, 2.0, 2.5, 0.5, math.inf, 1.0):
            count, _, _, idx, val = triton_scan.scan_ge(x, floor, buffers, expected=10)
            want = torch.nonzero(x.abs() >= floor).squeeze(1)
            assert count == want.numel() and torch.equal(idx, want) and torch.equal(val, x.abs()[want]), floor
            assert triton_scan.scan_ge(x, floor, buffers, gather=False)[0] == count, floor
    triton_scan.SHAPE["gather_tile"] = 1024
    # the counts at many thresholds in one call equal one count per threshold
    a = torch.sort(torch.randn(5000, generator=gen).abs()).values
    thresholds = np.array([0.0, 0.1, 1.0, float(a[17]), 2.5, 9.0])
    assert triton_scan.counts_ge(a, thresholds).tolist() == [int((a >= float(np.float32(t))).sum())
                                                             for t in thresholds]
    # every selector selects the same indices through the Triton path as through the C kernel
    options = {"fixed_threshold": "threshold", "scaled_threshold": "initial_threshold"}
    for name in selectors.available():
        for n, density in ((40_000, 0.01), (70_001, 0.002)):
            x = torch.randn(n, generator=gen)
            k = math.ceil(density * n)
            extra = {options[name]: float(torch.topk(x.abs(), k).values.min())} if name in options else {}
            with scan.use_kernel("triton"):
                got = torch.sort(selectors.make(name, **extra)(x, k)).values
            with scan.use_kernel("auto"):
                want = torch.sort(selectors.make(name, **extra)(x, k)).values
            assert torch.equal(got, want), (name, n, density, got.numel(), want.numel())
    print("ok")
""")


def test_triton_kernels_in_the_interpreter_match_the_cpu_path():
    env = dict(os.environ, TRITON_INTERPRET="1", SPARSECOMM_SCAN="triton")
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
