"""What the campaign trains: the workloads, the configurations compared on each ("arms") and the
learning-rate grid every arm shares.

A **workload** is a model and its data trained for a fixed budget of optimizer steps with the
optimizer its users run (AdamW for the transformer, SGD with momentum for the CNN), evaluated every
``eval_every`` steps. An **arm** is one way to synchronize it: torch's DDP, PowerSGD, a sparse method
through the DDP hook or the synchronizer with a recipe, the no-synchronization floor. Every arm of a
workload trains at every learning rate of the workload's grid for its optimizer (log-spaced around
the dense default; one grid per optimizer where a workload compares two), so that no row is tuned
harder than another; the floor exchanges nothing and is only timed. A workload with a ``note``
departs from this (one learning rate, or one seed) and its report says how.

An arm with ``dense_fallback`` is a policy: after a short probe it keeps the method or falls back to
the dense all-reduce, by step times it measures, so its trajectory depends on the link it runs on.
Its convergence runs are therefore its two **branches**, each with the decision pinned
(:func:`branches`), each tuned on the grid like any arm; its timing run on each network measures the
decision there, and its row on that network is the branch it took, at that branch's best lr (a user
tunes on the cluster where the policy decides).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from sparsecomm_lab.training import FLOOR, TrainConfig

__all__ = ["Workload", "Arm", "WORKLOADS", "ARMS", "SEEDS", "arms_of", "workload", "branches", "trained_arms",
           "BRANCH_NAMES"]

#: the seeds of the headline figures (each arm's best learning rate runs every one)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Workload:
    """A model, its data, its optimizer family and its budget. ``metric`` is ``"loss"`` (validation
    cross-entropy, lower is better) or ``"accuracy"`` (%, higher is better)."""

    name: str
    model: str
    data: str
    metric: str
    steps: int
    eval_every: int
    #: the learning rates every arm of an optimizer trains at, by optimizer ("sgd", "adamw")
    lr_grids: dict[str, tuple[float, ...]]
    #: the arm whose recipe the campaign recommends for this workload (the headline row)
    recommended: str
    data_options: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    #: TrainConfig fields every arm of the workload shares (optimizer options, clipping)
    train_options: dict[str, Any] = field(default_factory=dict)
    #: the seeds each arm's best learning rate trains with (the headline figures' median is over them)
    seeds: tuple[int, ...] = SEEDS
    #: the workload whose model, data and budget this one shares (a comparison run on a subset of arms)
    note: str = ""

    def optimizer(self, arm: Arm) -> str:
        """The optimizer ``arm`` trains with: its own, else the workload's (the first of its grids)."""
        return str(arm.options.get("optimizer") or self.train_options.get("optimizer") or next(iter(self.lr_grids)))

    def grid(self, arm: Arm) -> tuple[float, ...]:
        """The learning rates ``arm`` trains at: the grid of its optimizer (an exploration arm's own)."""
        return arm.explore_lrs if arm.explore_lrs is not None else self.lr_grids[self.optimizer(arm)]

    def seeds_of(self, arm: Arm) -> tuple[int, ...]:
        """The seeds ``arm``'s best learning rate trains with (an exploration arm: seed 0 alone)."""
        return (0,) if arm.explore_lrs is not None else self.seeds

    def config(self, arm: Arm, lr: float, seed: int, **overrides: Any) -> TrainConfig:
        """The run of ``arm`` at ``lr`` and ``seed`` (``overrides``: the network, a shorter budget)."""
        options: dict[str, Any] = {"model": self.model, "data": self.data, "steps": self.steps,
                                   "eval_every": self.eval_every, "lr_schedule": "cosine", "lr": lr, "seed": seed,
                                   "data_options": dict(self.data_options),
                                   "model_options": dict(self.model_options), **self.train_options,
                                   **arm.options}
        options.update(overrides)
        return TrainConfig(**options)


@dataclass(frozen=True)
class Arm:
    """One configuration compared on a workload: ``options`` are :class:`TrainConfig` fields
    (method, density, sync, recipe switches). ``kind`` groups the rows: ``floor``, ``dense`` (torch's
    DDP), ``powersgd``, ``sparse``; ``dense_twin`` names the dense arm with the same optimizer where a
    sparse recipe changes the optimizer (its share of the result is then visible)."""

    name: str
    kind: str
    description: str
    options: dict[str, Any]
    dense_twin: str | None = None
    #: an exploration arm: these learning rates and seed 0 only, instead of the grid and the seeds
    #: (the report marks it; it is not tuned as the others are and makes no headline)
    explore_lrs: tuple[float, ...] | None = None

    @property
    def timed_only(self) -> bool:
        """The floor: its ranks train apart, so only its step time is a result."""
        return self.kind == "floor"

    @property
    def is_policy(self) -> bool:
        """A ``dense_fallback`` arm whose decision is measured: trained as its :func:`branches`."""
        return bool(self.options.get("dense_fallback")) and self.options.get("dense_fallback_decision") is None


#: the name suffix of each branch of a policy arm, by the decision it pins
BRANCH_NAMES = {"method": "kept", "dense": "fell-back"}


def branches(arm: Arm) -> dict[str, Arm]:
    """The two branches of a policy arm (:attr:`Arm.is_policy`), by decision: the method kept after
    the probe, and the dense all-reduce from the probe's end on. Each is an arm of its own (named
    ``<arm>-kept``, ``<arm>-fell-back``), trained on the grid and the seeds like any other."""
    if not arm.is_policy:
        raise ValueError(f"arm {arm.name!r} has no dense_fallback decision to branch on")
    return {decision: Arm(f"{arm.name}-{suffix}", arm.kind if decision == "method" else "dense",
                          f"{arm.name} with its decision pinned to {decision!r}"
                          + (" (the method kept)" if decision == "method" else " (dense after the probe)"),
                          {**arm.options, "dense_fallback_decision": decision}, explore_lrs=arm.explore_lrs)
            for decision, suffix in BRANCH_NAMES.items()}


def trained_arms(arms: list[Arm]) -> list[Arm]:
    """The arms the convergence phase trains: ``arms`` with each policy replaced by its branches, the
    floor left out."""
    out: list[Arm] = []
    for arm in arms:
        if arm.is_policy:
            out += branches(arm).values()
        elif not arm.timed_only:
            out.append(arm)
    return out


_FLOOR = Arm("floor", "floor", "no synchronization: DDP with torch's no-op hook (the step no exchange can beat)",
             {"method": FLOOR})
_DDP = Arm("ddp", "dense", "torch DDP (all-reduce)", {"method": "ddp"})
#: DDP with torch's fp16_compress_hook: half the bytes, as the recipe's warm-up in bfloat16 (torch's
#: bf16_compress_hook needs NCCL)
_DDP_HALF = Arm("ddp-fp16", "dense", "torch DDP with fp16_compress_hook (the gradient all-reduced in float16)",
                {"method": "ddp", "ddp_dtype": "float16"})
_POWERSGD = [Arm(f"powersgd-r{r}", "powersgd", f"torch's powerSGD_hook, rank {r} (one bucket)",
                 {"method": "powersgd", "powersgd_rank": r}) for r in (2, 4)]

#: the DDP comm hook with the optimizer as it is (error feedback in the method's residual)
_HOOK: dict[str, Any] = {"sync": "ddp", "momentum_correction": False, "dense_warmup_steps": 0}

#: the dense warm-up of the frozen-variance recipe: Adam's second moment is estimated over it
FVA_WARMUP = 50
#: the dtype the GPT's frozen-variance arms average their dense warm-up in
GPT_WARMUP_DTYPE = "bfloat16"


def _explore(arm: Arm, lr: float = 1e-3) -> Arm:
    """``arm`` as a density exploration: one learning rate (the recommended arm's best), seed 0."""
    return dataclasses.replace(arm, explore_lrs=(lr,), description=arm.description + " (exploration: one lr, "
                               "one seed)")


def _fva(method: str, density: float | None, name: str, twin: str | None, corrected: bool = False,
         clip_norm: float | None = 1.0, warmup_dtype: str | None = None) -> Arm:
    """The frozen-variance AdamW recipe through the synchronizer (``clip_norm``: the workload's clipping,
    applied by the synchronizer after the exchange in place of the harness's; ``warmup_dtype``: the
    dtype the dense warm-up is averaged in, None for the gradient's)."""
    options: dict[str, Any] = {"method": method, "sync": "synchronizer", "freeze_adam_variance": True,
                               "momentum_correction": corrected, "dense_warmup_steps": FVA_WARMUP,
                               "dense_warmup_dtype": warmup_dtype, "clip_norm": clip_norm, "max_grad_norm": None}
    if density is not None:
        options["density"] = density
    what = "dense all-reduce" if density is None else f"{method} at {density:g}"
    how = " and DGC momentum correction with masking" if corrected else ""
    warmup = f"{FVA_WARMUP} dense steps" + ("" if warmup_dtype is None else f" (averaged in {warmup_dtype})")
    dense = density is None or density == 1
    return Arm(name, "dense" if dense else "sparse",
               f"{what}, AdamW with the second moment frozen after {warmup}{how} "
               "(synchronizer, freeze_adam_variance)", options, dense_twin=twin)


#: the GPT's frozen-variance arms: their dense warm-up averaged in GPT_WARMUP_DTYPE
_gpt_fva = functools.partial(_fva, warmup_dtype=GPT_WARMUP_DTYPE)


def _local(method: str, steps: int, density: float | None = None, outer: str = "nesterov") -> Arm:
    """Local steps: ``steps`` inner AdamW steps per synchronization of the pseudo-gradient
    (sparsecomm.LocalSteps; DiLoCo's outer Nesterov SGD, lr 0.7, momentum 0.9), or torch's post-local SGD."""
    options: dict[str, Any] = {"sync": "local", "local_steps": steps, "method": method, "outer": outer,
                               "momentum_correction": False}
    if method == "postlocalsgd":
        options["dense_warmup_steps"] = FVA_WARMUP
        return Arm(f"postlocalsgd-H{steps}", "local", f"torch's post-local SGD: DDP for {FVA_WARMUP} steps, then "
                   f"the parameters averaged every {steps} steps (PostLocalSGDOptimizer)", options)
    if method == "diloco":
        return Arm(f"diloco-H{steps}", "local", f"DiLoCo: {steps} inner AdamW steps, the dense pseudo-gradient "
                   "all-reduced, outer Nesterov SGD (lr 0.7, momentum 0.9)", options)
    options["density"] = density
    if outer == "sgd":  # the error-fed sparse average of the pseudo-gradients applied as it is (outer lr 1)
        return Arm(f"{method}-local-H{steps}@{density:g}-sgd", "local",
                   f"{steps} inner AdamW steps, the pseudo-gradient by {method} at {density:g} with error feedback, "
                   "applied by plain SGD (outer lr 1, no momentum)", options)
    return Arm(f"{method}-local-H{steps}@{density:g}", "local",
               f"{steps} inner AdamW steps, the pseudo-gradient by {method} at {density:g} with error feedback, "
               f"outer Nesterov SGD as DiLoCo's", options)


def _adamw(name: str, kind: str, description: str, **options: Any) -> Arm:
    return Arm(name, kind, description, {"optimizer": "adamw", **options})


#: the arms of each workload, in table order
ARMS: dict[str, list[Arm]] = {
    # the recipe's dense warm-up travels in bfloat16 (half the bytes of its 50 dense steps) in every
    # frozen-variance arm, so that the twins differ from each other only in what they name
    "gpt": [
        _FLOOR, _DDP, _DDP_HALF, *_POWERSGD,
        _gpt_fva("dense", None, "dense-fva", None),
        Arm("topka-hook@0.01", "sparse", "topka at 1% through the DDP hook, AdamW on the averaged gradient",
            {"method": "topka", "density": 0.01, **_HOOK}),
        _gpt_fva("topka", 0.01, "topka-fva@0.01", "dense-fva"),
        _gpt_fva("topka", 1.0, "topka-fvamc@1", None, corrected=True),
        _gpt_fva("topka", 0.01, "topka-fvamc@0.01", "topka-fvamc@1", corrected=True),
        _explore(_gpt_fva("topka", 0.001, "topka-fvamc@0.001", "topka-fvamc@1", corrected=True)),
        _explore(_gpt_fva("topka", 0.1, "topka-fva@0.1", "dense-fva")),
        _explore(_gpt_fva("topka", 0.03, "topka-fva@0.03", "dense-fva")),
        _explore(_gpt_fva("topka", 0.1, "topka-fvamc@0.1", "topka-fvamc@1", corrected=True)),
        _explore(_gpt_fva("topka", 0.03, "topka-fvamc@0.03", "topka-fvamc@1", corrected=True)),
    ],
    # local steps against per-step synchronization, on the GPT's budget (one lr, one seed: see WORKLOADS)
    "gpt-local": [
        _FLOOR, _DDP,
        _fva("topka", 0.01, "topka-fvamc@0.01", None, corrected=True),
        *[_local("diloco", h) for h in (4, 16, 64)],
        *[_local("topka", h, 0.01) for h in (4, 16, 64)],
        *[_local("topka", h, 0.01, outer="sgd") for h in (4, 16)],
        *[_local("postlocalsgd", h) for h in (4, 16, 64)],
    ],
    # the gradient is mostly a word embedding of which a step touches a few rows: the baselines a user
    # tries first are AdamW and nn.Embedding(sparse=True) (DDP all-gathers the touched rows)
    "word-lstm": [
        _FLOOR,
        _adamw("ddp", "dense", "torch DDP, AdamW", method="ddp"),
        _adamw("ddp-sparse-embedding", "dense", "torch DDP with nn.Embedding(sparse=True), AdamW + SparseAdam",
               method="ddp", model_options={"sparse_embedding": True}),
        _adamw("topka-hook@0.01", "sparse", "topka at 1% through the DDP hook, AdamW", method="topka", density=0.01,
               **_HOOK),
        # the AdamW recipe the library recommends, and its dense twin (the workload does not clip)
        _fva("dense", None, "dense-fva", None, clip_norm=None),
        _fva("topka", 0.01, "topka-fvamc@0.01", "dense-fva", corrected=True, clip_norm=None),
    ],
    # a BatchNorm CNN trained with SGD and momentum: DDP broadcasts BatchNorm's buffers every step; its
    # step is compute-bound on loopback, where the dense fallback must not be slower than DDP
    "resnet": [
        _FLOOR, _DDP, *_POWERSGD,
        Arm("topka-hook@0.01", "sparse", "topka at 1% through the DDP hook, SGD with momentum (error feedback)",
            {"method": "topka", "density": 0.01, **_HOOK}),
        Arm("topka-hook-auto@0.01", "sparse", "the same with dense_fallback: dense all-reduce where topka's steps "
            "are not a fifth shorter", {"method": "topka", "density": 0.01, **_HOOK, "dense_fallback": True}),
    ],
}

#: the workloads, with their budgets (cosine schedules over them) and learning-rate grids
WORKLOADS: dict[str, Workload] = {
    "gpt": Workload("gpt", "gpt", "python-source", "loss", steps=600, eval_every=30,
                    lr_grids={"adamw": (3e-4, 1e-3, 3e-3, 1e-2)}, recommended="topka-fvamc@0.01",
                    train_options={"optimizer": "adamw", "max_grad_norm": 1.0}),
    "gpt-local": Workload("gpt-local", "gpt", "python-source", "loss", steps=600, eval_every=30,
                          lr_grids={"adamw": (1e-3,)}, recommended="topka-local-H4@0.01-sgd",
                          train_options={"optimizer": "adamw", "max_grad_norm": 1.0}, seeds=(0,),
                          note="every arm at the inner lr that DDP's grid found best on the GPT, one seed: the "
                          "local-step arms are compared with each other and with DDP at equal tuning"),
    "word-lstm": Workload("word-lstm", "word-lstm", "fortunes-words", "loss", steps=300, eval_every=20,
                          lr_grids={"adamw": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)},
                          recommended="topka-hook@0.01", data_options={"test_size": 200},
                          train_options={"optimizer": "adamw", "weight_decay": 0.0, "warmup_steps": 0},
                          note="no PowerSGD or SGD rows: the two baselines a user of this model tries "
                          "first (DDP with AdamW, and with sparse embeddings) against the sparse hook and the "
                          "library's AdamW recipe (without clipping, as the workload's other arms)"),
    # one epoch of the 60,000 images at 4 x 32 per step; the grid brackets every arm's best (0.01 was added
    # when the sparse and PowerSGD arms did best at 0.03, the first grid's edge)
    "resnet": Workload("resnet", "resnet", "fashion-mnist", "accuracy", steps=469, eval_every=47,
                       lr_grids={"sgd": (0.01, 0.03, 0.1, 0.3, 1.0)}, recommended="topka-hook-auto@0.01",
                       data_options={"test_size": 2000}, train_options={"optimizer": "sgd"}),
}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def arms_of(name: str, only: list[str] | None = None) -> list[Arm]:
    """The arms of workload ``name`` (``only``: those names, in table order; unknown ones refused)."""
    arms = ARMS[workload(name).name]
    if only is None:
        return list(arms)
    known = {a.name for a in arms}
    unknown = [a for a in only if a not in known]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown} for workload {name!r}; available: {', '.join(sorted(known))}")
    return [a for a in arms if a.name in only]
