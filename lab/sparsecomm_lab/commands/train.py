"""``sparsecomm train``: data-parallel training with a sparse method; progress per step and epoch; a
run record (JSON) under runs/. Local workers by default; under torchrun, the real cluster (its
``WORLD_SIZE`` is P, and only rank 0 prints).

Every option is checked by :func:`check` before any worker starts (the CLI turns its ``ValueError``
into a one-line ``error:`` and exit status 2), the output folders included (``--runs-dir``,
``--checkpoint-dir``: writable); a record that still cannot be written after the training is saved
in the temporary folder, and the command says where. Every rank checks at start-up that all ranks
run the same configuration (:func:`sparsecomm_lab.training.agreed_config`), and checkpoints are
committed only once every rank has written them (:class:`sparsecomm.CheckpointManager`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from sparsecomm.cli.outputs import check_writable, save_or_fallback
from sparsecomm.launch.launcher import STALL_TIMEOUT
from sparsecomm.launch.netemu import emulated_net
from sparsecomm_lab.data import DatasetUnavailable, available_datasets
from sparsecomm_lab.models import MODEL_DATA, available_models
from sparsecomm_lab.progress import Progress
from sparsecomm_lab.training import BASELINES, TrainConfig, recipe_densities_text, save_record, train

HELP = "train a model with sparse gradient synchronization and write a run record under runs/"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4,
                        help="local worker processes (under torchrun: its WORLD_SIZE)")
    parser.add_argument("--model", default="cnn", choices=available_models())
    parser.add_argument("--data", default=None, choices=available_datasets(),
                        help="data set (default: the model's first: " +
                             ", ".join(f"{m}: {d[0]}" for m, d in MODEL_DATA.items()) + ")")
    parser.add_argument("--method", default="spardl",
                        help="a sparsecomm method (sparsecomm.available_methods()) or a torch baseline: "
                             f"{', '.join(BASELINES)}")
    parser.add_argument("--density", type=float, default=None,
                        help=f"default: the recipe's ({recipe_densities_text()})")
    parser.add_argument("--net", default=None, help="emulated network: a tc rate in bits per second such as 1gbit "
                        "or 100mbit, or NODESxLOCAL:RATE, or loopback (the default)")
    parser.add_argument("--epochs", type=int, default=None, help="default: the model's tuned value (MODEL_DEFAULTS)")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker; default: the model's tuned value")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate; default: the model's tuned value (under momentum correction: "
                        "the recipe's, training.MOMENTUM_CORRECTION_RECIPES)")
    parser.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine",
                        help="cosine decays the learning rate to 0 over the run")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default=None,
                        help="default: the model's (adamw for gpt, else sgd)")
    parser.add_argument("--momentum", type=float, default=None, help="SGD's momentum (default: 0.9)")
    parser.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum")
    parser.add_argument("--betas", default=None, help="AdamW's betas, e.g. 0.9,0.95 (default: the model's)")
    parser.add_argument("--weight-decay", type=float, default=None, help="default: the model's (AdamW: decoupled)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear learning-rate warm-up steps before the schedule (default: the model's)")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip the synchronized gradient's global norm before the optimizer's step")
    parser.add_argument("--steps", type=int, default=None, help="a budget in optimizer steps instead of --epochs")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", choices=["ddp", "synchronizer", "local"], default=None,
                        help="DDP with the comm hook, SparseSynchronizer (needed for the DGC and Adam options), or "
                        "local steps (sparsecomm.LocalSteps; --method may then be diloco or postlocalsgd); "
                        "default: the recommended recipe (training.sparse_recipe, docs/training.md)")
    parser.add_argument("--local-steps", type=int, default=None, help="with --sync local: inner steps per sync")
    parser.add_argument("--outer", choices=["nesterov", "sparseloco", "sgd"], default="nesterov",
                        help="with --sync local: the outer optimizer")
    parser.add_argument("--freeze-adam-variance", action=argparse.BooleanOptionalAction, default=None,
                        help="AdamW under the synchronizer: freeze the second moment after the dense warm-up; "
                        "default: the recipe's (on for topka-like methods on gpt with AdamW, else off)")
    parser.add_argument("--dense-fallback", action="store_true",
                        help="keep the method only where its steps are at least a fifth shorter than dense ones")
    parser.add_argument("--dense-fallback-decision", choices=["method", "dense"], default=None,
                        help="with --dense-fallback: take this decision after the probe whatever it measures "
                        "(a run that does not depend on the machine's load)")
    parser.add_argument("--dense-warmup-steps", type=int, default=None,
                        help="default: the recipe's (50 under AdamW's recipe on gpt, else 0)")
    parser.add_argument("--dense-warmup-dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="all-reduce the dense warm-up in this dtype (a sparsecomm method; default: the "
                        "recipe's, bfloat16 under AdamW's recipe on gpt, else the gradient's)")
    parser.add_argument("--ddp-dtype", choices=["bfloat16", "float16"], default=None,
                        help="with --method ddp: all-reduce the gradient in this dtype (torch's bf16_compress_hook "
                        "or fp16_compress_hook)")
    parser.add_argument("--clip-norm", type=float, default=None, help="local gradient clipping (synchronizer)")
    parser.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=None,
                        help="DGC momentum correction (synchronizer); default: the recipe's (on for topka-like "
                        "methods on word-lstm and vgg-fc with SGD and on gpt with AdamW, else off)")
    parser.add_argument("--density-warmup", type=int, default=None, help="DGC density warm-up epochs (synchronizer)")
    parser.add_argument("--schedule", default=None,
                        help="method switches EPOCH:METHOD[,EPOCH:METHOD...], e.g. 13:torus2d: --method runs "
                             "until the first (Shi et al. 5.6; docs/hook-and-synchronizer.md)")
    parser.add_argument("--method-options", default="{}", help='JSON dict of method options, e.g. \'{"teams": 2}\'')
    parser.add_argument("--train-size", type=int, default=None, help="subset of the training set (fashion-mnist, zipf)")
    parser.add_argument("--evals-per-epoch", type=int, default=1)
    parser.add_argument("--target-accuracy", type=float, default=None, help="record the time to reach it")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save per-rank checkpoints here at each epoch's end (an epoch counts once every rank "
                             "has written it)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, choices=[True, "auto"], metavar="auto",
                        help="continue from the newest epoch every rank holds in --checkpoint-dir (also from a job "
                             "of another size: the residuals are redistributed); '--resume auto': start afresh "
                             "when there is none (for torchrun --max-restarts)")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--collective-timeout", type=float, default=STALL_TIMEOUT,
                        help="seconds after which a rank that stopped taking part in collectives is reported "
                             f"by name (process group timeout and worker heartbeat; default {STALL_TIMEOUT:g})")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_rank0() -> bool:
    """False on the ranks of a torchrun job other than 0 (which print nothing but errors)."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0


def parse_method_options(text: str, method: str) -> dict[str, Any]:
    """``--method-options`` JSON -> dict, checked against ``method``'s keyword arguments."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--method-options {text!r} is not valid JSON ({err.msg} at column {err.colno}); "
                         "write a JSON object such as '{\"teams\": 2}'") from None
    if not isinstance(options, dict):
        raise ValueError(f"--method-options {text!r} must be a JSON object such as '{{\"teams\": 2}}'")
    if method in BASELINES:
        if options:
            raise ValueError(f"--method {method} is a torch DDP baseline and takes no --method-options "
                             f"(got {sorted(options)})")
        return options
    from sparsecomm.core.validate import UnknownOptionError
    from sparsecomm.methods import check_method_options

    try:
        check_method_options(method, options)
    except UnknownOptionError as err:
        raise ValueError(f"--method-options: {err}") from None
    return options


def parse_betas(text: str | None) -> Any:
    """``--betas 0.9,0.95`` -> (0.9, 0.95); None stays None (the model's)."""
    if text is None:
        return None
    try:
        first, second = (float(b) for b in text.split(","))
    except ValueError:
        raise ValueError(f"--betas {text!r} must be two numbers separated by a comma, e.g. 0.9,0.95") from None
    return first, second


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's configuration; under torchrun, P is its ``WORLD_SIZE`` (``--workers`` is ignored).
    Options left at None take TrainConfig's (the model's) defaults."""
    data_options = {} if args.train_size is None else {"train_size": args.train_size}
    workers = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.workers
    given = {key: getattr(args, key) for key in ("epochs", "batch_size", "lr") if getattr(args, key) is not None}
    return TrainConfig(
        model=args.model, data=args.data or MODEL_DATA[args.model][0], method=args.method,
        density=args.density, workers=workers, lr_schedule=args.lr_schedule, momentum=args.momentum,
        optimizer=args.optimizer, nesterov=args.nesterov, weight_decay=args.weight_decay,
        betas=parse_betas(args.betas),
        warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm, steps=args.steps,
        eval_every=args.eval_every, local_steps=args.local_steps, outer=args.outer,
        freeze_adam_variance=args.freeze_adam_variance, dense_fallback=args.dense_fallback,
        dense_fallback_decision=args.dense_fallback_decision, dense_warmup_dtype=args.dense_warmup_dtype,
        ddp_dtype=args.ddp_dtype,
        seed=args.seed, net=emulated_net(args.net), sync=args.sync,
        dense_warmup_steps=args.dense_warmup_steps, clip_norm=args.clip_norm,
        momentum_correction=args.momentum_correction, density_warmup=args.density_warmup,
        method_options=parse_method_options(args.method_options, args.method), data_options=data_options,
        evals_per_epoch=args.evals_per_epoch, target_accuracy=args.target_accuracy,
        checkpoint_dir=args.checkpoint_dir, resume=args.resume, collective_timeout=args.collective_timeout,
        schedule=args.schedule, **given)


def check(args: argparse.Namespace) -> None:
    """Every option, before any worker starts (ValueError naming the option and the valid values)."""
    from sparsecomm.launch.netemu import parse_net
    from sparsecomm.methods import available_methods
    from sparsecomm_lab.diloco import LOCAL_BASELINES

    local = LOCAL_BASELINES if args.sync == "local" else ()
    if args.method not in BASELINES and args.method not in local and args.method not in available_methods():
        raise ValueError(f"unknown method {args.method!r}; valid names: "
                         f"{', '.join(list(BASELINES) + available_methods())}")
    fits = MODEL_DATA.get(args.model, [])
    if args.data is not None and args.data not in fits:
        raise ValueError(f"--model {args.model} does not fit --data {args.data}; it trains on: {', '.join(fits)}")
    check_writable(args.runs_dir, "--runs-dir")  # before the training: a record that cannot be written is lost
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir, "--checkpoint-dir")
    config = config_from_args(args)
    config.validate()
    if config.net is not None:
        parse_net(config.net, config.workers)
    args.config = config


def print_progress(summary) -> None:
    density = "-" if summary["density"] is None else f"{summary['density']:.4f}"
    print(f"epoch {summary['epoch']:3d}  loss {summary['train_loss']:.4f}  test acc {summary['test_accuracy']:6.2f}%  "
          f"step {1e3 * summary['time_per_step']:7.1f} ms = compute {1e3 * summary['time_compute']:6.1f} + "
          f"select {1e3 * summary['time_select']:5.1f} + comm {1e3 * summary['time_comm']:6.1f} + "
          f"decompress {1e3 * summary['time_decompress']:5.1f}  "
          f"{summary['bytes_per_step'] / 1e3:8.1f} kB/step  density {density}", flush=True)


class StepProgress:
    """Rank 0's per-step progress (the ``step_progress`` of :func:`train`): a bar per epoch on a
    terminal, a plain line at most every 10 s otherwise."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.bar: Progress | None = None

    def __call__(self, info: dict[str, Any]) -> None:
        if info["epoch"] != self.epoch or self.bar is None:
            if self.bar is not None:
                self.bar.close()
            self.epoch = info["epoch"]
            self.bar = Progress(info["steps"], f"epoch {info['epoch']}/{info['epochs']}")
        self.bar.update(1, f"loss {info['loss']:.4f}")
        if info["step"] == info["steps"]:
            self.bar.close()
            self.bar = None


def run(args: argparse.Namespace) -> int:
    if not hasattr(args, "config"):  # called without the CLI's check
        check(args)
    config: TrainConfig = args.config
    loud = is_rank0()
    try:
        if loud:
            print(f"training {config.model} on {config.data} with {config.method} "
                  f"(P={config.workers}, net={config.net or 'loopback'}, {config.epochs} epochs, "
                  f"batch {config.batch_size}, lr {config.lr:g})", flush=True)
        record = train(config, progress=print_progress, step_progress=StepProgress())
    except DatasetUnavailable as exc:
        print(f"sparsecomm train: error: {exc}", file=sys.stderr)
        return 2
    if loud:
        written: list[str] = []
        save_or_fallback(lambda directory: written.append(save_record(record, directory)), args.runs_dir,
                         "run record")
        path = written[-1]
        print(f"network: {record['network']}; final accuracy {record['final_accuracy']:.2f}%; record: {path}")
    return 0
