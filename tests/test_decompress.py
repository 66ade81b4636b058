"""Decompression is exact: the merge of sorted chunks (sparsecomm.transport.merge) gives the bits of
the torch reference (one index_add_ per chunk in rank order, then / P), on its C path and its torch
path, and a method's output is exactly the average of what the ranks sent."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsecomm.transport.merge as merge
from sparsecomm import run_workers
from sparsecomm.transport.chunk import SparseChunk, add_chunks


def _random_chunks(seed: int, P: int, n: int, index_dtype, value_dtype, *, negative_zero: bool = False):
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(P):
        k = int(torch.randint(0, n + 1, (1,), generator=g))
        idx = torch.sort(torch.randperm(n, generator=g)[:k]).values.to(index_dtype)
        scale = 10.0 ** torch.randint(-4, 5, (k,), generator=g).to(value_dtype)
        values = torch.randn(k, generator=g, dtype=value_dtype) * scale
        if negative_zero and k:
            values[0] = -0.0
        chunks.append(SparseChunk(idx, values))
    return chunks


def _reference(n: int, chunks, P: int, dtype):
    """The dense reference: zeros, one index_add_ per chunk in order, the touched entries / P."""
    out = torch.zeros(n, dtype=dtype)
    for chunk in chunks:
        out.index_add_(0, chunk.indices.long(), chunk.values)
    touched = torch.cat([c.indices.long() for c in chunks])
    out[touched] = out[touched] / P
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int64 if x.dtype == torch.float64 else torch.int32)


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch):
    if request.param == "compiled":
        if not merge.compiled():
            pytest.skip("sparsecomm.transport._merge is not built")
    else:
        monkeypatch.setattr(merge, "_compiled", None)
    return request.param


def _groups(indices: torch.Tensor, n: int) -> torch.Tensor:
    """The int64 indices of every element of the GROUP-element groups that hold one of ``indices``."""
    groups = torch.unique(indices.long() // merge.GROUP)
    elements = (groups.unsqueeze(1) * merge.GROUP + torch.arange(merge.GROUP)).reshape(-1)
    return elements[elements < n]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), P=st.integers(1, 9), n=st.integers(1, 400),
       index_dtype=st.sampled_from([torch.int32, torch.int64]),
       value_dtype=st.sampled_from([torch.float32, torch.float64]), negative_zero=st.booleans())
def test_average_into_is_the_reference_bit_for_bit(seed, P, n, index_dtype, value_dtype, negative_zero):
    chunks = _random_chunks(seed, P, n, index_dtype, value_dtype, negative_zero=negative_zero)
    expected = _reference(n, chunks, P, value_dtype)
    out = torch.zeros(n, dtype=value_dtype)
    written, nonzero = merge.average_into(out, [c.indices for c in chunks], [c.values for c in chunks], P)
    assert torch.equal(_bits(out), _bits(expected))
    union = torch.unique(torch.cat([c.indices.long() for c in chunks]))
    if merge.compiled():  # the C path: the groups written, and the exact non-zero count
        assert isinstance(written, merge.GroupMask)
        assert torch.equal(written.indices(), _groups(union, n))
        assert nonzero == int(torch.count_nonzero(expected))
    else:
        assert torch.equal(torch.unique(written), union)
    # and against a float64 sum: P - 1 additions and a division, each rounded, stay within eps * sum |v|
    exact = torch.zeros(n, dtype=torch.float64)
    magnitude = torch.zeros(n, dtype=torch.float64)
    for chunk in chunks:
        exact.index_add_(0, chunk.indices.long(), chunk.values.double())
        magnitude.index_add_(0, chunk.indices.long(), chunk.values.double().abs())
    bound = torch.finfo(value_dtype).eps * magnitude
    assert bool(((out.double() - exact / P).abs() <= bound).all())


def _sparse_chunks(g, P: int, n: int, density: float, index_dtype, value_dtype, *, repeats: bool):
    """P sorted chunks of about ``density * n`` entries each (some empty), overlapping across chunks,
    with repeated indices inside a chunk where ``repeats``; values over several decades, some -0.0."""
    chunks = []
    for _ in range(P):
        k = min(n, int(torch.randint(0, 2 * int(density * n) + 2, (1,), generator=g)))
        picks = torch.randint(0, n, (k,), generator=g) if repeats else torch.randperm(n, generator=g)[:k]
        values = torch.randn(k, generator=g, dtype=value_dtype)
        values *= 10.0 ** torch.randint(-3, 4, (k,), generator=g).to(value_dtype)
        values[::11] = -0.0
        chunks.append(SparseChunk(torch.sort(picks).values.to(index_dtype), values))
    return chunks


def _reference_from(n, chunks, P, dtype, *, keep_sign: bool):
    """Zeros; with ``keep_sign`` -0.0 at the chunks' indices (sums start from the first value); one
    index_add_ per chunk in order; the touched entries / P."""
    out = torch.zeros(n, dtype=dtype)
    touched = torch.cat([c.indices.long() for c in chunks])
    if keep_sign:
        out[touched] = -0.0
    for chunk in chunks:
        out.index_add_(0, chunk.indices.long(), chunk.values)
    if P != 1:
        out[touched] = out[touched] / P
    return out


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float64])
def test_reused_output_across_calls_is_the_reference(path, index_dtype, value_dtype):
    """Calls on one output tensor, each passing what the previous returned as ``stale``: the supports
    change from call to call, between sparse blocks (written in place) and dense ones (streamed out),
    P from 1 to 8, empty chunks, repeats inside and across chunks, an output that starts as garbage
    and lies at an odd offset, a length that is no multiple of the block: every result is the reference
    bit for bit, zero at every stale entry, with the exact non-zero count on the C path."""
    g = torch.Generator().manual_seed(7)
    n = 3 * 4096 + 1001
    storage = torch.randn(n + 1, generator=g, dtype=value_dtype)
    out = storage[1:]  # 4 or 8 bytes past the allocation's alignment
    stale: merge.Stale = "all"
    for call, (P, density, keep_sign) in enumerate([(4, 0.3, False), (1, 0.002, False), (8, 0.05, True),
                                                    (3, 0.0005, False), (2, 0.9, True), (8, 0.01, False),
                                                    (5, 0.0, False), (1, 0.2, True), (6, 0.004, False)]):
        chunks = _sparse_chunks(g, P, n, density, index_dtype, value_dtype, repeats=call % 2 == 1)
        expected = _reference_from(n, chunks, P, value_dtype, keep_sign=keep_sign)
        stale, nonzero = merge.average_into(out, [c.indices for c in chunks], [c.values for c in chunks], P,
                                            stale=stale, keep_sign=keep_sign)
        assert torch.equal(_bits(out), _bits(expected)), f"call {call}"
        if path == "compiled":
            assert isinstance(stale, merge.GroupMask) and nonzero == int(torch.count_nonzero(expected))
            union = torch.cat([c.indices.long() for c in chunks])
            assert torch.equal(stale.indices(), _groups(union, n))
    assert storage[0] == torch.randn(n + 1, generator=torch.Generator().manual_seed(7), dtype=value_dtype)[0]


def test_stale_says_what_to_zero(path):
    """``stale=None``: the output is zero already; an index tensor: zero elsewhere; a :class:`GroupMask`
    from a call on another length: the whole output is zeroed. A GroupMask left by the C path is
    honoured by the torch path too (an unsorted chunk takes it)."""
    n = 10_000
    g = torch.Generator().manual_seed(3)
    chunks = _sparse_chunks(g, 3, n, 0.01, torch.int64, torch.float32, repeats=False)
    expected = _reference_from(n, chunks, 3, torch.float32, keep_sign=False)
    indices, values = [c.indices for c in chunks], [c.values for c in chunks]
    out = torch.zeros(n)
    merge.average_into(out, indices, values, 3)
    assert torch.equal(out, expected)
    out = torch.zeros(n)
    out[[5, 77, 9000]] = 1.5
    merge.average_into(out, indices, values, 3, stale=torch.tensor([9000, 5, 77]))
    assert torch.equal(out, expected)
    out.fill_(2.0)
    merge.average_into(out, indices, values, 3, stale=merge.GroupMask(n + 1))
    assert torch.equal(out, expected)
    mask = merge.GroupMask(n)
    mask.words[3] = 1 << 5  # group 3 * 64 + 5: elements 3152..3167
    out = torch.zeros(n)
    out[3152:3168] = 4.0
    unsorted = [torch.tensor([7, 2]), torch.tensor([2])]
    written, _ = merge.average_into(out, unsorted, [torch.tensor([1.0, 2.0]), torch.tensor([4.0])], 2, stale=mask)
    assert out.nonzero().reshape(-1).tolist() == [2, 7]
    assert out[[2, 7]].tolist() == [3.0, 0.5]
    assert torch.equal(torch.unique(written), torch.tensor([2, 7]))


def test_keep_sign_is_an_assignment(path):
    """With ``keep_sign`` one chunk of unique indices gives ``out[i] = v / P`` exactly (-0.0 kept);
    without it the sum starts from +0.0, as index_add_ into zeros does."""
    indices = torch.tensor([1, 4, 6], dtype=torch.int32)
    values = torch.tensor([-0.0, 3.0, -0.0])
    out = torch.full((8,), 9.0)
    merge.average_into(out, [indices], [values], 4, stale="all", keep_sign=True)
    expected = torch.zeros(8)
    expected[indices.long()] = values / 4
    assert torch.equal(_bits(out), _bits(expected))
    merge.average_into(out, [indices], [values], 4, stale="all")
    assert torch.equal(_bits(out), _bits(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.75, 0.0, 0.0, 0.0])))


@pytest.mark.parametrize("P", [1, 4, 8])
@pytest.mark.parametrize("density", [0.001, 0.05])
def test_large_outputs_in_both_regimes(P, density):
    """Outputs of many blocks, sparse (written in place) and dense (streamed): three reused calls, each
    the reference bit for bit with the exact count; the non-power-of-two divisor too."""
    if not merge.compiled():
        pytest.skip("sparsecomm.transport._merge is not built")
    n = 200_003
    g = torch.Generator().manual_seed(P)
    out = torch.full((n,), float("nan"))
    stale: merge.Stale = "all"
    for divisor in (P, P + 2, P):
        chunks = _sparse_chunks(g, P, n, density, torch.int32, torch.float32, repeats=False)
        expected = _reference_from(n, chunks, divisor, torch.float32, keep_sign=False)
        stale, nonzero = merge.average_into(out, [c.indices for c in chunks], [c.values for c in chunks], divisor,
                                            stale=stale)
        assert torch.equal(_bits(out), _bits(expected))
        assert nonzero == int(torch.count_nonzero(expected))


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 1, 15, 16, 511, 512, 1000, 1023])
def test_outputs_anywhere_in_a_page_are_the_reference(offset, value_dtype):
    """The dense blocks' scratch is placed half a page from the output's offset within a page (against
    4K aliasing): outputs starting anywhere in a page, streamed and in place, give the reference's bits."""
    if not merge.compiled():
        pytest.skip("sparsecomm.transport._merge is not built")
    n = 50_001
    g = torch.Generator().manual_seed(offset)
    memory = torch.full((n + 1024,), float("nan"), dtype=value_dtype)
    out = memory[offset:offset + n]
    stale: merge.Stale = "all"
    for density in (0.05, 0.001, 0.05):
        chunks = _sparse_chunks(g, 3, n, density, torch.int64, value_dtype, repeats=False)
        expected = _reference_from(n, chunks, 3, value_dtype, keep_sign=False)
        stale, _ = merge.average_into(out, [c.indices for c in chunks], [c.values for c in chunks], 3, stale=stale)
        assert torch.equal(_bits(out), _bits(expected))
    assert bool(memory[:offset].isnan().all()) and bool(memory[offset + n:].isnan().all())  # nothing outside


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), P=st.integers(1, 9), n=st.integers(1, 400),
       index_dtype=st.sampled_from([torch.int32, torch.int64]),
       value_dtype=st.sampled_from([torch.float32, torch.float64]))
def test_add_chunks_merge_equals_its_torch_path(seed, P, n, index_dtype, value_dtype):
    _assert_merge_has_the_torch_paths_bits(_random_chunks(seed, P, n, index_dtype, value_dtype, negative_zero=True))


def _assert_merge_has_the_torch_paths_bits(chunks) -> None:
    """add_chunks with the C merge (where built) against its torch path: the same indices, dtype, bits."""
    merged = add_chunks(chunks)
    saved, merge._compiled = merge._compiled, None
    try:
        sorted_by_torch = add_chunks(chunks)
    finally:
        merge._compiled = saved
    assert merged.indices.dtype == sorted_by_torch.indices.dtype == chunks[0].indices.dtype
    assert torch.equal(merged.indices, sorted_by_torch.indices)
    assert torch.equal(_bits(merged.values), _bits(sorted_by_torch.values))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float64])
def test_add_chunks_merge_spans_blocks_gaps_and_repeats_with_the_torch_paths_bits(index_dtype, value_dtype):
    # the C merge sums block by block (4096 indices): runs across block edges, empty stretches between
    # entries, repeated indices inside a chunk, and (int64) indices far past 2^31
    g = torch.Generator().manual_seed(5)
    far = 2 ** 40 if index_dtype == torch.int64 else 2 ** 30
    chunks = []
    for c in range(6):
        dense_part = torch.randint(0, 3 * 4096, (3000,), generator=g)
        edges = torch.tensor([4095, 4096, 8191, 8192, 4096 * 1000 + c])
        distant = far - torch.randint(1, 10_000, (50,), generator=g)
        idx = torch.sort(torch.cat([dense_part, edges, edges, distant])).values.to(index_dtype)
        values = torch.randn(idx.numel(), generator=g, dtype=value_dtype) * 10.0 ** (c - 3)
        values[0] = -0.0
        chunks.append(SparseChunk(idx, values))
    _assert_merge_has_the_torch_paths_bits(chunks)


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float64])
def test_a_single_coalesced_chunk_sums_to_itself_with_the_bits_of_index_add(value_dtype):
    indices = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    values = torch.tensor([-0.0, 2.5, -1.0, 0.0], dtype=value_dtype)
    summed = add_chunks([SparseChunk(indices, values)])
    expected = torch.zeros(10, dtype=value_dtype).index_add_(0, indices.long(), values)[indices.long()]
    assert torch.equal(summed.indices, indices)
    assert torch.equal(_bits(summed.values), _bits(expected))  # -0.0 becomes +0.0, as index_add_ into zeros
    assert summed.values.data_ptr() != values.data_ptr()       # the caller's values are not aliased
    repeated = add_chunks([SparseChunk(torch.tensor([2, 2, 5]), torch.tensor([1.0, 2.0, 3.0]))])
    assert repeated.indices.tolist() == [2, 5] and repeated.values.tolist() == [3.0, 3.0]


def test_unsorted_and_repeated_chunks_take_the_torch_path(path):
    chunks = [SparseChunk(torch.tensor([5, 1, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0])),
              SparseChunk(torch.tensor([1, 1, 4], dtype=torch.int32), torch.tensor([0.5, 0.25, 7.0]))]
    summed = add_chunks(chunks)
    assert summed.indices.tolist() == [1, 3, 4, 5]
    assert summed.values.tolist() == [2.75, 3.0, 7.0, 1.0]
    out = torch.zeros(6)
    merge.average_into(out, [c.indices for c in chunks[:1]], [c.values for c in chunks[:1]], 2)
    assert out.tolist() == [0.0, 1.0, 0.0, 1.5, 0.0, 0.5]


def test_index_out_of_range_raises(path):
    out = torch.zeros(4)
    with pytest.raises((IndexError, RuntimeError)):
        merge.average_into(out, [torch.tensor([1, 4], dtype=torch.int32)], [torch.tensor([1.0, 2.0])], 1)


# ---------------------------------------------------------------------- the methods
def _sent_and_result(name: str, n: int, steps: int):
    """On each rank: per step, (local indices sent, the values sent, the method's output)."""
    import torch.distributed as dist

    from sparsecomm import make_method

    rank = dist.get_rank()
    method = make_method(name, density=0.05)
    records = []
    for step in range(steps):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + step))
        grad[::7] *= 100.0  # magnitudes over several decades: overlapping picks, uneven sums
        acc = grad + (0 if method.residual is None else method.residual)
        out = method(grad.clone())
        sent = method.last_sent.clone()
        records.append((sent, acc[sent], out.clone()))
    return records


@pytest.mark.parametrize("name", ["topka", "topk", "threshold", "redsync"])
@pytest.mark.parametrize("P", [3, 4, 5])
def test_method_output_is_the_exact_average_of_what_was_sent(name, P, path):
    """On the C merge and on the torch path (the workers are forked with the parent's choice)."""
    n = 3001
    traces = run_workers(P, _sent_and_result, name, n, 3, timeout=120)
    for step in range(3):
        chunks = []
        for trace in traces:
            sent, values, _ = trace[step]
            order = torch.argsort(sent)
            chunks.append(SparseChunk(sent[order], values[order]))
        expected = _reference(n, chunks, P, torch.float32)
        for trace in traces:
            assert torch.equal(_bits(trace[step][2]), _bits(expected)), f"{name} P={P} step {step}"


def _fresh_and_reused(name: str, n: int, steps: int):
    """Two instances get the same gradients: one returns fresh results, the other writes one reused
    ``out=`` tensor (zeroed by the next call only where this one wrote). Per step: whether the bits
    agree, and whether ``stats.nnz_out`` counts the result's non-zeros."""
    import torch.distributed as dist

    from sparsecomm import make_method

    fresh, reusing = make_method(name, density=0.02), make_method(name, density=0.02)
    buf = torch.full((n,), float("nan"))
    checks = []
    for step in range(steps):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(100 * dist.get_rank() + step))
        grad[step::5] *= 30.0  # a support that moves from step to step
        result = fresh(grad.clone())
        counted = fresh.stats.nnz_out == int(torch.count_nonzero(result)) or name in ("spardl", "cltk", "exdyna",
                                                                                        "gtopk", "oktopk")
        reusing(grad.clone(), out=buf)
        checks.append((torch.equal(_bits(result), _bits(buf)), counted))
    return checks


@pytest.mark.parametrize("name", ["topka", "spardl", "redsync", "hitopk", "topkdsa", "oktopk", "omnireduce",
                                  "s2reducer", "cltk", "gtopk", "exdyna"])
def test_methods_reusing_their_output_give_the_fresh_bits(name):
    """Over many blocks of the sweep and moving supports: the out= path (the stale entries zeroed in
    the same sweep) returns the bits of fresh results, and the merge's count is the result's."""
    for checks in run_workers(3, _fresh_and_reused, name, 50_003, 4, timeout=120):
        assert checks == [(True, True)] * 4, f"{name}: {checks}"


@pytest.mark.parametrize("path", ["compiled", "torch"])
@settings(max_examples=120, deadline=None)
@given(a=st.lists(st.integers(-5, 60), max_size=80), b=st.lists(st.integers(-5, 60), max_size=80),
       wide=st.sampled_from([(torch.int64, torch.int64), (torch.int32, torch.int64), (torch.int32, torch.int32)]),
       reverse=st.booleans())
def test_members_is_membership_on_every_path(path, a, b, wide, reverse):
    """merge.members (the C walk over both sorted vectors, or torch's binary search) marks the entries
    of the first found in the sorted second, repeats included; a first vector out of order (the C walk
    refuses it) takes the torch path."""
    if path == "compiled" and not merge.compiled():
        pytest.skip("the C merge is not built")
    a_t = torch.tensor(sorted(a, reverse=reverse), dtype=wide[0])
    b_t = torch.tensor(sorted(b), dtype=wide[1])
    expected = torch.tensor([x in set(b) for x in a_t.tolist()], dtype=torch.bool)
    compiled = merge._compiled
    try:
        if path == "torch":
            merge._compiled = None
        assert torch.equal(merge.members(a_t, b_t), expected)
    finally:
        merge._compiled = compiled


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 700), share=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_nonzero_positions_is_torch_nonzero(dtype, n, share, seed):
    """The union bitmaps' positions (C for uint8 and int32, torch otherwise): torch.nonzero's, for any
    length (whole 64-byte words and a tail) and any share set, with values whose high bits are set."""
    g = torch.Generator().manual_seed(seed)
    bitmap = torch.zeros(n, dtype=dtype)
    hits = torch.rand(n, generator=g) < share
    values = torch.tensor([1, 127, 128, 255] if dtype == torch.uint8 else [1, -1, 1 << 24, -(1 << 31)], dtype=dtype)
    bitmap[hits] = values[torch.randint(0, 4, (int(hits.sum()),), generator=g)]
    positions = merge.nonzero_positions(bitmap)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, torch.nonzero(bitmap).reshape(-1))
