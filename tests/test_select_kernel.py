"""The exact top-k path on the C kernels: the candidates' emission near the end of the output buffer,
the radix select of the k largest (``_scan.select_largest`` behind ``scan.largest_in_order``), the
scan's separate destination for ``x + addend``, and ``exact_topk``'s ``accumulate`` end to end.

Every compiled variant (AVX-512, AVX2, portable C, as the CPU allows) is checked against a reference
built from torch alone: the k largest magnitudes, ties with the k-th broken towards the lowest index.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecomm import selectors
from sparsecomm.selection import NonFiniteInputError, scan

KERNELS = scan.available_kernels()
COMPILED = [k for k in KERNELS if k != "torch"]
needs_compiled = pytest.mark.skipif(not COMPILED, reason="sparsecomm.selection._scan is not built")


def largest_first_then_lowest_index(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest values, ties broken towards the lowest position, increasing."""
    order = torch.sort(-values.double(), stable=True).indices
    return torch.sort(order[:k]).values


def tied(n: int, levels: int, seed: int) -> torch.Tensor:
    """Magnitudes drawn from few distinct values: many ties at every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, (n,), generator=gen).float() * 0.25


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@pytest.mark.parametrize("n, k", [(2, 1), (17, 16), (100, 1), (100, 99), (1000, 999), (4099, 2049),
                                  (65_537, 700), (200_003, 199_990)])
@pytest.mark.parametrize("data", ["normal", "few-levels", "all-equal", "zeros-and-inf"])
def test_largest_in_order_equals_the_reference(kernel, n, k, data):
    gen = torch.Generator().manual_seed(n * 7 + k)
    if data == "normal":
        values = torch.randn(n, generator=gen).abs()
    elif data == "few-levels":
        values = tied(n, 5, n + k)
    elif data == "all-equal":
        values = torch.full((n,), 3.5)
    else:
        values = torch.where(torch.rand(n, generator=gen) < 0.3, math.inf, 0.0)
    indices = torch.sort(torch.randperm(4 * n, generator=gen)[:n]).values  # increasing, with gaps
    expected = indices[largest_first_then_lowest_index(values, k)]
    with scan.use_kernel(kernel):
        got = scan.largest_in_order(indices, values, k)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)
    with scan.use_kernel("torch"):  # the torch path keeps the same tie rule
        assert torch.equal(scan.largest_in_order(indices, values, k), expected)


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.integers(0, 0x7F800000), min_size=2, max_size=300), pick=st.floats(0, 1),
       duplicate=st.booleans())
def test_select_largest_on_any_bit_patterns(kernel, bits, pick, duplicate):
    """Keys spread over the whole float range, including subnormals, +Inf and runs of equal keys."""
    if duplicate:
        bits = bits + bits[: len(bits) // 2]
    values = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    k = min(len(bits) - 1, max(1, int(pick * len(bits))))
    indices = torch.arange(len(bits), dtype=torch.int64) * 3
    with scan.use_kernel(kernel):
        got = scan.largest_in_order(indices, values, k)
    assert torch.equal(got, indices[largest_first_then_lowest_index(values, k)])


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@pytest.mark.parametrize("bad", [math.nan, -1.0, -0.0])
def test_select_largest_declines_nan_and_negative_values(kernel, bad):
    from sparsecomm.selection import _scan

    values = torch.rand(1000, generator=torch.Generator().manual_seed(3))
    values[417] = bad
    indices = torch.arange(1000, dtype=torch.int64)
    out = torch.empty(10, dtype=torch.int64)
    assert _scan.select_largest(indices.data_ptr(), values.data_ptr(), 1000, 10, out.data_ptr(), kernel) == -1
    with scan.use_kernel(kernel):
        got = scan.largest_in_order(indices, values, 10)
    with scan.use_kernel("torch"):
        assert torch.equal(got, scan.largest_in_order(indices, values, 10))


@needs_compiled
def test_select_largest_refuses_bad_arguments():
    from sparsecomm.selection import _scan

    x = torch.zeros(10)
    for k in (0, 10):
        with pytest.raises(ValueError, match=f"k={k} count=10"):
            _scan.select_largest(0, x.data_ptr(), 10, k, 0, "scalar")
    with pytest.raises(ValueError, match="'sse'"):
        _scan.select_largest(0, x.data_ptr(), 10, 5, 0, "sse")


@needs_compiled
@pytest.mark.parametrize("kernel", COMPILED)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 1000, 4111])
def test_emission_near_the_end_of_the_buffer(kernel, n):
    """Every capacity around the candidate count: the vector variants store whole blocks while they
    fit and take lanes one by one at the end of the buffer, and must never write past it."""
    from sparsecomm.selection import _scan

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    floor = 0.5
    expected = torch.nonzero(x.abs() >= floor).squeeze(1)
    count = expected.numel()
    for cap in sorted({0, 1, max(0, count - 17), max(0, count - 1), count, count + 1, count + 15, count + 16}):
        guard = 64  # sentinel entries after the buffer must survive
        idx = torch.full((cap + guard,), -7, dtype=torch.int32)
        val = torch.full((cap + guard,), -7.0)
        got, _, _ = _scan.scan_ge(x.data_ptr(), n, floor, idx.data_ptr(), val.data_ptr(), cap, kernel)
        assert got == count
        written = min(cap, count)
        assert torch.equal(idx[:written].long(), expected[:written])
        assert torch.equal(val[:written], x.abs()[expected[:written]])
        assert bool((idx[cap:] == -7).all()) and bool((val[cap:] == -7.0).all()), (cap, count)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n", [5, 16, 1001, 100_003])
@pytest.mark.parametrize("placement", ["separate", "same", "misaligned"])
def test_scan_writes_the_sum_to_dest(kernel, n, placement):
    gen = torch.Generator().manual_seed(n)
    x0, addend = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    x = x0.clone()
    expected = x0 + addend
    if placement == "same":
        dest = x
    elif placement == "separate":
        dest = torch.full((n,), math.nan)
    else:  # not aligned to the vector width: the kernel cannot use non-temporal stores there
        dest = torch.full((n + 1,), math.nan)[1:]
    floor = 1.5
    with scan.use_kernel(kernel):
        result = scan.Scratch().scan(x, floor, name="t", check_finite=True, addend=addend, dest=dest, expected=4)
    assert torch.equal(dest, expected)
    assert torch.equal(x, expected if placement == "same" else x0)
    indices = torch.nonzero(expected.abs() >= floor).squeeze(1)
    assert torch.equal(result.indices, indices) and torch.equal(result.values, expected.abs()[indices])
    assert result.max is None or result.max == float(expected.abs().max())


@pytest.mark.parametrize("kernel", KERNELS)
def test_scan_refuses_dest_without_addend_or_unlike_x(kernel):
    x = torch.randn(100)
    with scan.use_kernel(kernel):
        for dest, addend in ((torch.empty(100), None), (torch.empty(99), x), (torch.empty(100).double(), x)):
            with pytest.raises(ValueError, match="dest needs an addend"):
                scan.Scratch().scan(x, 1.0, name="t", check_finite=True, addend=addend, dest=dest)


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_finite_sum_written_to_dest_is_refused(kernel):
    x, addend, dest = torch.randn(70_001), torch.randn(70_001), torch.empty(70_001)
    addend[5] = math.inf
    with scan.use_kernel(kernel), pytest.raises(NonFiniteInputError):
        scan.Scratch().scan(x, 1.0, name="t", check_finite=True, addend=addend, dest=dest)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n, k", [(70_001, 1), (70_001, 700), (131_072, 1311), (200_003, 20_000), (300_000, 299_999)])
@pytest.mark.parametrize("data", ["normal", "few-levels"])
@pytest.mark.parametrize("separate_dest", [False, True])
def test_topk_accumulate_equals_the_reference(kernel, n, k, data, separate_dest):
    """exact_topk's fused path: the k largest |residual + grad|, lowest indices among ties, increasing,
    on every kernel (where the sampled path applies); with a separate dest the residual is left as it was."""
    gen = torch.Generator().manual_seed(n + k)
    if data == "normal":
        residual, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 3
    else:  # sums on a grid of 0.25: heavy ties at the k-th magnitude
        residual, grad = tied(n, 9, k) - 1.0, tied(n, 9, k + 1) - 1.0
    total = residual + grad
    expected = largest_first_then_lowest_index(total.abs(), k)
    acc = residual.clone()
    dest = torch.empty(n) if separate_dest else None
    with scan.use_kernel(kernel):
        got = selectors.make("exact_topk").accumulate(acc, grad, k, dest=dest)
    assert torch.equal(dest if separate_dest else acc, total)
    assert torch.equal(acc, residual if separate_dest else total)
    if scan.sample_floor(total, k) is not None:  # the sampled path: increasing, ties as the reference
        assert torch.equal(got, expected)
    else:  # small n or k near n: plain torch.topk, in its own order and with its own ties
        assert torch.equal(total.abs()[got].sort().values, total.abs()[expected].sort().values)


@pytest.mark.parametrize("name", ["exact_topk", "trimmed", "binary_search", "fixed_threshold"])
def test_accumulate_into_dest_equals_accumulate_in_place(name):
    gen = torch.Generator().manual_seed(11)
    residual, grad = torch.randn(100_000, generator=gen), torch.randn(100_000, generator=gen)
    options = {"threshold": 2.0} if name == "fixed_threshold" else {}
    in_place, dest = residual.clone(), torch.empty(100_000)
    expected = selectors.make(name, **options).accumulate(in_place, grad, 500)
    got = selectors.make(name, **options).accumulate(residual, grad, 500, dest=dest)
    assert torch.equal(dest, in_place) and not torch.equal(residual, in_place)
    assert torch.equal(torch.sort(got).values, torch.sort(expected).values)


def test_accumulate_refuses_a_dest_unlike_x():
    sel = selectors.make("exact_topk")
    x = torch.randn(100)
    with pytest.raises(ValueError, match="dest must be a tensor shaped like x"):
        sel.accumulate(x, torch.randn(100), 5, dest=torch.empty(99))
    with pytest.raises(ValueError, match="dest must have x's dtype"):
        sel.accumulate(x, torch.randn(100), 5, dest=torch.empty(100, dtype=torch.float64))


@pytest.mark.parametrize("kernel", KERNELS)
def test_topk_on_nan_without_the_check_matches_the_torch_path(kernel):
    """NaN handling is the torch path's (the C select declines NaN): same indices on every kernel."""
    gen = torch.Generator().manual_seed(5)
    residual, grad = torch.randn(100_000, generator=gen), torch.randn(100_000, generator=gen)
    grad[[10, 5000, 77_777]] = math.nan
    picks = {}
    for name in (kernel, "torch"):
        acc = residual.clone()
        with scan.use_kernel(name):
            picks[name] = selectors.make("exact_topk", check_finite=False).accumulate(acc, grad, 1000)
    assert torch.equal(picks[kernel], picks["torch"])
