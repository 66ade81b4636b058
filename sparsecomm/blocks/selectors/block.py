"""Block-wise top-K by L2 norm, S2 Reducer (Sparse-Sketch Reducer) section 2.2.

The vector is cut into consecutive blocks of ``block_size`` elements (the last may be shorter); the
blocks with the largest L2 norm are selected whole. ``ceil(k / block_size)`` blocks are taken, one
more if the short last block is among them and the count fell below ``k``, so the count lies in
``[k, k + block_size - 1]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...core.validate import check_int
from .base import Selector, assert_finite
from .exact import TopK
from .registry import register_selector

__all__ = ["BlockTopK"]


@register_selector("block_topk")
class BlockTopK(Selector):
    """Whole blocks with the largest L2 norm: count in ``[k, k + block_size - 1]``.

    Args:
        block_size: elements per block (default 32).
    """

    def __init__(self, *, block_size: int = 32, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        check_int("block_topk: block_size", block_size, minimum=1)
        self.block_size = block_size
        self._squares: Tensor | None = None
        self._block_topk = TopK(check_finite=False)

    def block_energies(self, x: Tensor) -> Tensor:
        """Squared L2 norm of each block (float32 for half-precision input, which could overflow)."""
        dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        buf = self._squares
        if buf is None or buf.numel() != x.numel() or buf.dtype != dtype or buf.device != x.device:
            self._squares = buf = torch.empty(x.numel(), dtype=dtype, device=x.device)
        torch.square(x.to(dtype), out=buf)
        full = x.numel() // self.block_size
        energies = buf[: full * self.block_size].view(full, self.block_size).sum(1)
        if full * self.block_size < x.numel():
            energies = torch.cat([energies, buf[full * self.block_size:].sum().reshape(1)])
        return energies

    def select(self, x: Tensor, k: int) -> Tensor:
        n, size = x.numel(), self.block_size
        energies = self.block_energies(x)
        if self.check_finite and not math.isfinite(float(energies.sum())):
            assert_finite(x, self.name)  # raises on NaN/Inf; a finite input only overflowed the sum
        n_blocks = math.ceil(k / size)
        blocks = self._block_topk(energies, n_blocks)
        short = (size - n % size) % size  # elements the last block lacks
        if short and n_blocks * size - short < k and bool((blocks == energies.numel() - 1).any()):
            blocks = self._block_topk(energies, n_blocks + 1)
        offsets = torch.arange(size, dtype=torch.int64, device=x.device)
        indices = (blocks.unsqueeze(1) * size + offsets).flatten()
        return indices[indices < n] if n % size else indices
