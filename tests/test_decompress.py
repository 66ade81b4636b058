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
    assert torch.equal(torch.unique(written), union)
    if merge.compiled():  # the C path: sorted unique indices and the exact non-zero count
        assert torch.equal(written, union)
        assert nonzero == int(torch.count_nonzero(expected))
    # and against a float64 sum: P - 1 additions and a division, each rounded, stay within eps * sum |v|
    exact = torch.zeros(n, dtype=torch.float64)
    magnitude = torch.zeros(n, dtype=torch.float64)
    for chunk in chunks:
        exact.index_add_(0, chunk.indices.long(), chunk.values.double())
        magnitude.index_add_(0, chunk.indices.long(), chunk.values.double().abs())
    bound = torch.finfo(value_dtype).eps * magnitude
    assert bool(((out.double() - exact / P).abs() <= bound).all())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), P=st.integers(1, 9), n=st.integers(1, 400),
       index_dtype=st.sampled_from([torch.int32, torch.int64]),
       value_dtype=st.sampled_from([torch.float32, torch.float64]))
def test_add_chunks_merge_equals_its_torch_path(seed, P, n, index_dtype, value_dtype):
    chunks = _random_chunks(seed, P, n, index_dtype, value_dtype, negative_zero=True)
    merged = add_chunks(chunks)
    saved, merge._compiled = merge._compiled, None
    try:
        sorted_by_torch = add_chunks(chunks)
    finally:
        merge._compiled = saved
    assert merged.indices.dtype == sorted_by_torch.indices.dtype
    assert torch.equal(merged.indices, sorted_by_torch.indices)
    assert torch.equal(_bits(merged.values), _bits(sorted_by_torch.values))


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
