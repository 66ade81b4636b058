"""Reproducible synthetic gradients for the method tests, benches and fault campaign."""

from __future__ import annotations

import torch

__all__ = ["make_gradient"]


def make_gradient(n: int, rank: int, step: int, seed: int = 0, dtype=torch.float32,
                  kind: str = "normal") -> torch.Tensor:
    """A reproducible gradient for ``rank`` at ``step``: independent normal values (``kind="normal"``),
    or a shared smooth signal plus per-rank noise (``kind="correlated"``)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    noise = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "correlated":
        shared = torch.Generator().manual_seed(seed * 1_000_003 + step)
        noise = 0.3 * noise + torch.randn(n, generator=shared, dtype=torch.float64)
    elif kind != "normal":
        raise ValueError(f"kind={kind!r} must be 'normal' or 'correlated'")
    return noise.to(dtype)
