"""Data-parallel training runs with a sparsecomm method: the logic behind ``sparsecomm train``.

:func:`train` runs P workers on this machine (:func:`sparsecomm.run_workers`, optionally on an
emulated network), or, under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set), this process as one rank
of the real cluster. Each worker trains the same model on its shard of the data (a seeded
``DistributedSampler``: the data order depends only on the seed and the epoch) and synchronizes
gradients by one of:

* ``sync="ddp"``: ``DistributedDataParallel`` with :func:`sparsecomm.integration.hook.hook`;
* ``sync="synchronizer"``: :class:`sparsecomm.integration.synchronizer.SparseSynchronizer` (needed for DGC
  momentum correction and local clipping);
* the baselines ``method="ddp"`` (plain DDP, the backend's all-reduce) and ``method="powersgd"``
  (DDP with torch's PowerSGD hook, Vogels et al. 2019);
* the floor ``method="nosync"``: DDP with torch's ``noop_hook`` (each rank keeps its local gradient,
  nothing is exchanged). The step keeps everything a comm hook's step does (DDP's reducer, its
  buckets, forward, backward, optimizer) but the exchange, so no synchronizing method can be faster:
  a method's step over this one is its cost. (``no_sync()`` would also skip the reducer's bucket work,
  which every hook pays, and so measure a floor below what any hook can reach.) The ranks' models
  drift apart: the run's accuracy is not a data-parallel one, only its step time is reported.

The result is a run record (a dict, saved as JSON by :func:`save_record`): the configuration, the
evaluation history (test accuracy against training wall time, excluding evaluation), per-epoch time
split into compute / select / communicate / decompress (from the method's stats), bytes per step
and actual density, and a per-step series for plots, and ``consistent``: whether the replicas'
parameters are equal, from every rank's checksum. Before the first step every rank checks that all
run the same configuration (:func:`agreed_config`). Checkpoints (per rank: model, optimizer,
synchronization state, RNG) are written at epoch ends through :class:`sparsecomm.CheckpointManager`
(an epoch counts once every rank has written it); a resumed run follows the trajectory of an
uninterrupted one exactly, and a job of another size resumes with the residuals redistributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.integration.auto import DECISIONS, DenseFallback
from sparsecomm.integration.consistency import check_same_config, replica_checksums
from sparsecomm.integration.hook import SparseHookState, hook
from sparsecomm.integration.schedule import MethodSchedule
from sparsecomm.integration.synchronizer import SparseSynchronizer
from sparsecomm.launch.launcher import STALL_TIMEOUT, run_workers
from sparsecomm.methods import MethodSpec, Stats, is_sparse, tracks_sent
from sparsecomm_lab import checkpoint
from sparsecomm_lab.data import Dataset, check_data_options, load_dataset
from sparsecomm_lab.diloco import LOCAL_BASELINES, local_synchronization
from sparsecomm_lab.models import MODEL_DEFAULTS, make_model, model_defaults

__all__ = ["TrainConfig", "train", "train_worker", "save_record", "shell_safe", "BASELINES", "FLOOR",
           "describe_method", "sparse_recipe", "recipe_density", "MOMENTUM_CORRECTION_RECIPES",
           "ADAMW_RECIPES", "DEFAULT_DENSITY", "model_optimizer"]

log = logging.getLogger(__name__)

#: method names handled by torch itself rather than a sparsecomm method
BASELINES = ("ddp", "powersgd", "nosync")
#: the no-synchronization floor (a baseline that exchanges nothing; see the module docstring)
FLOOR = "nosync"


LR_SCHEDULES = ("constant", "cosine")
#: the optimizers of a run: torch's SGD (with ``momentum``, ``nesterov``) and AdamW (``betas``, ``eps``);
#: both take ``weight_decay`` (AdamW's is decoupled, Loshchilov and Hutter 2019)
OPTIMIZERS = ("sgd", "adamw")

#: the density of a sparse run where its recipe names none (``--density`` overrides every recipe's)
DEFAULT_DENSITY = 0.01
#: the recipe for sparse methods on models without a measured momentum-correction recipe, and for
#: methods that do not report the indices they sent: the DDP comm hook with the optimizer's
#: momentum (error feedback in the method's residual), no dense warm-up, the cosine learning-rate
#: schedule (``lr_schedule="cosine"``, the default of ``sparsecomm train``; ``TrainConfig`` keeps
#: "constant" so that a run cut into epochs-limited pieces keeps its schedule), 1% density.
SPARSE_RECIPE: dict[str, Any] = {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 0,
                                 "freeze_adam_variance": False, "density": DEFAULT_DENSITY}
#: what a run whose model names no optimizer trains with: SGD with momentum 0.9, no weight decay
OPTIMIZER_DEFAULTS: dict[str, Any] = {"optimizer": "sgd", "momentum": 0.9, "betas": (0.9, 0.999),
                                      "weight_decay": 0.0, "warmup_steps": 0}
#: dense methods and the torch baselines: DDP, the optimizer's own momentum
DENSE_RECIPE: dict[str, Any] = {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 0,
                                "freeze_adam_variance": False, "density": DEFAULT_DENSITY}
#: DGC momentum correction (Lin et al. 2018, section 3.2) per model, where measured at the
#: campaign's budget (docs/training.md): its peak learning rate and density. Momentum factor masking
#: leaves an entry sent every step no momentum, hence the larger lr than momentum SGD's (3.0 =
#: 0.3 / (1 - 0.9) on the word LSTM, 0.02 against vgg-fc's 0.005); a lower density keeps more
#: entries' momentum: at 0.5% both models ended 3 epochs above their 1% runs and above DDP, and on
#: the word LSTM 0.1% ended lower still and reached the target as soon, over 3 seeds.
MOMENTUM_CORRECTION_RECIPES: dict[str, dict[str, float]] = {
    "word-lstm": {"lr": 3.0, "density": 0.001},
    "vgg-fc": {"lr": 0.02, "density": 0.005},
}


#: AdamW's recipe per model, where its campaign measured one (benchmarks/campaign-gpt): the
#: synchronizer with Adam's second moment frozen after a dense warm-up and DGC momentum correction in
#: the preconditioned space (sparsecomm.integration.adam), at the model's own learning rate. The DDP
#: hook under live AdamW falls far behind there: Adam's normalization undoes error feedback. The
#: warm-up is averaged in bfloat16 (half its bytes; the campaign trained the recipe so).
ADAMW_RECIPES: dict[str, dict[str, Any]] = {
    "gpt": {"density": 0.01, "dense_warmup_steps": 50, "dense_warmup_dtype": "bfloat16"},
}


def recipe_densities_text() -> str:
    """The recipe densities in words, for the CLI's help: per model under momentum correction (SGD)
    and under AdamW's recipe, and :data:`DEFAULT_DENSITY` for every other case."""
    per_model = ", ".join(f"{recipe['density']:g} on {model}" for model, recipe in MOMENTUM_CORRECTION_RECIPES.items())
    adamw = ", ".join(f"{recipe['density']:g} on {model}" for model, recipe in ADAMW_RECIPES.items())
    return (f"training.sparse_recipe: for TopkA-like methods under momentum correction {per_model}; "
            f"under AdamW's recipe {adamw}; else {DEFAULT_DENSITY:g}")


def model_optimizer(model: str, data: str | None = None) -> str:
    """The optimizer ``model`` trains with where the run names none (``"sgd"`` or ``"adamw"``)."""
    defaults = model_defaults(model, data) if model in MODEL_DEFAULTS else {}
    return str(defaults.get("optimizer", OPTIMIZER_DEFAULTS["optimizer"]))


def sparse_recipe(model: str, method: str, optimizer: str | None = None) -> dict[str, Any]:
    """The recommended recipe of the sparse ``method`` on ``model`` trained with ``optimizer`` (None:
    the model's, :func:`model_optimizer`; docs/training.md). Both recipes below need a method that
    reports the indices it sent (``tracks_sent``, for momentum factor masking); otherwise, and on
    models without one, :data:`SPARSE_RECIPE`.

    * AdamW, on a model of :data:`ADAMW_RECIPES`: the synchronizer with ``freeze_adam_variance`` and
      momentum correction, at the model's density and dense warm-up;
    * SGD, on a model of :data:`MOMENTUM_CORRECTION_RECIPES`: DGC momentum correction through the
      :class:`SparseSynchronizer` (momentum-free optimizer) at the model's lr and density.
    """
    optimizer = optimizer or model_optimizer(model)
    if tracks_sent(method):
        if optimizer == "adamw" and model in ADAMW_RECIPES:
            return {"sync": "synchronizer", "momentum_correction": True, "freeze_adam_variance": True,
                    **ADAMW_RECIPES[model]}
        if optimizer == "sgd" and model in MOMENTUM_CORRECTION_RECIPES:
            return {"sync": "synchronizer", "momentum_correction": True, "dense_warmup_steps": 0,
                    "freeze_adam_variance": False, **MOMENTUM_CORRECTION_RECIPES[model]}
    return dict(SPARSE_RECIPE)


def recipe_density(model: str, method: str, optimizer: str | None = None) -> float:
    """The density of ``method``'s recommended recipe on ``model`` (:func:`sparse_recipe`)."""
    return float(sparse_recipe(model, method, optimizer)["density"])


def scheduled_lr(config: TrainConfig, step: int, total_steps: int) -> float:
    """The learning rate of global step ``step`` (0-based): a linear warm-up over ``warmup_steps``
    (from ``lr / warmup_steps`` to ``lr``), then ``lr`` (``"constant"``) or a cosine decay to 0 over
    the remaining steps. A function of the step alone, so a resumed run continues the schedule exactly."""
    warmup = config.warmup_steps
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.lr_schedule == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))
    return config.lr


#: the half-precision dtypes a dense all-reduce may travel in (``dense_warmup_dtype``, ``ddp_dtype``)
HALF_DTYPES = ("bfloat16", "float16")
#: the dtypes of ``dense_warmup_dtype``: a half-precision one, or float32 (no cast, where a recipe
#: would choose bfloat16)
WARMUP_DTYPES = (*HALF_DTYPES, "float32")


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved in its record).

    ``method`` is a name (``"ddp"``, ``"powersgd"`` or a sparsecomm method, with ``density`` and
    ``method_options``) or a :class:`~sparsecomm.methods.MethodSpec`, which is split into those three
    fields here; :meth:`method_spec` gives the spec back.
    """

    model: str = "cnn"
    data: str = "digits"
    method: str = "dense"
    density: float = None  # type: ignore[assignment]  # None: the recipe's (DEFAULT_DENSITY where it names none)
    workers: int = 4
    # None: the model's tuned value on this data (models.MODEL_DEFAULTS), filled in by __post_init__
    epochs: int = None  # type: ignore[assignment]
    batch_size: int = None  # type: ignore[assignment]  # per worker
    lr: float = None  # type: ignore[assignment]
    lr_schedule: str = "constant"   # or "cosine" (the recipe; the CLI's default): lr * (1 + cos(pi * step / total)) / 2
    # None: the model's (models.MODEL_DEFAULTS), else SGD with momentum 0.9 and no weight decay
    optimizer: str = None  # type: ignore[assignment]  # "sgd" or "adamw"
    momentum: float = None  # type: ignore[assignment]  # SGD
    nesterov: bool = False   # SGD
    betas: tuple[float, float] = None  # type: ignore[assignment]  # AdamW
    eps: float = 1e-8        # AdamW
    weight_decay: float = None  # type: ignore[assignment]
    warmup_steps: int = None  # type: ignore[assignment]  # linear learning-rate warm-up (scheduled_lr)
    #: clip the global norm of the synchronized gradient (torch.nn.utils.clip_grad_norm_) before the
    #: optimizer's step; None: no clipping (``clip_norm`` is DGC's local clipping before synchronization)
    max_grad_norm: float | None = None
    #: the training budget in optimizer steps (the schedule spans it); None: ``epochs`` full epochs
    steps: int | None = None
    seed: int = 0
    net: str | None = None       # tc rate of the emulated network, None = loopback
    # None: the recommended recipe (sparse_recipe() for sparse methods, DENSE_RECIPE otherwise)
    sync: str = None  # type: ignore[assignment]  # "ddp" (comm hook) or "synchronizer"
    dense_warmup_steps: int = None  # type: ignore[assignment]
    clip_norm: float | None = None
    momentum_correction: bool = None  # type: ignore[assignment]
    density_warmup: int | None = None
    #: sync="local": inner steps per synchronization of the pseudo-gradient (H), and the outer optimizer
    #: (sparsecomm.LocalSteps: "nesterov" as DiLoCo, "sparseloco", "sgd"); method may then also be
    #: "diloco" or "postlocalsgd" (sparsecomm_lab.diloco)
    local_steps: int | None = None
    outer: str = "nesterov"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    error_decay: float | None = None
    #: Adam/AdamW under the synchronizer: freeze the second moment after the dense warm-up and
    #: synchronize the preconditioned gradient (sparsecomm.integration.adam)
    freeze_adam_variance: bool = None  # type: ignore[assignment]  # None: the recipe's
    #: time dense and sparse steps first and keep the method only where its steps are faster
    #: (the hook's and the synchronizer's dense_fallback: never slower than a dense all-reduce)
    dense_fallback: bool = False
    #: with dense_fallback: the decision to take after its probe whatever it measures ("method" or
    #: "dense"), so that the run's trajectory does not depend on the machine's load; None: measured
    dense_fallback_decision: str | None = None
    #: the dense warm-up (hook or synchronizer) all-reduced in this dtype ("bfloat16", "float16",
    #: "float32"); None: the recipe's (bfloat16 in AdamW's on gpt), else the gradient's
    dense_warmup_dtype: str | None = None
    #: method="ddp": DDP all-reduces the gradient in this dtype through torch's bf16_compress_hook (NCCL
    #: only) or fp16_compress_hook ("bfloat16", "float16"; None: the gradient's, DDP's default)
    ddp_dtype: str | None = None
    powersgd_rank: int = 2
    method_options: dict[str, Any] = field(default_factory=dict)
    schedule: str | None = None     # method switches "EPOCH:METHOD,...", e.g. "3:torus2d" (Shi et al. 5.6)
    model_options: dict[str, Any] = field(default_factory=dict)
    data_options: dict[str, Any] = field(default_factory=dict)
    evals_per_epoch: int = 1
    #: evaluate every this many steps (and after the last one) instead of ``evals_per_epoch`` per epoch
    eval_every: int | None = None
    target_accuracy: float | None = None
    target_perplexity: float | None = None  # language models: reached when exp(test loss) <= it
    #: end the run at the first evaluation that meets the target (its epoch's summary and checkpoint
    #: then cover the steps made)
    stop_at_target: bool = False
    checkpoint_dir: str | None = None
    #: continue from the checkpoint in checkpoint_dir (True), or "auto": when every rank has one,
    #: else start afresh (for torchrun's --max-restarts, which re-runs the same command line)
    resume: bool | str = False
    timeout: float = 3600.0
    #: seconds after which a rank that stopped taking part in collectives is reported, by name
    collective_timeout: float = STALL_TIMEOUT

    def __post_init__(self) -> None:
        if isinstance(self.method, MethodSpec):
            spec = self.method
            self.method = spec.name
            self.method_options = {key: value for key, value in spec.options.items() if key != "density"}
            if spec.density is not None:
                self.density = spec.density
        defaults = model_defaults(self.model, self.data) if self.model in MODEL_DEFAULTS else {}
        try:
            sparse = self.is_sparse
        except ValueError:  # an unknown model or method is reported by validate()
            sparse = False
        own_optimizer = model_optimizer(self.model, self.data)
        optimizer = self.optimizer or own_optimizer
        if self.lr is None and optimizer != own_optimizer and "lr" in defaults:
            raise ValueError(f"lr: {self.model}'s tuned learning rate ({defaults['lr']:g}) is {own_optimizer}'s; "
                             f"with optimizer={optimizer!r} give lr (the campaigns' grids: docs/training.md)")
        recipe = sparse_recipe(self.model, self.method, optimizer) if sparse else DENSE_RECIPE
        if recipe["momentum_correction"] and (self.sync in ("ddp", "local") or self.momentum_correction is False
                                              or self.freeze_adam_variance is False):
            recipe = SPARSE_RECIPE  # the caller chose the hook or the optimizer as it is: the model's own lr
        defaults = {**OPTIMIZER_DEFAULTS, **defaults, **recipe}
        for key, value in defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if isinstance(self.betas, list):  # from a JSON record
            self.betas = (float(self.betas[0]), float(self.betas[1]))

    def validate(self) -> None:
        """Reject bad options before any worker starts, naming the option and the rule."""
        if self.model not in MODEL_DEFAULTS:
            raise ValueError(f"model={self.model!r} is unknown; available: {', '.join(sorted(MODEL_DEFAULTS))}")
        check_data_options(self.data, self.data_options)
        if self.sync == "local":
            if not isinstance(self.local_steps, int) or self.local_steps < 1:
                raise ValueError(f"sync='local' needs local_steps >= 1 (got {self.local_steps!r})")
            if self.method in BASELINES:
                raise ValueError(f"method={self.method!r} is a DDP baseline; with sync='local' use a sparsecomm "
                                 f"method, 'diloco' or 'postlocalsgd'")
        if self.method not in BASELINES and not (self.sync == "local" and self.method in LOCAL_BASELINES):
            self.method_spec()  # unknown method or option, bad density: ValueError/TypeError naming them
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be an integer >= 1")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} must be one of {LR_SCHEDULES}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")
        if not (len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be a number > 0 or None")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"steps={self.steps!r} must be an integer >= 1 or None")
        if self.eval_every is not None and (not isinstance(self.eval_every, int) or self.eval_every < 1):
            raise ValueError(f"eval_every={self.eval_every!r} must be an integer >= 1 or None")
        if self.momentum_correction and self.optimizer != "sgd" and not self.freeze_adam_variance:
            raise ValueError("momentum_correction (DGC) moves the optimizer's momentum before compression: it needs "
                             "optimizer='sgd', or AdamW with freeze_adam_variance")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs={self.epochs!r} must be an integer >= 1")
        if self.sync not in ("ddp", "synchronizer", "local"):
            raise ValueError(f"sync={self.sync!r} must be 'ddp', 'synchronizer' or 'local'")
        if self.method in BASELINES and (self.sync != "ddp" or self.momentum_correction or self.clip_norm):
            raise ValueError(f"method={self.method!r} is a torch DDP baseline: it takes no synchronizer "
                             f"options (sync, momentum_correction, clip_norm)")
        needs_synchronizer = (self.momentum_correction or self.clip_norm or self.density_warmup is not None
                              or self.freeze_adam_variance)
        if needs_synchronizer and self.sync != "synchronizer":
            raise ValueError("momentum_correction, clip_norm, density_warmup and freeze_adam_variance need "
                             "sync='synchronizer'")
        if self.freeze_adam_variance and (self.optimizer != "adamw" or self.dense_warmup_steps < 1):
            raise ValueError("freeze_adam_variance needs optimizer='adamw' and dense_warmup_steps >= 1")
        if self.dense_warmup_dtype is not None and (self.dense_warmup_dtype not in WARMUP_DTYPES
                                                    or self.sync == "local" or self.method in BASELINES):
            raise ValueError(f"dense_warmup_dtype={self.dense_warmup_dtype!r} must be None or one of "
                             f"{', '.join(map(repr, WARMUP_DTYPES))}, with a sparsecomm method through the hook "
                             f"or the synchronizer (method={self.method!r}, sync={self.sync!r})")
        if self.ddp_dtype is not None and (self.ddp_dtype not in HALF_DTYPES or self.method != "ddp"):
            raise ValueError(f"ddp_dtype={self.ddp_dtype!r} must be None or one of "
                             f"{', '.join(map(repr, HALF_DTYPES))}, with method='ddp' (got {self.method!r})")
        if self.dense_fallback and (self.method in BASELINES or self.sync == "local"):
            raise ValueError(f"dense_fallback needs a sparsecomm method through the hook or the synchronizer "
                             f"(method={self.method!r}, sync={self.sync!r})")
        if self.dense_fallback_decision is not None and (self.dense_fallback_decision not in DECISIONS
                                                         or not self.dense_fallback):
            raise ValueError(f"dense_fallback_decision={self.dense_fallback_decision!r} must be None or one of "
                             f"{', '.join(map(repr, DECISIONS))}, with dense_fallback=True")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume={self.resume!r} must be True, False or 'auto'")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs checkpoint_dir")
        if not self.collective_timeout > 0:
            raise ValueError(f"collective_timeout={self.collective_timeout!r} must be a number of seconds > 0")
        if self.evals_per_epoch < 1:
            raise ValueError(f"evals_per_epoch={self.evals_per_epoch!r} must be >= 1")
        if self.schedule:
            if self.method in BASELINES:
                raise ValueError(f"schedule={self.schedule!r} switches sparsecomm methods; method={self.method!r} "
                                 f"is a torch DDP baseline")
            late = [epoch for epoch, _ in self.method_schedule().switches if epoch >= self.epochs]
            if late:
                raise ValueError(f"schedule={self.schedule!r} switches at epoch {late[0]}, but the run has only "
                                 f"epochs 0..{self.epochs - 1}")

    def method_schedule(self) -> MethodSchedule:
        """The method of each epoch: ``method`` from epoch 0, then the switches of ``schedule``."""
        return MethodSchedule.parse(self.method, self.schedule)

    @property
    def is_sparse(self) -> bool:
        return self.method not in BASELINES and self.method not in LOCAL_BASELINES and is_sparse(self.method)

    def warmup_dtype(self) -> torch.dtype | None:
        """The torch dtype of ``dense_warmup_dtype`` (None: the gradient's)."""
        return None if self.dense_warmup_dtype is None else getattr(torch, self.dense_warmup_dtype)

    def fallback(self) -> DenseFallback | None:
        """The ``dense_fallback=`` argument of the hook or the synchronizer (its decision pinned where
        ``dense_fallback_decision`` says)."""
        return DenseFallback(pinned=self.dense_fallback_decision) if self.dense_fallback else None

    def method_spec(self, method: str | None = None) -> MethodSpec:
        """The spec of ``method`` (default: the initial one; not a torch DDP baseline):
        ``method_options`` apply to the initial method; every sparse method gets ``density``."""
        name = self.method if method is None else method
        options = dict(self.method_options) if name == self.method else {}
        if is_sparse(name):
            options.setdefault("density", self.density)
        return MethodSpec(name, options)


def describe_method(config: TrainConfig) -> str:
    """A short label: ``spardl@0.01``, ``dense``, ``powersgd(r=2)``, ``ddp(bfloat16)``."""
    if config.method == "powersgd":
        return f"powersgd(r={config.powersgd_rank})"
    if config.method == "ddp" and config.ddp_dtype is not None:
        return f"ddp({config.ddp_dtype})"
    return f"{config.method}@{config.density:g}" if config.is_sparse else config.method


# ---------------------------------------------------------------------------------------------- worker
class _Synchronization:
    """Wraps the model for the configured synchronization; ``step()`` after backward."""

    def __init__(self, config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.config = config
        self.optimizer = optimizer
        self.state: Any = None
        self.synchronizer: SparseSynchronizer | None = None
        self.local: Any = None
        if config.sync == "local":
            assert config.local_steps is not None  # validate() requires it
            method = config.method if config.method in LOCAL_BASELINES else config.method_spec()
            self.local = local_synchronization(
                method, model, optimizer, local_steps=config.local_steps, outer=config.outer,
                outer_lr=config.outer_lr, outer_momentum=config.outer_momentum, error_decay=config.error_decay,
                warmup_steps=config.dense_warmup_steps if config.method == "postlocalsgd" else 0)
            self.module = self.local.module
            return
        if config.sync == "synchronizer":
            self.module = model
            self.synchronizer = SparseSynchronizer(
                model, optimizer, config.method_spec(), dense_warmup_steps=config.dense_warmup_steps,
                clip_norm=config.clip_norm,
                momentum_correction=(config.betas[0] if config.optimizer == "adamw" else config.momentum)
                if config.momentum_correction else None,
                dense_warmup_dtype=config.warmup_dtype(),
                density_warmup=config.density_warmup, freeze_adam_variance=config.freeze_adam_variance,
                dense_fallback=config.fallback())
            return
        if config.method == "powersgd":
            # One bucket: torch 2.13's powerSGD_hook aborts on gloo once a model spans >= 2 buckets.
            megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
            self.module = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=megabytes + 1)
        else:
            self.module = nn.parallel.DistributedDataParallel(model)
        if config.method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

            self.state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=config.powersgd_rank,
                                                start_powerSGD_iter=max(2, config.dense_warmup_steps),
                                                random_seed=config.seed)
            self.module.register_comm_hook(self.state, powersgd.powerSGD_hook)
        elif config.method == "ddp" and config.ddp_dtype is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            compress = default_hooks.bf16_compress_hook if config.ddp_dtype == "bfloat16" \
                else default_hooks.fp16_compress_hook
            self.module.register_comm_hook(None, compress)
        elif config.method == FLOOR:
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            self.module.register_comm_hook(None, noop_hook)
        elif config.method != "ddp":
            self.state = SparseHookState(None, config.method_spec(), dense_warmup_steps=config.dense_warmup_steps,
                                         dense_warmup_dtype=config.warmup_dtype(), dense_fallback=config.fallback())
            self.module.register_comm_hook(self.state, hook)

    def evaluation_model(self) -> Any:
        """A context giving the model to evaluate: the local replica, or under local steps the parameters
        every rank agrees on (the global ones)."""
        return self.local.evaluation_model() if self.local is not None else contextlib.nullcontext(self.local_model)

    def switch_method(self, method: str) -> None:
        """Synchronize with ``method`` from the next step on (a schedule's switch; residuals flushed)."""
        target = self.local if self.local is not None else self.synchronizer if self.synchronizer is not None \
            else self.state
        if target.method_name != method:
            target.switch_method(self.config.method_spec(method))

    @property
    def local_model(self) -> nn.Module:
        """The model itself (inside DDP's wrapper when DDP synchronizes)."""
        return self.module.module if isinstance(self.module, nn.parallel.DistributedDataParallel) else self.module

    def step(self, epoch: float) -> Stats:
        """Synchronize (the synchronizer; DDP did during backward), clip the synchronized gradient
        (``max_grad_norm``), then the optimizer's step."""
        if self.local is not None:  # it steps the inner optimizer itself
            return self.local.step(epoch)
        if self.synchronizer is not None:
            self.synchronizer.set_epoch(epoch)
            stats = self.synchronizer.synchronize()
            if not self.synchronizer.preconditioned:
                self._clip()  # (the frozen-variance step clips each rank's gradient locally: clip_norm)
            self.synchronizer.optimizer_step()
            return stats
        self._clip()
        self.optimizer.step()
        if isinstance(self.state, SparseHookState):
            return self.state.take_stats()
        return Stats(calls=0)  # torch's own DDP, PowerSGD and the no-op hook: not timed by sparsecomm

    def _clip(self) -> None:
        if self.config.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.local_model.parameters(), self.config.max_grad_norm)

    def fallback_state(self) -> dict[str, Any] | None:
        """``dense_fallback``'s decision and the step times it was taken on, or None without it."""
        engine = self.synchronizer.engine if self.synchronizer is not None else \
            self.state.engine if isinstance(self.state, SparseHookState) else None
        if engine is None or engine.dense_fallback is None:
            return None
        return engine.dense_fallback.state_dict()

    def state_dict(self) -> Any:
        if self.local is not None:
            return self.local.state_dict()
        if self.synchronizer is not None:
            return self.synchronizer.state_dict()
        if isinstance(self.state, SparseHookState):
            return self.state.state_dict()
        if self.state is not None:  # PowerSGDState: its own pickling drops the process group
            return {key: value for key, value in self.state.__getstate__().items()}
        return None

    def load_state_dict(self, state: Any) -> None:
        if self.local is not None:
            self.local.load_state_dict(state)
        elif self.synchronizer is not None:
            self.synchronizer.load_state_dict(state)
        elif isinstance(self.state, SparseHookState):
            self.state.load_state_dict(state)
        elif self.state is not None:
            for key, value in state.items():
                setattr(self.state, key, value)


class CombinedOptimizer:
    """Several optimizers stepped as one (AdamW for the dense parameters and SparseAdam for sparse
    embedding tables, as a PyTorch user combines them): ``param_groups`` is theirs, in order, so a
    learning-rate schedule that edits it reaches both."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            opt.load_state_dict(state)


def make_optimizer(config: TrainConfig, model: nn.Module) -> Any:
    """The run's optimizer over the model's parameters. Weight decay applies to the weight matrices,
    convolution kernels and embeddings only (parameters of two or more dimensions), as GPT-2's and
    most transformer recipes do; biases and normalization scales keep none. The tables of sparse
    embeddings (``nn.Embedding(sparse=True)``) get SparseAdam beside AdamW (SGD takes them as they are)."""
    sparse = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.sparse}
    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if id(p) not in sparse] if config.optimizer == "adamw" else params
    decayed = [p for p in dense if p.dim() >= 2 and id(p) not in sparse]
    groups = [{"params": decayed, "weight_decay": config.weight_decay},
              {"params": [p for p in dense if p.dim() < 2 or id(p) in sparse], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if config.optimizer == "adamw":
        adamw = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)
        tables = [p for p in params if id(p) in sparse]
        if not tables:
            return adamw
        return CombinedOptimizer([adamw, torch.optim.SparseAdam(tables, lr=config.lr, betas=config.betas,
                                                                eps=config.eps)])
    momentum = 0.0 if config.momentum_correction else config.momentum
    return torch.optim.SGD(groups, lr=config.lr, momentum=momentum, nesterov=config.nesterov and momentum > 0)


def _loss_and_correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str):
    logits = model(x)
    if task == "language-model":
        logits = logits.reshape(-1, logits.shape[-1])
        y = y.reshape(-1)
    loss = nn.functional.cross_entropy(logits, y)
    correct = int((logits.argmax(dim=1) == y).sum())
    return loss, correct, y.numel()


@torch.no_grad()
def _evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 512) -> dict[str, float]:
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(dataset.x_test), batch_size):
        x = dataset.x_test[start:start + batch_size]
        y = dataset.y_test[start:start + batch_size]
        loss, right, n = _loss_and_correct(model, x, y, dataset.task)
        total_loss += float(loss) * n
        correct += right
        count += n
    model.train()
    return {"test_loss": total_loss / count, "test_accuracy": 100.0 * correct / count}


def _evaluate_on_rank0(sync: _Synchronization, dataset: Dataset) -> dict[str, float]:
    """Rank 0 evaluates its replica (the local module: DDP's wrapper would start a collective for
    BatchNorm's buffers; under local steps, the global parameters) and tells the others: the
    replicas are identical, so one evaluation stands for all, and the other ranks leave the cores to it."""
    result: list[Any] = [None]
    with sync.evaluation_model() as model:
        if dist.get_rank() == 0:
            result[0] = _evaluate(model, dataset)
    dist.broadcast_object_list(result, src=0)
    return result[0]


#: options that may differ by rank (local paths, the launcher's limits): left out of the start-up agreement
PER_RANK_OPTIONS = ("checkpoint_dir", "timeout", "collective_timeout", "net")


def agreed_config(config: TrainConfig) -> dict[str, Any]:
    """What every rank must run alike (every option but :data:`PER_RANK_OPTIONS`), in the order of
    :class:`TrainConfig`'s fields: compared across ranks before the first step."""
    return {key: value for key, value in dataclasses.asdict(config).items() if key not in PER_RANK_OPTIONS}


def _checkpoint_meta(config: TrainConfig, world: int) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by ``config`` (checked by ``resume_checkpoint``)."""
    options = {} if config.method in BASELINES else dict(config.method_spec().options)
    return {"method": config.method, "options": options, "sync": config.sync,
            "model": config.model, "model_options": config.model_options, "data": config.data,
            "data_options": config.data_options, "seed": config.seed, "batch_size": config.batch_size,
            "world_size": world}


def train_worker(config: TrainConfig, dataset: Dataset,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 step_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One rank's training loop (call inside an initialized process group). Rank 0 returns the
    history; every rank returns its final parameters' checksum and, on request, the parameters.
    On rank 0, ``progress`` gets each epoch's summary and ``step_progress`` each step's
    ``{"epoch", "epochs", "step", "steps", "loss"}`` (1-based)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # Subnormal floats make CPU matrix products many times slower (a transformer's backward meets
    # them); flushing them to zero changes no result that matters and keeps steps at full speed.
    torch.set_flush_denormal(True)
    check_same_config(agreed_config(config), what="training configuration")
    manager = None if not config.checkpoint_dir else checkpoint.CheckpointManager(config.checkpoint_dir)
    torch.manual_seed(config.seed)
    model = make_model(config.model, dataset.info, **config.model_options)
    optimizer = make_optimizer(config, model)
    sync = _Synchronization(config, model, optimizer)
    train_set = dataset.train_set()
    sampler: torch.utils.data.DistributedSampler = torch.utils.data.DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=config.seed, drop_last=True)
    loader = torch.utils.data.DataLoader(train_set, batch_size=config.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ValueError(f"batch_size={config.batch_size} is larger than a worker's shard "
                         f"({len(sampler)} samples): lower it or use fewer workers")
    history: list[dict[str, Any]] = []
    epochs: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    train_time = 0.0
    start_epoch = 0
    torch.manual_seed(config.seed * 7919 + rank)
    schedule = config.method_schedule() if config.schedule else None
    resumed = None
    if config.resume:
        assert manager is not None  # validate() requires checkpoint_dir with resume
        resumed = checkpoint.resume(manager, _checkpoint_meta(config, world), required=config.resume is True)
        log.info("resume %s: %s", config.resume, "no checkpoint yet, starting afresh" if resumed is None
                 else f"from epoch {resumed.step}" + (" (another world size)" if resumed.resized else ""))
    if resumed is not None:
        saved = resumed.state  # this rank's own, or old rank 0's (the replicas') after a change of world size
        sync.local_model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if schedule is not None and saved["epoch"] > 0:  # the method that wrote the checkpoint's state
            sync.switch_method(schedule.method_at(saved["epoch"] - 1))
        if resumed.resized and config.method == "powersgd":
            raise checkpoint.CheckpointError("a change of world size redistributes the residuals of sparsecomm "
                                             "methods; torch's PowerSGD state cannot be redistributed")
        sync.load_state_dict([s["sync"] for s in resumed.states] if resumed.resized else saved["sync"])
        if not resumed.resized:
            torch.set_rng_state(saved["rng"])
        elif rank < len(resumed.states):  # a rank that joins keeps the seed of its rank
            torch.set_rng_state(resumed.states[rank]["rng"])
        start_epoch, train_time = saved["epoch"], saved["train_time"]
        history, epochs, steps = saved["history"], saved["epochs"], saved["steps"]
    total_steps = config.steps if config.steps is not None else config.epochs * steps_per_epoch
    if config.eval_every is not None:
        eval_steps = set(range(config.eval_every, total_steps + 1, config.eval_every)) | {total_steps}
    else:
        eval_steps = {epoch * steps_per_epoch + round(steps_per_epoch * (i + 1) / config.evals_per_epoch)
                      for epoch in range(math.ceil(total_steps / steps_per_epoch))
                      for i in range(config.evals_per_epoch)}
    reached = any(reached_target(h, config.target_accuracy, config.target_perplexity) for h in history)
    for epoch in range(start_epoch, math.ceil(total_steps / steps_per_epoch)):
        if config.stop_at_target and reached:  # a resumed run that had stopped there
            break
        sampler.set_epoch(epoch)
        if schedule is not None:
            sync.switch_method(schedule.method_at(epoch))
        sums = {"time_iter": 0.0, "loss": 0.0, "correct": 0, "count": 0}
        step_stats: list[Stats] = []
        for step, (x, y) in enumerate(loader, start=1):
            global_step = epoch * steps_per_epoch + step
            if global_step > total_steps:
                break
            begin = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(config, global_step - 1, total_steps)
            optimizer.zero_grad()
            loss, correct, count = _loss_and_correct(sync.module, x, y, dataset.task)
            loss.backward()
            stats = sync.step(epoch + step / steps_per_epoch)
            elapsed = time.perf_counter() - begin
            train_time += elapsed
            sums["time_iter"] += elapsed
            step_stats.append(stats)
            sums["loss"] += loss.item() * count
            sums["correct"] += correct
            sums["count"] += count
            if rank == 0 and step_progress is not None:
                step_progress({"epoch": epoch + 1, "epochs": config.epochs, "step": step,
                               "steps": steps_per_epoch, "loss": loss.item()})
            if rank == 0:
                steps.append({"step": epoch * steps_per_epoch + step, "time": elapsed,
                              "density": stats.density if stats.n else None,
                              "bytes_sent": stats.bytes_sent, "warmup": stats.warmup})
            if global_step in eval_steps:
                point = {"epoch": epoch + step / steps_per_epoch, "step": epoch * steps_per_epoch + step,
                         "train_time": train_time, **_evaluate_on_rank0(sync, dataset)}
                history.append(point)
                reached = reached or reached_target(point, config.target_accuracy, config.target_perplexity)
                if config.stop_at_target and reached:  # every rank has the point (rank 0's, broadcast)
                    break
        n_steps = len(step_stats)
        total = Stats.total(step_stats)
        summary = {
            "epoch": epoch + 1, "train_loss": sums["loss"] / sums["count"],
            "train_accuracy": 100.0 * sums["correct"] / sums["count"],
            "test_accuracy": history[-1]["test_accuracy"] if history else None,
            "test_loss": history[-1]["test_loss"] if history else None,
            "train_time": train_time, "time_per_step": sums["time_iter"] / n_steps,
            "time_compute": (sums["time_iter"] - total.time_total) / n_steps,
            "time_select": total.time_select / n_steps, "time_comm": total.time_comm / n_steps,
            "time_decompress": (total.time_decompress + total.time_other) / n_steps,
            "bytes_per_step": total.bytes_sent / n_steps,
            "density": total.density if total.n else None,
        }
        epochs.append(summary)
        if rank == 0 and progress is not None:
            progress(summary)
        if manager is not None:  # collective: the epoch counts once every rank has written it
            checkpoint.save(manager, epoch + 1,
                            {"model": sync.local_model.state_dict(), "optimizer": optimizer.state_dict(),
                             "sync": sync.state_dict(), "rng": torch.get_rng_state(), "epoch": epoch + 1,
                             "step": epoch * steps_per_epoch + n_steps, "train_time": train_time,
                             "history": history, "epochs": epochs, "steps": steps},
                            _checkpoint_meta(config, world))
    params = [p.detach().clone() for p in model.parameters()]
    # every rank's, so the record says whether the replicas are equal: the parameters alone, as DDP
    # leaves BatchNorm's running statistics per rank until its next forward broadcasts rank 0's
    checksums = replica_checksums(dict(model.named_parameters()))
    return {"rank": rank, "history": history, "epochs": epochs, "steps": steps if rank == 0 else [],
            "params": params, "steps_per_epoch": steps_per_epoch, "consistent": len(set(checksums)) == 1,
            "num_parameters": sum(p.numel() for p in params), "dense_fallback": sync.fallback_state()}


# ---------------------------------------------------------------------------------------------- driver
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_under_torchrun(timeout: datetime.timedelta) -> None:
    """``init_process_group`` for a torchrun worker, on a store prefix of its own per restart.

    torch 2.13's elastic agent re-runs the workers after a failure (``--max-restarts``) against the
    same agent store; there the restarted workers' gloo full-mesh connect read addresses left by the
    killed attempt and failed ("Gloo connectFullMesh failed ... Connection refused"; see
    docs/reliability.md, "Restart under torchrun"). A prefix that holds the restart count and the run
    id keeps every attempt's keys apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:  # a plain env:// launch
        dist.init_process_group("gloo", timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    store = dist.PrefixStore(f"sparsecomm/{run_id}/attempt{attempt}", client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def train(config: TrainConfig, progress: Callable[[dict[str, Any]], None] | None = None,
          keep_params: bool = False,
          step_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``config`` and return its run record (see the module docstring).

    Local workers by default; under torchrun this process is one rank, the record is returned on
    every rank (save it on rank 0) and its ``workers`` is torchrun's ``WORLD_SIZE``. With
    ``config.net`` set and no network emulation possible, the run falls back to loopback and the
    record's ``network`` says why.
    """
    config.validate()
    dataset = load_dataset(config.data, seed=config.seed, **config.data_options)
    started = datetime.datetime.now(datetime.timezone.utc)
    network = "loopback"
    if _under_torchrun():
        config = dataclasses.replace(config, workers=int(os.environ["WORLD_SIZE"]))
        if not dist.is_initialized():
            _init_under_torchrun(datetime.timedelta(seconds=config.collective_timeout))
        results = [train_worker(config, dataset, progress, step_progress)]
        network = f"torchrun cluster ({os.environ['WORLD_SIZE']} ranks)"
    else:
        net = config.net
        if net is not None:
            from sparsecomm.launch.netemu import unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                log.warning("net=%r cannot be emulated (%s): running on loopback", net, reason)
                network = f"loopback ({net} emulation unavailable: {reason})"
                net = None
            else:
                network = f"emulated {net} switch (tc tbf)"
        results = run_workers(config.workers, train_worker, config, dataset, progress, step_progress, net=net,
                              timeout=config.timeout, stall_timeout=config.collective_timeout)
    first = results[0]
    record = {
        "config": dataclasses.asdict(config),
        "label": describe_method(config),
        "network": network,
        "started": started.isoformat(timespec="seconds"),
        "host": {"hostname": socket.gethostname(), "python": platform.python_version(),
                 "torch": torch.__version__, "cpus": os.cpu_count()},
        "dataset": {"name": dataset.name, "train": len(dataset.x_train), "test": len(dataset.x_test),
                    "task": dataset.task},
        "num_parameters": first["num_parameters"],
        "steps_per_epoch": first["steps_per_epoch"],
        "history": first["history"],
        "epochs": first["epochs"],
        "steps": first["steps"],
        "final_accuracy": first["history"][-1]["test_accuracy"] if first["history"] else None,
        "time_to_target": time_to_target(first["history"], config.target_accuracy, config.target_perplexity),
        "consistent": first["consistent"],  # from every rank's parameter checksum (train_worker)
        "dense_fallback": first["dense_fallback"],  # its decision (every rank takes the same)
    }
    if keep_params:
        record["params"] = [r["params"] for r in results]
    return record


def reached_target(point: dict[str, Any], accuracy: float | None, perplexity: float | None = None) -> bool:
    """Whether the evaluation ``point`` meets the target: test accuracy at or above ``accuracy``,
    or test perplexity (exp of the mean test cross-entropy) at or below ``perplexity``."""
    if accuracy is not None and point["test_accuracy"] >= accuracy:
        return True
    return perplexity is not None and math.exp(min(point["test_loss"], 700.0)) <= perplexity


def time_to_target(history: list[dict[str, Any]], target: float | None,
                   perplexity: float | None = None) -> float | None:
    """Training wall time of the first evaluation that meets the target (:func:`reached_target`):
    accuracy ``target`` and/or ``perplexity``; None if never or no target is set."""
    for point in history:
        if reached_target(point, target, perplexity):
            return point["train_time"]
    return None


def shell_safe(name: str) -> str:
    """``name`` with every run of characters other than letters, digits, ``.``, ``_`` and ``-``
    replaced by one ``-``: ``powersgd(r=2)`` -> ``powersgd-r-2``, ``spardl@0.01`` -> ``spardl-0.01``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def save_record(record: dict[str, Any], directory: str = "runs", name: str | None = None) -> str:
    """Write ``record`` as JSON under ``directory``; returns the path."""
    os.makedirs(directory, exist_ok=True)
    if name is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg = record["config"]
        name = shell_safe(f"{stamp}-{cfg['model']}-{cfg['data']}-{record['label']}")
    path = os.path.join(directory, name if name.endswith(".json") else name + ".json")
    serializable = {key: value for key, value in record.items() if key != "params"}
    with open(path, "w") as handle:
        json.dump(serializable, handle, indent=1)
    return path
