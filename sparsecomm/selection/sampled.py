"""DGC-style sampled top-k (Lin et al., Deep Gradient Compression; the baseline of Shi et al. Fig. 6).

A threshold is read off a strided sample of ``|x|`` with a random offset; the elements above it are
gathered in one pass; when too few come out the threshold is lowered and the pass repeated (DGC's
adaptation), and when more than ``k`` come out the top-k among them is kept (DGC's hierarchical
selection). The count therefore lies in ``[ceil(lower * k), k]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..core.validate import check_int
from .base import Selector
from .registry import register_selector
from .scan import MagnitudeView, Scratch

__all__ = ["DGC"]


@register_selector("dgc_sampled")
class DGC(Selector):
    """DGC sampled top-k: count in ``[ceil(lower * k), k]``; the picks are the largest ``|x|``.

    Args:
        sample_ratio: fraction of ``x`` in the sample (DGC's default 0.01).
        lower: accept a count down to ``lower * k``; below it the threshold is multiplied by ``lower``
            and the pass repeated (DGC's ``compress_lower_bound``, 0.8).
        max_adaptations: passes before giving up on the threshold and taking the exact top-k (10).
        seed: seed of the generator that places the sample (its state is in ``state_dict``).
    """

    def __init__(self, *, sample_ratio: float = 0.01, lower: float = 0.8, max_adaptations: int = 10,
                 seed: int = 0, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"dgc: sample_ratio must lie in (0, 1], got {sample_ratio!r}")
        if not 0.0 < lower < 1.0:
            raise ValueError(f"dgc: lower must lie in (0, 1), got {lower!r}")
        check_int("dgc: max_adaptations", max_adaptations, minimum=0)
        self.sample_ratio = float(sample_ratio)
        self.lower = float(lower)
        self.max_adaptations = max_adaptations
        self.generator = torch.Generator().manual_seed(int(seed))
        self._scratch = Scratch()

    def _sample_threshold(self, x: Tensor, k: int) -> float:
        n = x.numel()
        stride = max(1, int(1.0 / self.sample_ratio))
        offset = int(torch.randint(0, min(stride, n), (1,), generator=self.generator))
        sample = x[offset::stride].abs()
        rank = max(1, math.ceil(k * sample.numel() / n))
        return float(torch.topk(sample, rank, sorted=False).values.min())

    def select(self, x: Tensor, k: int) -> Tensor:
        least = math.ceil(self.lower * k)
        threshold = self._sample_threshold(x, k)
        view = self._view(x, threshold, k, check_finite=self.check_finite)
        for _ in range(self.max_adaptations):
            if view.n_candidates >= least:
                break
            threshold *= self.lower
            view = self._view(x, threshold, k)
        if view.n_candidates < least:
            view = self._view(x, 0.0, k)
        if view.n_candidates > k and view.floor is not None:
            return view.topk_at_or_above(view.floor, k)
        assert view.indices is not None  # a view with a floor holds its candidates
        return view.indices

    def _view(self, x: Tensor, threshold: float, k: int, check_finite: bool = False) -> MagnitudeView:
        """The elements ``|x| >= threshold`` (the input is checked by the first view only)."""
        return MagnitudeView(x, self._scratch, threshold, name=self.name, check_finite=check_finite, count=k,
                             need_mean=False)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
