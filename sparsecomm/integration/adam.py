"""Adam with its second moment frozen after a dense warm-up: sparse synchronization for Adam and AdamW.

Error feedback (each rank keeps what it did not send and adds it to its next gradient) conserves the
gradient: every element reaches the optimizer, late and in one piece. Adam then divides each element
by the root of a running mean of its squared gradient. An element that arrives once in a hundred
steps carrying a hundred steps' worth inflates that mean and moves about one step's worth: Adam's
normalization undoes what error feedback conserved, and a transformer trained with a sparse hook
under AdamW falls far behind the dense run at the same learning rate.

Freezing the second moment once a dense warm-up has estimated it makes Adam's step linear in the
gradient (an element the warm-up never saw a gradient for takes its parameter's median moment).
1-bit Adam (Tang et al., ICML 2021, Algorithm 1) and 0/1 Adam (Lu et al., ICLR 2023) freeze it to
compress Adam's momentum with one bit per element; here the compressor is any sparse method of
the library. After the warm-up (``s = 1 / (sqrt(v / (1 - beta2^T)) + eps)``, fixed per element):

1. each rank preconditions its gradient, ``u = s * g``, so that a top-k selects the elements whose
   *step* is largest, not whose gradient is (Adam moves a small-gradient element as far as a large one);
2. the method averages ``u`` with error feedback in that space; since ``s`` is fixed, the residual
   conserves every element's step exactly (the invariant the methods are tested against);
3. the momentum runs on the average ``u_avg`` and the step is AdamW's with the frozen ``v``::

       m = beta1 * m + (1 - beta1) * u_avg
       p = p * (1 - lr * weight_decay) - lr * m / (1 - beta1^t)

At density 1 this is exactly AdamW with ``v`` frozen at the end of the warm-up. The moments stay in
the optimizer's state (``exp_avg`` holds ``s * m`` from the freeze on, ``exp_avg_sq`` the frozen
``v``; ``step`` keeps counting), so ``optimizer.state_dict()`` and the learning-rate schedulers that
edit ``param_groups`` work unchanged; the step at which ``v`` froze is part of the synchronizer's
state dict.

With ``momentum_correction`` the momentum moves before the compression instead, as DGC does for SGD
(Lin et al., ICLR 2018, section 3.2): each rank keeps ``u = beta1 * u + (1 - beta1) * s * g``, the
method accumulates and sends ``u`` (its residual holds the velocity), ``u`` is zeroed where it was
sent (momentum factor masking), and the step is ``p = p * (1 - lr * weight_decay) - lr * u_avg``.
At density 1 every element is sent at every step, so the masking leaves no momentum: the step is
then the frozen-``v`` one without momentum, on ``(1 - beta1) * s * g`` (the recipe's dense twin).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FrozenVarianceAdam", "is_adam"]


def is_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torch's Adam or AdamW (subclasses included)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


class FrozenVarianceAdam:
    """The frozen-variance step of an Adam or AdamW optimizer over ``params`` (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Adam`` (without weight decay, whose coupled L2 term would enter
            the compressed gradient) or ``torch.optim.AdamW``; not ``amsgrad``, not ``maximize``.
        params: the parameters whose gradients are synchronized (each in one of its groups).

    Raises:
        ValueError: another optimizer, or an option this step does not implement.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 momentum_correction: bool = False) -> None:
        if not is_adam(optimizer):
            raise ValueError(f"freeze_adam_variance needs torch.optim.Adam or AdamW; got {type(optimizer).__name__}")
        group_of: dict[int, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            for option in ("amsgrad", "maximize"):
                if group.get(option):
                    raise ValueError(f"freeze_adam_variance does not implement {option}=True")
            coupled = not isinstance(optimizer, torch.optim.AdamW) and not group.get("decoupled_weight_decay")
            if coupled and group.get("weight_decay"):
                raise ValueError("freeze_adam_variance with torch.optim.Adam needs weight_decay=0 (Adam's L2 term "
                                 "would be compressed with the gradient); use torch.optim.AdamW")
            for param in group["params"]:
                group_of[id(param)] = group
        missing = [i for i, p in enumerate(params) if id(p) not in group_of]
        if missing:
            raise ValueError(f"freeze_adam_variance: the synchronized parameter #{missing[0]} is not in the optimizer")
        self.optimizer = optimizer
        self.momentum_correction = momentum_correction
        self.params = list(params)
        self.groups = [group_of[id(p)] for p in self.params]
        #: the optimizer step at which the second moment froze (None: not yet)
        self.frozen_at: int | None = None
        self._scales: list[Tensor] = []

    @property
    def frozen(self) -> bool:
        return self.frozen_at is not None

    def freeze(self) -> None:
        """Freeze each parameter's second moment as the warm-up left it, and carry the momentum over
        to the preconditioned space (``exp_avg`` becomes ``s * exp_avg``)."""
        steps = {self._step_of(p) for p in self.params}
        if len(steps) != 1 or 0 in steps:
            raise RuntimeError("freeze_adam_variance: every parameter needs the same number (>= 1) of optimizer "
                               f"steps before the freeze (the dense warm-up); found {sorted(steps)}")
        self.frozen_at = steps.pop()
        self._scales = [self._scale(p, g) for p, g in zip(self.params, self.groups, strict=True)]
        with torch.no_grad():
            for param, scale in zip(self.params, self._scales, strict=True):
                self.optimizer.state[param]["exp_avg"].mul_(scale)

    def _step_of(self, param: nn.Parameter) -> int:
        state = self.optimizer.state.get(param, {})
        step = state.get("step", 0)
        return int(step.item() if isinstance(step, Tensor) else step)

    def _scale(self, param: nn.Parameter, group: dict[str, Any]) -> Tensor:
        """``1 / (sqrt(v / (1 - beta2^T)) + eps)`` at the frozen step T.

        An element whose gradient was zero at every warm-up step (an embedding row no batch touched)
        has ``v = 0``: no estimate of its scale, and ``1 / eps`` would make its first step enormous.
        It takes its parameter's median ``v`` over the elements that have one (a function of the
        optimizer's state alone, so every rank and every resume computes the same scale)."""
        assert self.frozen_at is not None
        v = self.optimizer.state[param]["exp_avg_sq"]
        correction = 1.0 - group["betas"][1] ** self.frozen_at
        v = v / correction
        untouched = v == 0
        if untouched.any() and not untouched.all():
            v = torch.where(untouched, v[~untouched].median(), v)
        return v.sqrt_().add_(group["eps"]).reciprocal_()

    def precondition_(self, pieces: Iterable[tuple[int, Tensor]]) -> None:
        """Multiply, in place, each (parameter index, gradient piece) by that parameter's ``s`` (and, with
        momentum correction, by ``1 - beta1``: the velocity then accumulates as Adam's first moment)."""
        for index, piece in pieces:
            piece.mul_(self._scales[index].reshape(piece.shape))
            if self.momentum_correction:
                piece.mul_(1.0 - self.groups[index]["betas"][0])

    def beta1(self) -> float:
        """The first-moment factor of the optimizer (one for all its groups, as momentum correction keeps
        one velocity per bucket)."""
        betas = {group["betas"][0] for group in self.groups}
        if len(betas) != 1:
            raise ValueError(f"freeze_adam_variance with momentum_correction needs one beta1 in every group; "
                             f"found {sorted(betas)}")
        return betas.pop()

    @torch.no_grad()
    def step(self) -> None:
        """AdamW's step with the frozen second moment, from the preconditioned averages in ``param.grad``."""
        for param, group in zip(self.params, self.groups, strict=True):
            if param.grad is None:
                continue
            state = self.optimizer.state[param]
            step = state["step"]
            step += 1  # a tensor in torch's Adam: counted in place as Adam does
            t = int(step.item() if isinstance(step, Tensor) else step)
            if not isinstance(step, Tensor):
                state["step"] = step
            lr = group["lr"]
            if group["weight_decay"]:
                param.mul_(1.0 - lr * group["weight_decay"])
            if self.momentum_correction:  # the momentum is in the averaged velocity already
                param.add_(param.grad, alpha=-lr)
                continue
            beta1 = group["betas"][0]
            exp_avg = state["exp_avg"]
            exp_avg.mul_(beta1).add_(param.grad, alpha=1.0 - beta1)
            param.add_(exp_avg, alpha=-lr / (1.0 - beta1 ** t))

    def state_dict(self) -> dict[str, Any]:
        return {"frozen_at": self.frozen_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the freeze (load the optimizer's own state dict first: ``s`` is recomputed from its
        ``exp_avg_sq``)."""
        frozen_at = state.get("frozen_at")
        if frozen_at is not None and (not isinstance(frozen_at, int) or frozen_at < 1):
            raise ValueError(f"frozen_at={frozen_at!r} in the state dict must be a step number >= 1 or None")
        self.frozen_at = frozen_at
        self._scales = [] if frozen_at is None else [self._scale(p, g) for p, g in zip(self.params, self.groups,
                                                                                          strict=True)]
