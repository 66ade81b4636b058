"""Selectors: counts, contracts, edge cases and state of every selector in sparsecomm.selection."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecomm import selectors
from sparsecomm.selection import NonFiniteInputError, scan
from sparsecomm.selection.triton_select import MSTOPK_DRAW

EXACT = ["exact_topk", "trimmed", "mstopk"]
ALL = ["binary_search", "block_topk", "dgc_sampled", "exact_topk", "fixed_threshold", "mstopk",
       "sampled_binary_search", "scaled_threshold", "trimmed"]
OPTIONS = {"fixed_threshold": {"threshold": 0.5}}


@pytest.fixture(autouse=True, scope="module", params=scan.available_kernels())
def scan_kernel(request):
    """Every test here runs once per scan implementation: the C kernel's variants and pure torch."""
    with scan.use_kernel(request.param):
        yield request.param


def make(name, **options):
    return selectors.make(name, **{**OPTIONS.get(name, {}), **options})


def count_band(name, k, n, sel=None):
    """The documented (low, high) count for 0 < k < n, or None for no band."""
    if name in EXACT:
        return k, k
    if name in ("binary_search", "sampled_binary_search"):
        return k, 2 * k
    if name == "dgc_sampled":
        return math.ceil(0.8 * k), k
    if name == "block_topk":
        return k, k + sel.block_size - 1
    return None


def is_top_ordered(x, idx):
    """Every selected magnitude >= every unselected one (a threshold set, or a top-k up to ties)."""
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[idx] = True
    if mask.all() or not mask.any():
        return True
    a = x.abs()
    return bool(a[mask].min() >= a[~mask].max())


def check_indices(idx, n):
    assert idx.dtype == torch.int64 and idx.dim() == 1
    assert idx.numel() == idx.unique().numel(), "indices must be distinct"
    if idx.numel():
        assert int(idx.min()) >= 0 and int(idx.max()) < n


# Values with many ties (a small alphabet) or continuous ones.
values = st.one_of(st.floats(-1e3, 1e3, allow_nan=False, width=32),
                   st.sampled_from([0.0, 1.0, -1.0, 2.0, -0.5]))
inputs = st.lists(values, min_size=1, max_size=300).map(lambda v: torch.tensor(v, dtype=torch.float32))


def test_registry_lists_every_selector_and_rejects_unknown_names():
    assert selectors.available() == ALL
    with pytest.raises(ValueError, match="unknown selector 'nope'"):
        selectors.make("nope")
    with pytest.raises(TypeError, match="selector 'exact_topk': unknown option 'nonsense'; valid options: algorithm"):
        selectors.make("exact_topk", nonsense=1)


@pytest.mark.parametrize("name", EXACT + ["binary_search", "sampled_binary_search", "dgc_sampled", "block_topk"])
@settings(max_examples=60, deadline=None)
@given(x=inputs, k_frac=st.floats(0.0, 1.2))
def test_counts_stay_in_documented_band(name, x, k_frac):
    n = x.numel()
    k = int(k_frac * n)
    sel = make(name)
    idx = sel(x, k)
    check_indices(idx, n)
    if k == 0 or k >= n:
        assert idx.numel() == min(k, n)
        return
    low, high = count_band(name, k, n, sel)
    assert low <= idx.numel() <= high
    if name != "mstopk" and name != "block_topk":
        assert is_top_ordered(x, idx)


@pytest.mark.parametrize("algorithm", ["auto", "torch", "sampled"])
@settings(max_examples=60, deadline=None)
@given(x=inputs, k_frac=st.floats(0.0, 1.0))
def test_topk_returns_the_largest_magnitudes(algorithm, x, k_frac):
    k = int(k_frac * x.numel())
    idx = selectors.make("exact_topk", algorithm=algorithm)(x, k)
    expected = torch.topk(x.abs(), k).values
    assert torch.equal(x.abs()[idx].sort(descending=True).values, expected)


def large_inputs():
    gen = torch.Generator().manual_seed(1)
    n = 1 << 18
    normal = torch.randn(n, generator=gen)
    ties = torch.randint(-3, 4, (n,), generator=gen).float()
    # Adversarial for the strided sample: the sampled positions hold the big values, so the sampled
    # floor is far too high and the fallback path must keep results exact.
    trap = torch.rand(n, generator=gen)
    trap[::10] += 100.0
    return {"normal": normal, "ties": ties, "strided-trap": trap}


LARGE = large_inputs()


@pytest.mark.parametrize("data", sorted(LARGE))
@pytest.mark.parametrize("density", [0.001, 0.01, 0.2])
@pytest.mark.parametrize("name", ALL)
def test_large_inputs_take_the_fast_paths_and_keep_contracts(name, data, density):
    x = LARGE[data]
    n = x.numel()
    k = math.ceil(density * n)
    sel = make(name)
    for _ in range(3):  # stateful selectors: reuse paths too
        idx = sel(x, k)
        check_indices(idx, n)
        band = count_band(name, k, n, sel)
        if band is not None:
            assert band[0] <= idx.numel() <= band[1]
    if name == "exact_topk" or (name == "trimmed"):
        assert torch.equal(x.abs()[idx].sort().values, torch.topk(x.abs(), k).values.sort().values)
    if name in ("binary_search", "sampled_binary_search", "dgc_sampled", "fixed_threshold", "scaled_threshold"):
        assert is_top_ordered(x, idx)


def test_threshold_selects_exactly_the_magnitudes_at_or_above_it():
    x = torch.tensor([0.1, -0.5, 0.7, -0.49, 0.5, 0.0])
    idx = selectors.make("fixed_threshold", threshold=0.5)(x, 2)
    assert sorted(idx.tolist()) == [1, 2, 4]
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        selectors.make("fixed_threshold", threshold=-1.0)


def test_scaled_threshold_follows_exdyna_algorithm_5():
    sel = selectors.make("scaled_threshold")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    k = 100
    assert sel.state_dict()["threshold"] is None
    idx = sel(x, k)
    first = 1 / (2 * math.sqrt(k))
    assert idx.numel() == int((x.abs() >= first).sum())
    assert sel.state_dict()["threshold"] == pytest.approx(first * 1.005)  # count >> 1.1 k
    assert sel.scale_factor(105, 100) == pytest.approx(1.00125)
    assert sel.scale_factor(111, 100) == pytest.approx(1.005)
    assert sel.scale_factor(90, 100) == pytest.approx(0.995)


def test_scaled_threshold_settles_near_k_on_stationary_data():
    gen = torch.Generator().manual_seed(0)
    k, n = 200, 20_000
    sel = selectors.make("scaled_threshold", initial_threshold=1.0)
    counts = [sel(torch.randn(n, generator=gen), k).numel() for _ in range(600)]
    tail = counts[-100:]
    assert k / 1.3 < sum(tail) / len(tail) < 1.3 * k


def test_block_topk_selects_whole_blocks_with_largest_norm():
    x = torch.zeros(100)
    x[40:48] = 1.0  # block 5 of size 8
    x[96:100] = 3.0  # the short last block (4 elements), largest norm
    sel = selectors.make("block_topk", block_size=8)
    idx = sorted(sel(x, 8).tolist())
    # The last block alone has 4 < k = 8 elements, so one more block is taken.
    assert idx == list(range(40, 48)) + list(range(96, 100))
    assert sorted(sel(x, 4).tolist()) == list(range(96, 100))


@pytest.mark.parametrize("name", ALL)
def test_edge_cases(name):
    sel = make(name)
    x = torch.randn(50)
    assert sel(x, 0).numel() == 0
    assert torch.equal(sel(x, 50), torch.arange(50))
    assert torch.equal(sel(x, 70), torch.arange(50))
    assert torch.equal(make(name)(torch.tensor([-2.0]), 1), torch.tensor([0]))
    zeros = make(name)(torch.zeros(64), 5)
    check_indices(zeros, 64)
    band = count_band(name, 5, 64, sel)
    if band is not None:
        assert band[0] <= zeros.numel() <= band[1]
    with pytest.raises(ValueError, match="1-D"):
        sel(torch.zeros(2, 2), 1)
    with pytest.raises(TypeError, match="floating"):
        sel(torch.arange(5), 1)
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        sel(x, -1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ALL)
def test_other_float_dtypes(name, dtype):
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(2)).to(dtype)
    k = 1000
    sel = make(name)
    idx = sel(x, k)
    check_indices(idx, x.numel())
    band = count_band(name, k, x.numel(), sel)
    if band is not None:
        assert band[0] <= idx.numel() <= band[1]
    if name in ("exact_topk", "trimmed"):
        assert torch.equal(x.abs()[idx].sort().values, torch.topk(x.abs(), k).values.sort().values)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("n", [100, 1 << 17])
@pytest.mark.parametrize("name", ALL)
def test_non_finite_input_is_refused_by_default(name, bad, n):
    x = torch.randn(n)
    x[n // 3] = bad
    with pytest.raises(NonFiniteInputError, match="NaN/Inf"):
        make(name)(x, 10)
    idx = make(name, check_finite=False)(x, 10)  # no check: still valid indices
    check_indices(idx, n)


@pytest.mark.parametrize("k", [1, 7, 999])
def test_exact_topk_checks_its_torch_path_on_the_values_it_selects(k):
    """Below the sampled path, exact top-k checks the k values torch.topk returns (NaN and Inf rank
    above every finite magnitude, so one anywhere in x is among them) instead of a pass over x; the
    error still counts every bad element of x."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 1e30  # large, finite
    x[[3, 500, 998]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    with pytest.raises(NonFiniteInputError, match="holds 3 NaN/Inf"):
        selectors.make("exact_topk", algorithm="torch")(x, k)
    x[[3, 500, 998]] = 0.0
    idx = selectors.make("exact_topk", algorithm="torch")(x, k)
    assert torch.equal(x.abs()[idx].sort().values, torch.topk(x.abs(), k).values.sort().values)


def test_large_finite_values_are_not_mistaken_for_inf():
    x = torch.full((1000,), 3e38)  # their sum overflows float32
    idx = selectors.make("trimmed")(x, 10)
    assert idx.numel() == 10


@pytest.mark.parametrize("name", ["sampled_binary_search", "scaled_threshold", "mstopk", "dgc_sampled"])
def test_state_dict_round_trip_reproduces_the_next_call(name):
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(1 << 17, generator=gen) for _ in range(4)]
    original = make(name)
    for x in xs[:2]:
        original(x, 500)
    clone = make(name)
    clone.load_state_dict(original.state_dict())
    for x in xs[2:]:
        assert torch.equal(original(x, 500).sort().values, clone(x, 500).sort().values)


@pytest.mark.parametrize("n, k", [(2_000, 20), (200_003, 1_500), (50_000, 4_999)])
def test_mstopk_is_everything_above_thres1_and_a_window_of_the_band_in_index_order(monkeypatch, n, k):
    """Shi et al. Algorithm 1's result, read off the two thresholds the search ended with: every
    element >= thres1 and a random contiguous window (in index order) of those in [thres2, thres1),
    returned sorted; the window's start ``u % (band - missing + 1)`` for the call's one draw ``u`` of the
    selector's generator, taken before the search."""
    bracket = []
    marking = scan.MagnitudeView.indices_ge_marking

    def recording(view, lo, hi):
        bracket.append((lo, hi))
        return marking(view, lo, hi)
    monkeypatch.setattr(scan.MagnitudeView, "indices_ge_marking", recording)
    x = torch.round(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 8) / 8  # ties: no count of k
    selector = make("mstopk", seed=11)
    drawn = torch.Generator()
    drawn.set_state(selector.generator.get_state())
    got = selector(x, k)
    (thres2, thres1), = bracket
    a = x.abs()
    upper = torch.nonzero(a >= torch.tensor(thres1, dtype=a.dtype)).squeeze(1)
    band = torch.nonzero((a >= torch.tensor(thres2, dtype=a.dtype)) & (a < torch.tensor(thres1, dtype=a.dtype)))
    band = band.squeeze(1)
    missing = k - upper.numel()
    assert 0 < missing <= band.numel()  # the window is used at these sizes
    start = int(torch.randint(*MSTOPK_DRAW, (1,), generator=drawn)) % (band.numel() - missing + 1)
    expected = torch.sort(torch.cat([upper, band[start:start + missing]])).values
    assert torch.equal(got, expected)


def test_sampled_binary_search_reuses_then_searches_again():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1 << 17, generator=gen)
    sel = selectors.make("sampled_binary_search", interval=3)
    sel(x, 500)
    threshold = sel.state_dict()["threshold"]
    sel(x * 1.001, 500)  # in band: reused
    assert sel.state_dict() == {"threshold": threshold, "searched_for": [500, x.numel()], "calls_since_search": 2}
    idx = sel(x * 10, 500)  # the reused threshold would select far too many: searched again
    assert 500 <= idx.numel() <= 1000 and sel.state_dict()["calls_since_search"] == 1
    assert sel.state_dict()["threshold"] != threshold


@pytest.mark.parametrize("old", ["topk", "threshold", "dgc"])
def test_the_method_and_module_names_are_no_selector_names(old):
    with pytest.raises(ValueError, match=f"unknown selector '{old}'; available: .*exact_topk"):
        selectors.make(old)
    assert old not in selectors.available()


def test_no_selector_shares_its_name_with_a_method():
    from sparsecomm.methods import available_methods

    assert set(selectors.available()).isdisjoint(available_methods())


def test_stateless_selectors_refuse_state():
    with pytest.raises(ValueError, match="stateless"):
        selectors.make("exact_topk").load_state_dict({"threshold": 1.0})


def test_quality_on_normal_data_and_mlp_gradients():
    from sparsecomm_lab.bench.select import captured_mass, mlp_gradients

    inputs = {"normal": torch.randn(1 << 18, generator=torch.Generator().manual_seed(5)),
              "mlp": mlp_gradients(steps=2)[-1]}
    for label, x in inputs.items():
        k = math.ceil(0.01 * x.numel())
        for name in ("exact_topk", "trimmed", "binary_search", "sampled_binary_search", "dgc_sampled"):
            assert captured_mass(x, make(name)(x, k), k) == pytest.approx(1.0), (label, name)
        assert captured_mass(x, make("mstopk")(x, k), k) > 0.9, label
        random = torch.randperm(x.numel())[:k]
        assert captured_mass(x, random, k) < 0.5, label


def test_bench_select_prints_a_row_per_selector(capsys):
    import argparse

    from sparsecomm_lab.bench import select

    parser = argparse.ArgumentParser()
    select.add_arguments(parser)
    args = parser.parse_args(["--n", "65536", "--repeat", "1", "--threads", "1", "--densities", "0.01"])
    assert select.run(args) == 0
    out = capsys.readouterr().out
    for name in ALL + ["torch.topk", "abs+compare pass"]:
        assert f"| {name} |" in out
    if scan.kernel() != "torch":  # the kernel's own pass, and every selector timed on torch passes too
        assert f"| fused scan ({scan.kernel()}) |" in out and "| ms (torch scan) |" in out
