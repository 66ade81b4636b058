"""The GPU kernels checked on the CPU: in Triton's interpreter, and compiled for an H100/H200.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the interpreter's checks run in a
subprocess started with ``TRITON_INTERPRET=1`` and the scan implementation forced to ``triton``
(``SPARSECOMM_SCAN``): the one-read pass and its order kernel, the device searches (RedSync's band
search, MSTopK, the exact top-k's radix select), the residual's addition fused into them, the packing
and the decompression kernels, each against the CPU path (the C kernels). The compile check builds
every kernel for sm_90 with Triton's own compiler and ptxas (no GPU needed), so that a kernel that
the interpreter runs but the GPU compiler refuses fails here. Skipped where Triton is not installed
(CPU builds of torch come without it; ``pip install triton``). On a GPU the same code runs
compiled: ``tests/test_gpu.py`` (`make test-gpu`).
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
    import logging, math
    import numpy as np
    import torch
    from sparsecomm import selection as selectors
    from sparsecomm.selection import NonFiniteInputError, scan, triton_scan, triton_select
    from sparsecomm.transport import merge, triton_merge

    assert scan.kernel() == "triton", scan.kernel()
    gen = torch.Generator().manual_seed(0)
    fallbacks = []

    class Watch(logging.Handler):
        def emit(self, record):
            if "host path" in record.getMessage():
                fallbacks.append(record.getMessage())
    for module in ("sparsecomm.selection.exact", "sparsecomm.selection.search"):
        logging.getLogger(module).addHandler(Watch())
        logging.getLogger(module).setLevel(logging.DEBUG)

    def both(fn):
        with scan.use_kernel("triton"):
            a = fn()
        with scan.use_kernel("auto"):
            b = fn()
        return a, b

    # the pass: statistics and the candidates in increasing order, at floors with many, few, no hits,
    # one buffer set reused across sizes and floors (outputs sized from the last count, too small as it grows)
    buffers = triton_scan.Buffers()
    for n in (1, 1000, 4097, 70_001):
        x = torch.randn(n, generator=gen)
        for floor in (0.0, 3.0, 1.5, math.inf):
            count, total, top, idx, val = triton_scan.scan_ge(x, floor, buffers, expected=10)
            want = torch.nonzero(x.abs() >= floor).squeeze(1)
            assert count == want.numel() and torch.equal(idx, want), (n, floor)
            assert torch.equal(val, x.abs()[want]), (n, floor)
            assert math.isclose(total, float(x.abs().double().sum()), rel_tol=1e-12), (n, floor)
            assert top == float(x.abs().max()), (n, floor)
            assert triton_scan.scan_ge(x, floor, buffers, gather=False)[0] == count, (n, floor)
    # the counts at many thresholds in one call equal one count per threshold
    a = torch.sort(torch.randn(5000, generator=gen).abs()).values
    thresholds = np.array([0.0, 0.1, 1.0, float(a[17]), 2.5, 9.0])
    assert triton_scan.counts_ge(a, thresholds).tolist() == [int((a >= float(np.float32(t))).sum())
                                                             for t in thresholds]

    # every selector selects the same indices through the Triton path as through the C kernel
    options = {"fixed_threshold": "threshold", "scaled_threshold": "initial_threshold"}
    searches = ("exact_topk", "trimmed", "binary_search", "mstopk", "sampled_binary_search")
    for name in selectors.available():
        for n, density in ((70_001, 0.002), (150_000, 0.01))[:2 if name in searches else 1]:
            x = torch.randn(n, generator=gen)
            k = math.ceil(density * n)
            extra = {options[name]: float(torch.topk(x.abs(), k).values.min())} if name in options else {}
            got, want = both(lambda: torch.sort(selectors.make(name, **extra)(x, k)).values)
            assert torch.equal(got, want), (name, n, density, got.numel(), want.numel())
    assert not fallbacks, fallbacks  # the device searches decided every call

    # the residual's addition fused: the same picks and the same sum, the residual kept with dest,
    # a second call on the same selector (its device buffers reused)
    n, k = 100_003, 200
    residual, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    for name in ("exact_topk", "binary_search", "mstopk", "fixed_threshold", "sampled_binary_search"):
        extra = {"threshold": 3.0} if name == "fixed_threshold" else {}
        def run(separate):
            r, g = residual.clone(), grad.clone()
            sel = selectors.make(name, **extra)
            acc = torch.empty(n) if separate else None
            first = torch.sort(sel.accumulate(r, g, k, dest=acc)).values
            summed = r.clone() if acc is None else acc.clone()
            second = torch.sort(sel.accumulate(r, g, k)).values
            return first, summed, second, r
        for separate in (False, True):
            got, want = both(lambda: run(separate))
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, separate)
    assert not fallbacks, fallbacks

    # ties (many equal magnitudes: the exact top-k keeps the lowest indices, the band search may find
    # no band and completes to the exact top-k), non-finite input (refused alike), every element a
    # candidate (no sample at a high density), a candidate buffer too small (gathered again)
    x = torch.round(torch.randn(100_000, generator=gen) * 2) / 2
    for name, k in (("exact_topk", 1500), ("binary_search", 100), ("mstopk", 1500), ("trimmed", 20_000)):
        got, want = both(lambda: torch.sort(selectors.make(name)(x, k)).values)
        assert torch.equal(got, want), (name, k)
    x = torch.randn(80_000, generator=gen)
    x[777] = float("nan")
    for name in ("exact_topk", "binary_search", "mstopk"):
        def refused():
            try:
                selectors.make(name)(x, 100)
            except NonFiniteInputError:
                return True
            return False
        assert both(refused) == (True, True), name
    x = torch.randn(90_000, generator=gen)
    for name in ("exact_topk", "binary_search", "mstopk"):
        got, want = both(lambda: torch.sort(selectors.make(name)(x, 30_000)).values)
        assert torch.equal(got, want), (name, "dense")
    capacity = triton_select._capacity
    triton_select._capacity = lambda n, plan, buffers: 16
    try:
        for name in ("exact_topk", "binary_search", "mstopk"):
            got, want = both(lambda: torch.sort(selectors.make(name)(x, 500)).values)
            assert torch.equal(got, want), (name, "regather")
    finally:
        triton_select._capacity = capacity

    # the packing kernel and the decompression of sorted chunks: the torch path's bits
    x = torch.randn(70_000, generator=gen)
    idx = torch.randperm(x.numel(), generator=gen)[:5000]
    a, b = x.clone(), x.clone()
    taken = triton_scan.take_and_clear(a, idx)
    assert torch.equal(taken, b.index_select(0, idx)) and torch.equal(a, b.index_fill_(0, idx, 0))
    for n, P, k, keep_sign in ((100_003, 8, 900, False), (70_000, 3, 5000, True), (40_000, 1, 300, False)):
        chunks = [torch.sort(torch.randperm(n, generator=gen)[:k - 50 * p]).values for p in range(P)]
        values = [torch.randn(c.numel(), generator=gen) for c in chunks]
        values[-1][::7] = -0.0
        fused, plain = torch.zeros(n), torch.zeros(n)
        triton_merge.average_sorted_into(fused, chunks, values, P, keep_sign=keep_sign)
        merge.average_into(plain, chunks, values, P, keep_sign=keep_sign)
        assert torch.equal(fused.view(torch.int32), plain.view(torch.int32)), (n, P, keep_sign)
        assert int(triton_merge._bitmap(fused).abs().sum()) == 0  # the claims cleared for the next call
    print("ok")
""")


def test_triton_kernels_in_the_interpreter_match_the_cpu_path():
    env = dict(os.environ, TRITON_INTERPRET="1", SPARSECOMM_SCAN="triton")
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_F32, _F64, _I64, _I32 = "*fp32", "*fp64", "*i64", "*i32"


def _kernels():
    """(kernel, argument types, constexprs, warps, compiler options) of every GPU kernel, one variant each
    (the float64 searches with fused multiply-add off, as they are launched)."""
    from sparsecomm.selection import triton_scan as scan
    from sparsecomm.selection import triton_select as select
    from sparsecomm.transport import triton_merge as merge

    candidates = {"val_ptr": _F32, "state_ptr": _F64}
    return [
        (scan._sample_kernel, {"x_ptr": _F32, "addend_ptr": _F32, "runs": "i32", "stride": "i32", "sample_ptr": _F32,
                               "hists_ptr": _I32}, {"RUNS": 256, "RUN": 4, "ADD": True}, 4, {}),
        (scan._sample_fine_kernel, {"sample_ptr": _F32, "size": "i32", "hists_ptr": _I32, "rank": "i32"},
         {"TILE": 1024}, 4, {}),
        (scan._pass_kernel, {"x_ptr": _F32, "addend_ptr": _F32, "dest_ptr": _F32, "n": "i32", "floor": "fp32",
                             "hists_ptr": _I32, "rank": "i32", "idx_ptr": _I64, "val_ptr": _F32, "capacity": "i32",
                             "chunks_ptr": _I64, "partials_ptr": _F64, "slots_ptr": _I64, "programs": "i32"},
         {"BLOCK": 2048, "ADD": True, "SAMPLED": True, "GATHER": True}, 8, {}),
        (scan._pass_kernel, {"x_ptr": "*bf16", "addend_ptr": "*bf16", "dest_ptr": "*bf16", "n": "i32",
                             "floor": "fp32", "hists_ptr": _I32, "rank": "i32", "idx_ptr": _I64, "val_ptr": "*bf16",
                             "capacity": "i32", "chunks_ptr": _I64, "partials_ptr": _F64, "slots_ptr": _I64,
                             "programs": "i32"},
         {"BLOCK": 2048, "ADD": False, "SAMPLED": False, "GATHER": True}, 8, {}),
        (scan._order_kernel, {"chunks_ptr": _I64, "programs": "i32", "src_idx_ptr": _I64, "src_val_ptr": _F32,
                              "dst_idx_ptr": _I64, "dst_val_ptr": _F32, "capacity": "i32", "partials_ptr": _F64,
                              "slots_ptr": _I64, "state_ptr": _F64, "floor": "fp32", "hists_ptr": _I32,
                              "rank": "i32"}, {"GROUP": 64, "TILE": 32, "SCAN": 2048, "REDUCE": 1024, "SAMPLED": True,
                                        "GATHER": True},
         8, {}),
        (scan._take_clear_kernel, {"idx_ptr": _I64, "x_ptr": _F32, "out_ptr": _F32, "m": "i32", "n": "i32"},
         {"BLOCK": 1024}, 4, {}),
        (select._grid_count_kernel, {**candidates, "n": "i32", "hist_ptr": _I32, "capacity": "i32"},
         {"DEPTH": 15, "BLOCK": 2048}, 4, {"enable_fp_fusion": False}),
        (select._replay_kernel, {"hist_ptr": _I32, "state_ptr": _F64, "n": "i32", "k": "i32", "limit": "i32",
                                 "steps": "i32", "draw_ptr": _I64}, {"DEPTH": 15, "MODE": 1, "LAST": True}, 16,
         {"enable_fp_fusion": False}),
        (select._replay_kernel, {"hist_ptr": _I32, "state_ptr": _F64, "n": "i32", "k": "i32", "limit": "i32",
                                 "steps": "i32", "draw_ptr": _I64}, {"DEPTH": 14, "MODE": 0, "LAST": True}, 16,
         {"enable_fp_fusion": False}),
        (select._radix_count_kernel, {**candidates, "hists_ptr": _I32, "k": "i32", "capacity": "i32"},
         {"LEVEL": 2, "BLOCK": 2048}, 4, {}),
        (select._select_count_kernel, {**candidates, "hists_ptr": _I32, "counts_ptr": _I32, "blocks": "i32",
                                       "k": "i32", "capacity": "i32"}, {"MODE": 1, "LEVELS": 3, "BLOCK": 2048}, 4, {}),
        (select._select_write_kernel, {"idx_ptr": _I64, **candidates, "hists_ptr": _I32, "counts_ptr": _I32,
                                       "blocks": "i32", "capacity": "i32", "out_idx_ptr": _I64, "out_val_ptr": _F32,
                                       "out_capacity": "i32"}, {"MODE": 2, "BLOCK": 2048, "SCAN": 1024}, 4, {}),
        (merge._average_kernel, {"idx_ptr": _I64, "val_ptr": _F32, "offsets_ptr": _I64, "chunks": "i32",
                                 "out_ptr": _F32, "bitmap_ptr": _I32, "n": "i32", "divisor": "fp32"},
         {"BLOCK": 32768, "TILE": 1024, "LANES": 8, "KEEP_SIGN": True, "DIVIDE": True}, 4, {}),
    ]


def test_gpu_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, types, constexprs, warps, options in _kernels():
        signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **options})
        assert compiled.asm.get("cubin"), kernel.__name__
