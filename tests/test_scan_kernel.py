"""The scan under every selector (sparsecomm.selection.scan): the C kernel against a torch reference.

Each implementation (AVX-512, AVX2, portable C, torch) must give the same candidates ``|x| >= floor`` (indices
in increasing order and their magnitudes), the same ``max |x|``, and ``sum |x|`` up to rounding, for
any length, any thread count and any output capacity (overflow is reported, then scanned again).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecomm import run_workers, selectors
from sparsecomm.selection import NonFiniteInputError, scan

KERNELS = scan.available_kernels()
COMPILED = [k for k in KERNELS if k != "torch"]
needs_compiled = pytest.mark.skipif(not COMPILED, reason="sparsecomm.selection._scan is not built")


def reference(x, floor):
    a = x.abs()
    indices = torch.nonzero(a >= floor).squeeze(1)
    return indices, a[indices], float(a.double().sum()), float(a.max()) if x.numel() else 0.0


def assert_scan_matches(result, x, floor):
    indices, values, total, top = reference(x, floor)
    assert torch.equal(result.indices, indices)
    assert torch.equal(result.values, values)
    assert result.total == pytest.approx(total, rel=1e-5, abs=1e-30)
    if result.max is not None:
        assert result.max == top


def test_kernel_is_built_where_a_compiler_exists():
    """`pip install` builds the kernel optionally: a machine with a C compiler must have it."""
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here: the torch path is used")
    assert COMPILED, "a C compiler exists but sparsecomm.selection._scan was not built (see setup.py)"
    assert scan.kernel() == COMPILED[0]


magnitudes = st.one_of(st.floats(-1e6, 1e6, allow_nan=False, width=32),
                       st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e-40, -3e38]))


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=80, deadline=None)
@given(values=st.lists(magnitudes, max_size=200), floor_pick=st.integers(0, 1000), scale=st.floats(0.0, 2.0))
def test_scan_equals_the_torch_reference(kernel, values, floor_pick, scale):
    x = torch.tensor(values, dtype=torch.float32)
    # floors on the data (ties at the floor are candidates) and between data
    floor = float(x.abs()[floor_pick % len(values)]) * scale if values else scale
    with scan.use_kernel(kernel):
        result = scan.Scratch().scan(x, floor, name="t", check_finite=True)
    assert_scan_matches(result, x, floor)


@pytest.mark.parametrize("kernel", KERNELS)
def test_thresholds_are_rounded_to_float32_as_torch_does(kernel):
    """A threshold between two float32 values compares as its float32 rounding, in every path."""
    x = torch.tensor([1.0, 0.5, 2.0, 16777216.0])
    with scan.use_kernel(kernel):
        assert scan.Scratch().scan(x, 1.0 + 1e-9, name="t", check_finite=True).indices.tolist() == [0, 2, 3]
        assert scan.Scratch().scan(x, 16777217.0, name="t", check_finite=True).indices.tolist() == [3]


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100_003])
def test_raw_kernel_counts_beyond_its_capacity(kernel, n):
    from sparsecomm.selection import _scan

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    floor = 1.0
    ref_idx, ref_val, ref_total, ref_max = reference(x, floor)
    cap = ref_idx.numel() // 2  # too small: the count stays exact, the first cap candidates are written
    idx, val = torch.empty(cap, dtype=torch.int32), torch.empty(cap)
    count, total, top = _scan.scan_ge(x.data_ptr(), n, floor, idx.data_ptr(), val.data_ptr(), cap, kernel)
    assert count == ref_idx.numel() and top == ref_max
    assert total == pytest.approx(ref_total, rel=1e-6)
    assert torch.equal(idx.long(), ref_idx[:cap]) and torch.equal(val, ref_val[:cap])


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@pytest.mark.parametrize("mode", ["read", "in_place", "dest", "unaligned_dest"])
def test_candidates_are_exact_where_their_density_changes_along_the_vector(kernel, mode):
    """The kernels note which blocks of a chunk of 1024 elements hold a candidate and pack those
    afterwards (re-reading the sum from ``x`` where the scan wrote it there, adding again where it
    streamed it elsewhere) while candidates are sparse, and pack every block as it comes once they are
    not, deciding chunk by chunk: regions of 0, 0.05%, 20%, 0.05% and 2% candidates, with region edges
    off the chunks, give exactly the reference's, with the sum in place, in a separate vector, or in
    one not aligned to the vector width (written without streaming)."""
    g = torch.Generator().manual_seed(5)
    edges = [0, 70_001, 200_000, 460_017, 700_003, 800_011]
    x = torch.rand(edges[-1], generator=g) * 0.5  # below the floor 1.0
    for lo, hi, share in zip(edges[:-1], edges[1:], [0.0, 0.0005, 0.2, 0.0005, 0.02], strict=True):
        hits = lo + torch.randperm(hi - lo, generator=g)[: int(share * (hi - lo))]
        x[hits] = 1.0 + torch.rand(hits.numel(), generator=g)
    x[-1] = -1.0  # a candidate in the tail, and a negative one
    addend = None if mode == "read" else torch.rand(x.numel(), generator=g) * 0.25
    total = x if addend is None else x + addend
    dest = {"dest": torch.empty_like(x), "unaligned_dest": torch.empty(x.numel() + 1)[1:]}.get(mode)
    scanned = x.clone()
    with scan.use_kernel(kernel):
        result = scan.Scratch().scan(scanned, 1.0, name="t", check_finite=True, addend=addend, dest=dest,
                                     expected=200_000)
    assert_scan_matches(result, total, 1.0)
    assert torch.equal(scanned, total if mode == "in_place" else x)
    if dest is not None:
        assert torch.equal(dest, total)


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@pytest.mark.parametrize("cap", [0, 1, 999, 1000, 1017])
def test_raw_kernel_writes_the_first_sparse_candidates_that_fit(kernel, cap):
    """Sparse candidates (1%) with room for only some of them: the first ``cap`` are written, lane by
    lane where a block's would not all fit, and every candidate is counted."""
    from sparsecomm.selection import _scan

    n = 200_003
    x = torch.rand(n, generator=torch.Generator().manual_seed(cap)) * 0.5
    x[torch.randperm(n, generator=torch.Generator().manual_seed(1))[: n // 100]] = 2.0
    ref_idx, ref_val, _, _ = reference(x, 1.0)
    idx, val = torch.full((cap + 16,), -1, dtype=torch.int32), torch.full((cap + 16,), -1.0)
    count, _, _ = _scan.scan_ge(x.data_ptr(), n, 1.0, idx.data_ptr(), val.data_ptr(), cap, kernel)
    assert count == ref_idx.numel()
    assert torch.equal(idx[:cap].long(), ref_idx[:cap]) and torch.equal(val[:cap], ref_val[:cap])
    assert bool((idx[cap:] == -1).all()) and bool((val[cap:] == -1.0).all())  # nothing past the room


@needs_compiled
def test_raw_kernel_refuses_bad_sizes():
    from sparsecomm.selection import _scan

    x = torch.zeros(10)
    with pytest.raises(ValueError, match="n=-1"):
        _scan.scan_ge(x.data_ptr(), -1, 0.0, 0, 0, 0, "scalar")
    with pytest.raises(ValueError, match="n=2147483648"):
        _scan.scan_ge(x.data_ptr(), 1 << 31, 0.0, 0, 0, 0, "scalar")
    with pytest.raises(ValueError, match="cap=-2"):
        _scan.scan_ge(x.data_ptr(), 10, 0.0, 0, 0, -2, "scalar")
    with pytest.raises(ValueError, match="'sse'"):
        _scan.scan_ge(x.data_ptr(), 10, 0.0, 0, 0, 0, "sse")


@pytest.mark.parametrize("kernel", KERNELS)
def test_scratch_grows_when_the_guess_is_too_small(kernel):
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    scratch = scan.Scratch()
    with scan.use_kernel(kernel):
        first = scratch.scan(x, 0.5, name="t", check_finite=True, expected=10)  # ~62% of x qualifies
        assert_scan_matches(first, x, 0.5)
        again = scratch.scan(x * 2, 0.5, name="t", check_finite=True)
        assert_scan_matches(again, x * 2, 0.5)
        assert again.indices.data_ptr() != first.indices.data_ptr(), "results must not alias buffers"
        assert scratch.count_ge(x, 1.0) == int((x.abs() >= 1.0).sum())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_scan_refuses_non_finite_input_or_passes_it_through(kernel, bad):
    x = torch.randn(70_001)
    x[12_345] = bad
    with scan.use_kernel(kernel):
        with pytest.raises(NonFiniteInputError, match="1 NaN/Inf element"):
            scan.Scratch().scan(x, 1.0, name="mine", check_finite=True)
        result = scan.Scratch().scan(x, 1.0, name="mine", check_finite=False)
    assert not math.isfinite(result.total)
    assert (12_345 in result.indices.tolist()) == (not math.isnan(bad))  # NaN passes no threshold


def test_largest_finite_floats_are_not_mistaken_for_inf():
    x = torch.full((4096,), 3e38)
    for kernel in KERNELS:
        with scan.use_kernel(kernel):
            result = scan.Scratch().scan(x, 1.0, name="t", check_finite=True)
        assert result.total == pytest.approx(4096 * 3e38, rel=1e-6)


@pytest.mark.parametrize("name", selectors.available())
def test_every_kernel_makes_the_same_selection(name):
    options = {"fixed_threshold": {"threshold": 1.5}}.get(name, {})
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(1 << 18, generator=gen) for _ in range(3)]
    picks = {}
    for kernel in KERNELS:
        sel = selectors.make(name, **options)
        with scan.use_kernel(kernel):
            picks[kernel] = [sel(x, k).sort().values for x in xs for k in (262, 2622)]
    first = picks[KERNELS[0]]
    for kernel in KERNELS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, picks[kernel], strict=False)), kernel


def test_use_kernel_rejects_unknown_and_unavailable_names():
    with pytest.raises(ValueError, match="'fastest'"), scan.use_kernel("fastest"):
        pass
    for missing in {"avx512", "avx2"} - set(KERNELS):
        with pytest.raises(ValueError, match="not available"), scan.use_kernel(missing):
            pass
    before = scan.kernel()
    with scan.use_kernel("torch") as chosen:
        assert chosen == "torch" == scan.kernel()
    assert scan.kernel() == before


def _kernel_in_a_fresh_interpreter(value):
    env = {**os.environ, "SPARSECOMM_SCAN": value}
    return subprocess.run([sys.executable, "-c", "from sparsecomm.selection import scan; print(scan.kernel())"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_environment_variable_picks_the_kernel():
    assert _kernel_in_a_fresh_interpreter("torch").stdout.strip() == "torch"
    bad = _kernel_in_a_fresh_interpreter("gpu")
    assert bad.returncode != 0 and "'gpu'" in bad.stderr


def _select_in_worker(n, k):
    sel = selectors.make("binary_search")
    x = torch.randn(n, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    return scan.kernel(), sel(x, k).numel()


def test_forked_workers_use_the_kernel_after_the_parent_did():
    n, k = 1 << 18, 1000
    selectors.make("binary_search")(torch.randn(n), k)
    results = run_workers(3, _select_in_worker, n, k, timeout=60)
    assert all(kernel == scan.kernel() and k <= c <= 2 * k for kernel, c in results)


@pytest.mark.parametrize("count", [1, 10, 300, 5000, 100_000])
def test_sample_floor_keeps_candidates_few_even_for_tiny_counts(count):
    """Without a floor a search would scan all of x at every step; a tiny count still gets one."""
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(count))
    floor = scan.sample_floor(x, count)
    assert floor is not None
    above = int((x.abs() >= floor).sum())
    assert count < above <= max(2 * count, x.numel() // 64)


def test_sample_floor_gives_up_on_small_inputs():
    assert scan.sample_floor(torch.randn(5000), 10) is None
    assert scan.sample_floor(torch.randn(5000), 0) is None


@needs_compiled
def test_a_scan_that_overflowed_its_buffer_keeps_room_for_its_count(monkeypatch):
    """A caller whose expected count stays too low (RedSync's reused threshold) scans the vector again
    once, on the first overflow, not at every call: the buffer keeps room for the last count (up to
    1/32 of the input), above the 2^18 candidates kept for any caller."""
    x = torch.randn(1 << 24, generator=torch.Generator().manual_seed(5))
    floor = 2.25  # |x| >= 2.25: about 2.4% of x, 410k candidates (more than 2^18, fewer than n / 32)
    lengths = []
    compiled = scan._compiled

    class Counting:
        def __getattr__(self, name):
            return getattr(compiled, name)

        def scan_ge(self, *args):
            lengths.append(args[1])
            return compiled.scan_ge(*args)

    monkeypatch.setattr(scan, "_compiled", Counting())
    scratch = scan.Scratch()
    with scan.use_kernel(COMPILED[0]):
        first = scratch.scan(x, floor, name="t", check_finite=False, expected=1000)
        assert len(lengths) == 2  # the overflow scanned x again
        for _ in range(2):
            again = scratch.scan(x, floor, name="t", check_finite=False, expected=1000)
            assert torch.equal(again.indices, first.indices) and torch.equal(again.values, first.values)
    assert (1 << 18) < first.indices.numel() < x.numel() // 32
    assert len(lengths) == 4  # one scan each: no overflow


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=0, max_size=300),
       floor_pick=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_scan_with_an_addend_writes_the_sum_and_scans_it(kernel, values, floor_pick, seed):
    x = torch.tensor(values, dtype=torch.float32)
    addend = torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)) * 100
    expected = x + addend
    floor = floor_pick * float(expected.abs().max()) if x.numel() else 0.0
    with scan.use_kernel(kernel):
        result = scan.Scratch().scan(x, floor, name="t", check_finite=True, addend=addend, expected=2)
    assert torch.equal(x, expected)  # written back, bit for bit the torch addition
    assert_scan_matches(result, expected, floor)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["exact_topk", "trimmed", "binary_search", "block_topk"])
@pytest.mark.parametrize("n, k", [(1000, 7), (200_003, 2000), (200_003, 1)])
def test_accumulate_equals_the_addition_then_the_selection(kernel, name, n, k):
    g = torch.Generator().manual_seed(n + k)
    residual, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 3
    added, fused = residual.clone(), residual.clone()
    options = {"block_size": 16} if name == "block_topk" else {}
    with scan.use_kernel(kernel):
        expected = selectors.make(name, **options)(added.add_(grad), k)
        got = selectors.make(name, **options).accumulate(fused, grad, k)
    assert torch.equal(fused, added)
    assert torch.equal(torch.sort(got).values, torch.sort(expected).values)


@pytest.mark.parametrize("kernel", KERNELS)
def test_accumulate_refuses_non_finite_sums(kernel):
    x, grad = torch.randn(100_000), torch.randn(100_000)
    grad[777] = math.nan
    with scan.use_kernel(kernel), pytest.raises(NonFiniteInputError):
        selectors.make("exact_topk").accumulate(x, grad, 100)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name, options", [("fixed_threshold", {"threshold": 2.5}), ("scaled_threshold", {}),
                                           ("binary_search", {}), ("sampled_binary_search", {"interval": 3}),
                                           ("mstopk", {"samplings": 20})])
def test_threshold_selectors_fuse_the_addition_bit_for_bit_over_calls(kernel, name, options):
    """Their ``accumulate`` into a separate ``dest`` (the addition inside the first scan) picks the same
    indices in the same order, leaves the same state and writes the same sum as the addition followed by
    the selection, call after call with error feedback (a reused threshold, MSTopK's random window)."""
    n, k = 200_003, 1500
    gen = torch.Generator().manual_seed(5)
    fused, plain = selectors.make(name, **options), selectors.make(name, **options)
    residual = torch.zeros(n)
    with scan.use_kernel(kernel):
        for call in range(6):
            grad = torch.randn(n, generator=gen) * (1 + call % 3)
            dest = torch.empty(n)
            got = fused.accumulate(residual, grad, k, dest=dest)
            added = residual + grad
            expected = plain(added, k)
            assert torch.equal(dest, added) and torch.equal(got, expected)
            assert repr(fused.state_dict()) == repr(plain.state_dict())
            residual = dest.index_fill_(0, got, 0)


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5000), share=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16), offset=st.integers(0, 3))
def test_take_and_clear_takes_the_values_and_leaves_zeros(kernel, n, share, seed, offset):
    """take_and_clear (the message's values out of acc, the residual left) equals index_select then
    index_fill_, on the kernel and on torch, for indices in any order and for a view of a larger vector."""
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randn(n + offset, generator=gen)
    whole[torch.randperm(n + offset, generator=gen)[: (n + offset) // 7]] = 0.0  # zeros among the values
    x = whole[offset:]
    indices = torch.randperm(n, generator=gen)[: int(share * n)]
    expected_values, expected_x = x[indices].clone(), x.clone()
    expected_x[indices] = 0.0
    with scan.use_kernel(kernel):
        values = scan.take_and_clear(x, indices)
    assert torch.equal(values, expected_values)
    assert torch.equal(x, expected_x)


@pytest.mark.parametrize("kernel", KERNELS)
def test_take_and_clear_refuses_an_index_outside_and_writes_nothing(kernel):
    x = torch.arange(1.0, 11.0)
    with scan.use_kernel(kernel), pytest.raises(IndexError):
        scan.take_and_clear(x, torch.tensor([2, 10]))
    assert torch.equal(x, torch.arange(1.0, 11.0))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@settings(max_examples=25, deadline=None)
@given(count=st.integers(2, 3000), share=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16), ties=st.booleans())
def test_split_largest_keeps_the_largest_and_the_first_ties(kernel, index_dtype, count, share, seed, ties):
    """split_largest (gTop-k's and Ok-Topk's merges) against a sort: the k largest magnitudes, the first
    among ties with the k-th (signed zeros and repeated magnitudes of both signs included), both parts in
    order, on the kernel and on torch."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randint(-3, 4, (count,), generator=gen).float() * 0.5 if ties
              else torch.randn(count, generator=gen))
    values[torch.randperm(count, generator=gen)[: count // 9]] = -0.0
    indices = torch.sort(torch.randperm(10 * count, generator=gen)[:count]).values.to(index_dtype)
    k = min(count - 1, max(1, int(share * count)))
    order = sorted(range(count), key=lambda i: (-abs(float(values[i])), i))  # stable: the first ties first
    keep = torch.zeros(count, dtype=torch.bool)
    keep[order[:k]] = True
    with scan.use_kernel(kernel):
        kept_idx, kept_val, dropped_idx, dropped_val = scan.split_largest(indices, values, k)
    assert torch.equal(kept_idx, indices[keep]) and torch.equal(dropped_idx, indices[~keep])
    assert torch.equal(kept_val.view(torch.int32), values[keep].view(torch.int32))
    assert torch.equal(dropped_val.view(torch.int32), values[~keep].view(torch.int32))


@pytest.mark.parametrize("kernel", COMPILED)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), size=st.sampled_from([1, 2, 7, 16, 32, 33, 64]), seed=st.integers(0, 2 ** 16),
       mode=st.sampled_from(["plain", "in place", "dest"]))
def test_block_energies_kernel_gives_the_bits_of_the_canonical_torch_sum(kernel, n, size, seed, mode):
    """The compiled block energies (S2 Reducer's and OmniReduce's block top-k) against block.py's torch
    path, which sums each block in the same pairwise order: the same bits, and the same sum written."""
    from sparsecomm.selection.block import BlockTopK

    gen = torch.Generator().manual_seed(seed)
    x, addend = torch.randn(n, generator=gen) * 1e3, torch.randn(n, generator=gen)
    addend = None if mode == "plain" else addend
    dests = [None, None] if mode != "dest" else [torch.empty(n), torch.empty(n)]
    results = []
    for use, dest in zip((kernel, "torch"), dests, strict=True):
        selector, work = BlockTopK(block_size=size), x.clone()
        with scan.use_kernel(use):
            energies = selector.block_energies(work, addend, dest)
        results.append((energies, work if dest is None else dest))
    assert torch.equal(results[0][0].view(torch.int32), results[1][0].view(torch.int32))
    assert torch.equal(results[0][1], results[1][1])
    expected = (x if addend is None else x + addend).double().square()
    padded = torch.nn.functional.pad(expected, (0, -n % size)).view(-1, size).sum(1)
    assert torch.allclose(results[0][0].double(), padded, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n, rank", [(1, 1), (7, 7), (1000, 1), (25_600, 322), (65_536, 384), (65_536, 65_536),
                                     (100_003, 1024), (1_000_000, 1024), (1_000_000, 200_000)])
@pytest.mark.parametrize("data", ["normal", "ties", "zeros", "infinite", "nonfinite"])
def test_kth_largest_is_the_value_torch_topk_gives(kernel, n, rank, data):
    """kth_largest (the radix select where the kernel takes the tensor, of the candidates above a
    sampled floor from 65536 elements on) returns the value torch.topk's smallest of the ``rank``
    largest gives, ties, zeros, Inf (whose bits still order) and NaN (which the select leaves to
    torch.topk) included."""
    g = torch.Generator().manual_seed(n + rank)
    a = torch.randn(n, generator=g).abs_()
    if data == "ties":  # few distinct magnitudes: many equal to the rank-th largest
        a = (a * 4).floor_()
    elif data == "zeros":
        a[torch.rand(n, generator=g) < 0.999] = 0.0
    elif data == "infinite":
        a[torch.randint(0, n, (2,), generator=g)] = math.inf
    elif data == "nonfinite":
        a[torch.randint(0, n, (3,), generator=g)] = torch.tensor([math.nan, math.inf, math.inf])
    expected = float(torch.topk(a, rank, sorted=False).values.min())
    with scan.use_kernel(kernel):
        got = scan.kth_largest(a, rank)
    assert got == expected or (math.isnan(got) and math.isnan(expected))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n, count", [(100_003, 7), (1_000_000, 1000), (3_000_017, 30_000)])
def test_sample_floor_samples_the_same_elements_on_every_path(kernel, n, count):
    """The C kernel's strided sample (lines prefetched ahead) gives the floor torch's strided slice
    gives, with and without an addend."""
    g = torch.Generator().manual_seed(n)
    x, addend = torch.randn(n, generator=g), torch.randn(n, generator=g) * 3
    with scan.use_kernel("torch"):
        expected = scan.sample_floor(x, count), scan.sample_floor(x, count, addend=addend)
    with scan.use_kernel(kernel):
        assert (scan.sample_floor(x, count), scan.sample_floor(x, count, addend=addend)) == expected
    assert expected[0] is not None and expected[1] is not None
