"""Local-step training in the harness: sparse pseudo-gradients (:class:`sparsecomm.LocalSteps`) and the
two local-step baselines, DiLoCo and torch's post-local SGD, behind the interface of the training
loop's synchronization (``module``, ``local_model``, ``step(epoch) -> Stats``, ``state_dict``,
``load_state_dict``).

* ``method="diloco"``: DiLoCo (Douillard et al. 2023, Algorithm 1): :class:`sparsecomm.LocalSteps`
  with the dense method and the outer SGD with Nesterov momentum (lr 0.7, momentum 0.9 unless given).
  torchft's ``DiLoCo`` installs beside torch 2.13 but needs its ``Manager``, which joins a quorum
  through a lighthouse server and reconfigures its own process groups; it does not run on a plain
  ``torch.distributed`` process group, so this one is ours, tested step by step against a direct
  transcription of the paper's algorithm (tests/test_local_steps.py).
* ``method="postlocalsgd"``: torch's post-local SGD (Lin et al. 2020): DDP with
  ``post_localSGD_hook`` (``PostLocalSGDState``: every gradient all-reduced for the first
  ``warmup_steps`` steps, none afterwards, ``post_local_gradient_allreduce=False``, since each worker
  here is its own node and has no intra-node group to average with) and ``PostLocalSGDOptimizer``
  wrapping the inner optimizer with a ``PeriodicModelAverager`` (the parameters averaged every
  ``local_steps`` steps after the warm-up).
* any sparsecomm method (a name or a :class:`~sparsecomm.methods.MethodSpec`): :class:`sparsecomm.LocalSteps`
  with that method on the pseudo-gradient and the outer optimizer ``outer`` (``"nesterov"``,
  ``"sparseloco"``, ``"sgd"``).

The harness builds one with :func:`local_synchronization` from its configuration, calls
``step(epoch)`` after ``backward()`` in place of ``optimizer.step()`` (it steps the inner optimizer
itself), and evaluates ``with sync.evaluation_model() as model:``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from sparsecomm.integration.local_steps import LocalSteps
from sparsecomm.methods import MethodSpec, Stats

__all__ = ["LOCAL_BASELINES", "LocalStepsSynchronization", "PostLocalSGDSynchronization", "local_synchronization",
           "local_label"]

#: The local-step baselines by name (beside any sparsecomm method on the pseudo-gradient).
LOCAL_BASELINES = ("diloco", "postlocalsgd")


class LocalStepsSynchronization:
    """:class:`sparsecomm.LocalSteps` for the training loop: ``step()`` is one inner step, and every
    ``local_steps``-th also synchronizes (its stats are the method calls'; ``calls=0`` otherwise)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, method: MethodSpec | str, *,
                 local_steps: int, outer: str = "nesterov", **options: Any) -> None:
        self.module = model
        self.local = LocalSteps(model, optimizer, method, local_steps=local_steps, outer=outer, **options)

    @property
    def local_model(self) -> nn.Module:
        return self.module

    def step(self, epoch: float) -> Stats:
        self.local.step()
        return self.local.last_stats

    def evaluation_model(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model to evaluate: the global parameters, those every rank agrees on."""
        return self.local.global_model()

    def switch_method(self, method: str) -> None:
        raise ValueError(f"local steps keep one method for the pseudo-gradient; cannot switch to {method!r}")

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local.load_state_dict(state)


class PostLocalSGDSynchronization:
    """torch's post-local SGD: ``warmup_steps`` steps of DDP, then the parameters averaged every
    ``local_steps`` steps (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``). Its all-reduces
    are torch's, not metered by sparsecomm: ``step`` returns ``Stats(calls=0)`` as for plain DDP."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, local_steps: int,
                 warmup_steps: int = 0) -> None:
        import torch.distributed.algorithms.model_averaging.averagers as averagers
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        if not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps={local_steps!r} must be an integer >= 1")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0")
        self.module = nn.parallel.DistributedDataParallel(model)
        self.state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup_steps,
                                       post_local_gradient_allreduce=False)
        self.module.register_comm_hook(self.state, post_localSGD_hook)
        self.averager = averagers.PeriodicModelAverager(period=local_steps, warmup_steps=warmup_steps)
        self.optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=self.averager)

    @property
    def local_model(self) -> nn.Module:
        return self.module.module

    def step(self, epoch: float) -> Stats:
        self.optimizer.step()
        return Stats(calls=0)

    @contextlib.contextmanager
    def evaluation_model(self) -> Iterator[nn.Module]:
        """The model to evaluate: this rank's replica (the ranks' average exists only right after an
        averaging step; computing it elsewhere would cost an all-reduce the method does not make)."""
        yield self.module

    def switch_method(self, method: str) -> None:
        raise ValueError(f"post-local SGD has no method to switch; cannot switch to {method!r}")

    def state_dict(self) -> dict[str, Any]:
        return {"averager_step": self.averager.step, "hook_iter": self.state.iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averager.step = int(state["averager_step"])
        self.state.iter = int(state["hook_iter"])


def local_synchronization(method: MethodSpec | str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                          local_steps: int, outer: str = "nesterov", outer_lr: float | None = None,
                          outer_momentum: float | None = None, error_decay: float | None = None,
                          warmup_steps: int = 0) -> LocalStepsSynchronization | PostLocalSGDSynchronization:
    """The synchronization of a local-step run: ``method`` is ``"diloco"``, ``"postlocalsgd"`` or a
    sparsecomm method (name or spec) for the pseudo-gradient. ``warmup_steps`` (synchronous steps
    before the local ones) is post-local SGD's; DiLoCo and sparse local steps refuse one."""
    if method == "postlocalsgd":
        if (outer, outer_lr, outer_momentum, error_decay) != ("nesterov", None, None, None):
            raise ValueError("post-local SGD averages the parameters: it takes no outer optimizer options")
        return PostLocalSGDSynchronization(model, optimizer, local_steps=local_steps, warmup_steps=warmup_steps)
    if warmup_steps:
        raise ValueError(f"warmup_steps={warmup_steps!r}: only post-local SGD has synchronous warm-up steps")
    options = {key: value for key, value in
               (("outer_lr", outer_lr), ("outer_momentum", outer_momentum), ("error_decay", error_decay))
               if value is not None}
    if method == "diloco":
        if outer != "nesterov":
            raise ValueError(f"outer={outer!r}: DiLoCo's outer optimizer is SGD with Nesterov momentum")
        return LocalStepsSynchronization(model, optimizer, "dense", local_steps=local_steps, outer="nesterov",
                                         **options)
    return LocalStepsSynchronization(model, optimizer, method, local_steps=local_steps, outer=outer, **options)


def local_label(method: MethodSpec | str, local_steps: int, outer: str = "nesterov") -> str:
    """A run label: ``diloco-H16``, ``postlocalsgd-H16``, ``topka@0.01-H16-sparseloco``."""
    if method in LOCAL_BASELINES:
        return f"{method}-H{local_steps}"
    name = method.label() if isinstance(method, MethodSpec) else str(method)
    return f"{name}-H{local_steps}-{outer}"
