"""LARS, layer-wise adaptive rate scaling (You et al., 2017), as Shi et al. use it (MLSys 2021, eq. 11),
with the layer-wise rates optionally computed by PTO (:mod:`.pto`, section 4.2).

For each parameter tensor (layer) l with weights w and gradient g, eq. (11) gives the layer's rate
``lambda = gamma * eta * ||w|| / (||g|| + epsilon * ||w||)``: gamma is the trust coefficient, eta the
global learning rate and epsilon the weight decay. The update (momentum m, heavy ball)::

    v = m * v + lambda * (g + epsilon * w);    w = w - v

A layer whose weight or gradient norm is zero gets the plain rate eta (trust ratio 1), the usual
convention. ``exclude`` lists parameters (e.g. biases and batch-norm weights) updated with the plain
rate eta and no weight decay, as LARS implementations commonly do.

With ``comm=`` the trust ratios of the layers are computed by :func:`~.pto.parallel_apply`: each
rank computes the ratios of its contiguous share of the layers (balanced by element count) and the
scalars are all-gathered, so every rank applies the same update as without PTO.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..core.validate import check_number
from ..transport.comm import Communicator
from .pto import parallel_apply

__all__ = ["LARS", "trust_ratio"]


def trust_ratio(weight: torch.Tensor, grad: torch.Tensor, trust_coefficient: float,
                weight_decay: float) -> torch.Tensor:
    """``gamma * ||w|| / (||g|| + epsilon ||w||)`` of eq. (11) as a 0-d float32 tensor (1 where a norm is 0)."""
    w_norm = torch.linalg.vector_norm(weight.detach(), dtype=torch.float32)
    g_norm = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)
    ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm)
    return torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))


class LARS(torch.optim.Optimizer):
    """SGD with momentum and LARS layer-wise rates (eq. 11).

    Args:
        params: parameters or parameter groups, as for any ``torch.optim.Optimizer``.
        lr: eta, the global rate.
        momentum: m.
        weight_decay: epsilon (both in the ratio and added to the gradient).
        trust_coefficient: gamma.
        exclude: parameters updated with the plain rate (no trust ratio), e.g. biases.
        comm: a :class:`~sparsecomm.transport.Communicator`: compute the trust ratios with PTO over its
            ranks (every rank must hold the same weights and gradients, as after an all-reduce).
            ``None``: every rank computes all of them.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, *, exclude: Iterable[torch.Tensor] = (),
                 comm: Communicator | None = None) -> None:
        check_number("lr", lr, 0.0, strict=True)
        check_number("momentum", momentum, 0.0)
        check_number("weight_decay", weight_decay, 0.0)
        check_number("trust_coefficient", trust_coefficient, 0.0, strict=True)
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "trust_coefficient": trust_coefficient})
        self.comm = comm
        self._excluded = {id(p) for p in exclude}

    def _layers(self) -> list[tuple[dict, torch.Tensor]]:
        return [(group, p) for group in self.param_groups for p in group["params"]
                if p.grad is not None and id(p) not in self._excluded]

    def trust_ratios(self) -> list[torch.Tensor]:
        """The trust ratio of each non-excluded parameter with a gradient, in parameter order
        (computed with PTO when the optimizer has a ``comm``)."""
        layers = self._layers()
        coefficients = {id(p): (g["trust_coefficient"], g["weight_decay"]) for g, p in layers}

        def op(item: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
            weight, grad = item
            assert grad is not None  # _layers keeps parameters with a gradient
            gamma, epsilon = coefficients[id(weight)]
            return trust_ratio(weight, grad, gamma, epsilon)

        items = [(p, p.grad) for _, p in layers]
        if self.comm is None:
            return [op(item) for item in items]
        return parallel_apply(op, items, self.comm)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ratios = {id(p): r for (_, p), r in zip(self._layers(), self.trust_ratios(), strict=True)}
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                ratio = ratios.get(id(p))
                update = p.grad if weight_decay == 0 or ratio is None else p.grad.add(p, alpha=weight_decay)
                scale = lr if ratio is None else lr * ratio.to(p.device)
                state = self.state[p]
                if momentum > 0:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = torch.zeros_like(p)
                    buf.mul_(momentum).add_(update * scale)
                    p.sub_(buf)
                else:
                    p.sub_(update * scale)
        return loss
