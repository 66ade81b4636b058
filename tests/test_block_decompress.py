"""Decompression of results made of whole blocks (OmniReduce, S2 Reducer) and the count-sketch kernels:
the C paths (:func:`sparsecomm.transport.merge.average_blocks_into`, ``CountSketch.insert`` /
``query_blocks``) give the bits of the torch paths that build the index of every element, and the
methods give the same bits with the C kernels as without them, over several calls and P = 1..8."""

import pytest
import torch

import sparsecomm.transport.merge as merge
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import make_method
from sparsecomm.selection.sketch import CountSketch
from sparsecomm.transport.merge import GroupMask, average_blocks_into, average_into

pytestmark = pytest.mark.skipif(not merge.compiled(), reason="the C merge is not built")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int64)


def _elements(blocks, size, n, values):
    elements = blocks.long().unsqueeze(1) * size + torch.arange(size)
    inside = elements < n
    return elements[inside], values.reshape(-1, size)[inside]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("size, n", [(32, 10_000), (256, 100_003), (7, 999), (1, 50)])
def test_average_blocks_into_matches_average_into_over_calls(dtype, index_dtype, size, n):
    gen = torch.Generator().manual_seed(size + n)
    nb = -(-n // size)
    outs = [torch.full((n,), 5.0, dtype=dtype) for _ in range(2)]  # 0: blocks, 1: every element
    stales = [None, None]
    for call, (stale_kind, keep_sign, divisor) in enumerate(
            [("all", True, 4), ("mask", False, 3), ("mask", True, 1), ("tensor", True, 8), ("mask", False, 5)]):
        count = 0 if call == 4 else int(torch.randint(1, nb + 1, (1,), generator=gen))
        blocks = torch.sort(torch.randperm(nb, generator=gen)[:count]).values
        if call == 2:
            blocks = torch.arange(nb)  # the short last block included
        values = torch.randint(-2, 3, (count if call != 2 else nb, size), generator=gen).to(dtype) * 0.5
        values[values == 0] = -0.0 if call % 2 else 0.0
        idx, vals = _elements(blocks, size, n, values)
        results = []
        for which in range(2):
            if stale_kind == "all":
                stale = "all"
            elif stale_kind == "tensor":
                stale = stales[which].indices() if isinstance(stales[which], GroupMask) else stales[which]
            else:
                stale = stales[which]
            if which == 0:
                written, nonzero = average_blocks_into(outs[0], blocks.to(index_dtype), size, values, divisor,
                                                       stale=stale, keep_sign=keep_sign)
            else:
                written, nonzero = average_into(outs[1], [idx.to(index_dtype)], [vals], divisor, stale=stale,
                                                keep_sign=keep_sign)
            stales[which] = written
            results.append((written, nonzero))
        assert torch.equal(_bits(outs[0]), _bits(outs[1])), call
        assert results[0][1] == results[1][1] == int(outs[1].count_nonzero())
        assert torch.equal(results[0][0].words, results[1][0].words)


def test_average_blocks_into_refuses_a_block_outside():
    out = torch.zeros(100)
    with pytest.raises(IndexError):
        average_blocks_into(out, torch.tensor([0, 4]), 32, torch.ones(2, 32), 1)


@pytest.mark.parametrize("variant", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("n, rows, cols, size, dtype", [
    (1000, 3, 7, 32, torch.float32), (100_003, 3, 300, 32, torch.float32), (5000, 1, 64, 16, torch.float64),
    (77_777, 5, 50, 7, torch.float32), (3000, 4, 5, 32, torch.float64), (70_000, 2, 3, 32, torch.float32),
    (50_000, 3, 4000, 20, torch.float32), (33_333, 3, 2 ** 20, 48, torch.float32),  # lanes and a rest
    (2 ** 20, 3, 49, 32, torch.float32),  # x * (1 / 49) rounds below the quotient for half of 49's multiples
    (2 ** 33 + 5, 3, 1000, 32, torch.float32)])  # the last: keys past 32 bits
def test_sketch_kernels_give_the_bits_of_the_torch_hashes(n, rows, cols, size, dtype, variant):
    if variant not in merge.sketch_variants():
        pytest.skip(f"this CPU does not run the {variant} sketch kernels")
    gen = torch.Generator().manual_seed(rows * cols)
    for seed in range(4):
        sketch = CountSketch(n, rows, cols, seed=seed)
        limit = min(n, 10 ** 6)
        idx = torch.sort(torch.randperm(limit, generator=gen)[:min(limit, 4000) - seed]).values
        if seed % 2:
            idx = idx.to(torch.int32)  # the kernels read 32- and 64-bit indices
        values = torch.randn(idx.numel(), generator=gen, dtype=dtype) if seed == 1 else \
            torch.randint(-2, 3, (idx.numel(),), generator=gen).to(dtype) * 0.5  # ties and zeros
        table = sketch.empty_table(dtype)
        assert merge.sketch_insert(sketch._keys(), table, idx, values, variant=variant)
        reference = sketch.empty_table(dtype)
        buckets, signs = sketch.hashes(idx)
        for row in range(rows):
            reference[row].index_add_(0, buckets[row], values * signs[row].to(dtype))
        assert torch.equal(_bits(table), _bits(reference))
        if seed == 2:  # signed zeros and NaNs among the estimates
            table[:, ::3] = -0.0
            if rows > 2:
                table[:, 1::5] = float("nan")
        blocks = torch.sort(torch.randperm(-(-limit // size), generator=gen)[:500]).values
        if seed % 2:
            blocks = blocks.to(torch.int32)
        estimates = merge.sketch_query_blocks(sketch._keys(), table, blocks, size, n, variant=variant)
        elements = blocks.long().unsqueeze(1) * size + torch.arange(size)
        inside = elements < n
        expected = torch.zeros_like(estimates)
        expected[inside] = sketch.query(table, elements[inside])
        assert torch.equal(_bits(estimates), _bits(expected))


def test_sketch_kernels_refuse_a_variant_this_cpu_lacks():
    with pytest.raises(ValueError, match="variant='sse9' does not run here"):
        merge.sketch_query_blocks(CountSketch(100, 3, 7, seed=0)._keys(), torch.zeros(3, 7), torch.tensor([0]),
                                  32, 100, variant="sse9")


def _outputs(name, n, densities, compiled):
    import torch.distributed as dist
    if not compiled:
        merge._compiled = None  # every merge and sketch kernel takes its torch path
    rank, found = dist.get_rank(), []
    for density in densities:
        method = make_method(name, density=density)
        out = torch.empty(n)
        for call in range(4):
            grad = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + call))
            if call == 2:
                grad[: n // 3] = 0
            result = method(grad) if call == 1 else method(grad, out=out)
            found.append((_bits(result).clone(), _bits(method.residual).clone(), method.stats.nnz_out,
                          torch.sort(method.last_sent).values.clone()))
    return found


@pytest.mark.parametrize("name", ["s2reducer", "omnireduce"])
@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_block_methods_give_the_bits_of_the_torch_paths(name, P):
    n = 20_011
    fast = run_workers(P, _outputs, name, n, [0.01, 0.2, 1.0], True, timeout=300)
    slow = run_workers(P, _outputs, name, n, [0.01, 0.2, 1.0], False, timeout=300)
    for mine, theirs in zip(fast, slow, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] and torch.equal(a[3], b[3])
