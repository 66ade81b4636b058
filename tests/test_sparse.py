"""SparseChunk operations, with hypothesis over sizes, overlaps and dtypes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecomm.selection.scan import largest_of_chunk
from sparsecomm.transport.chunk import SparseChunk, add_chunks, index_dtype


@st.composite
def chunks(draw, n=50):
    idx = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    vals = draw(st.lists(st.floats(-100, 100, width=32), min_size=len(idx), max_size=len(idx)))
    return SparseChunk(torch.tensor(idx, dtype=torch.int32), torch.tensor(vals, dtype=torch.float32))


@settings(max_examples=60, deadline=None)
@given(st.lists(chunks(), min_size=1, max_size=4))
def test_add_chunks_equals_dense_sum(parts):
    total = add_chunks(parts)
    dense = sum(p.to_dense(50).double() for p in parts)
    assert torch.allclose(total.to_dense(50).double(), dense, atol=1e-3)
    assert torch.equal(total.indices, torch.unique(total.indices))          # coalesced, sorted


@settings(max_examples=60, deadline=None)
@given(chunks(), st.integers(0, 60))
def test_largest_of_chunk_splits_by_magnitude(chunk, k):
    kept, dropped = largest_of_chunk(chunk, k)
    assert kept.nnz == min(k, chunk.nnz) and kept.nnz + dropped.nnz == chunk.nnz
    if kept.nnz and dropped.nnz:
        assert kept.values.abs().min() >= dropped.values.abs().max()
    assert torch.equal(kept.to_dense(50) + dropped.to_dense(50), chunk.to_dense(50))


def test_gather_with_offset_and_index_dtype():
    dense = torch.arange(10.0)
    chunk = SparseChunk.gather(dense, torch.tensor([1, 4]), offset=100)
    assert chunk.indices.tolist() == [101, 104] and chunk.values.tolist() == [1.0, 4.0]
    assert chunk.indices.dtype == torch.int32 and chunk.nbytes() == 16
    assert index_dtype(2 ** 31) == torch.int64


def test_shape_errors():
    with pytest.raises(ValueError, match="1-D indices and values of one length"):
        SparseChunk(torch.zeros(3, dtype=torch.int32), torch.zeros(2))
    with pytest.raises(ValueError, match="at least one chunk"):
        add_chunks([])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), share=st.sampled_from([0.0, 0.3, 0.9, 1.0]), seed=st.integers(0, 2**31))
def test_select_keeps_the_masked_pairs_in_order(n, share, seed):
    """``select`` is boolean indexing of both tensors: the pairs where the mask is true, in order, with
    the chunk's dtypes (itself where the mask is true everywhere)."""
    g = torch.Generator().manual_seed(seed)
    chunk = SparseChunk(torch.sort(torch.randperm(10 * n + 1, generator=g)[:n]).values.to(torch.int32),
                        torch.randn(n, generator=g, dtype=torch.float64))
    mask = torch.rand(n, generator=g) < share
    picked = chunk.select(mask)
    assert torch.equal(picked.indices, chunk.indices[mask]) and torch.equal(picked.values, chunk.values[mask])
    assert picked.indices.dtype == torch.int32 and picked.values.dtype == torch.float64
