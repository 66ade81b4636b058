"""``sparsecomm train``: data-parallel training with a sparse method; progress per epoch; a run
record (JSON) under runs/. Local workers by default; under torchrun, the real cluster."""

from __future__ import annotations

import argparse
import json

from ..data import DatasetUnavailable, available_datasets
from ..models import MODEL_DATA, available_models
from ..training import BASELINES, TrainConfig, save_record, train

HELP = "train a model with sparse gradient synchronization and write a run record under runs/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="local worker processes (ignored under torchrun)")
    parser.add_argument("--model", default="cnn", choices=available_models())
    parser.add_argument("--data", default=None, choices=available_datasets(),
                        help="data set (default: the model's first: " +
                             ", ".join(f"{m}: {d[0]}" for m, d in MODEL_DATA.items()) + ")")
    parser.add_argument("--method", default="spardl",
                        help="a sparsecomm method (sparsecomm.available_methods()) or a torch baseline: "
                             f"{', '.join(BASELINES)}")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--net", default=None, help="emulated network rate, e.g. 1gbit (default loopback)")
    parser.add_argument("--epochs", type=int, default=None, help="default: the model's tuned value (MODEL_DEFAULTS)")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker; default: the model's tuned value")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate; default: the model's tuned value")
    parser.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine",
                        help="cosine decays the learning rate to 0 over the run")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", choices=["ddp", "synchronizer"], default=None,
                        help="DDP with the comm hook, or SparseSynchronizer (needed for the DGC options); "
                        "default: the recommended recipe (training.SPARSE_RECIPE: ddp)")
    parser.add_argument("--dense-warmup-steps", type=int, default=None, help="default: the recipe's (0)")
    parser.add_argument("--clip-norm", type=float, default=None, help="local gradient clipping (synchronizer)")
    parser.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=None,
                        help="DGC momentum correction (synchronizer); default: the recipe's (off)")
    parser.add_argument("--density-warmup", type=int, default=None, help="DGC density warm-up epochs (synchronizer)")
    parser.add_argument("--method-options", default="{}", help='JSON dict of method options, e.g. \'{"teams": 2}\'')
    parser.add_argument("--train-size", type=int, default=None, help="subset of the training set (fashion-mnist, zipf)")
    parser.add_argument("--evals-per-epoch", type=int, default=1)
    parser.add_argument("--target-accuracy", type=float, default=None, help="record the time to reach it")
    parser.add_argument("--checkpoint-dir", default=None, help="save per-rank checkpoints here each epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    parser.add_argument("--runs-dir", default="runs")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    data_options = {} if args.train_size is None else {"train_size": args.train_size}
    return TrainConfig(
        model=args.model, data=args.data or MODEL_DATA[args.model][0], method=args.method,
        density=args.density, workers=args.workers, epochs=args.epochs, batch_size=args.batch_size,
        lr=args.lr, lr_schedule=args.lr_schedule, momentum=args.momentum, seed=args.seed, net=args.net, sync=args.sync,
        dense_warmup_steps=args.dense_warmup_steps, clip_norm=args.clip_norm,
        momentum_correction=args.momentum_correction, density_warmup=args.density_warmup,
        method_options=json.loads(args.method_options), data_options=data_options,
        evals_per_epoch=args.evals_per_epoch, target_accuracy=args.target_accuracy,
        checkpoint_dir=args.checkpoint_dir, resume=args.resume)


def print_progress(summary) -> None:
    density = "-" if summary["density"] is None else f"{summary['density']:.4f}"
    print(f"epoch {summary['epoch']:3d}  loss {summary['train_loss']:.4f}  test acc {summary['test_accuracy']:6.2f}%  "
          f"step {1e3 * summary['time_per_step']:7.1f} ms = compute {1e3 * summary['time_compute']:6.1f} + "
          f"select {1e3 * summary['time_select']:5.1f} + comm {1e3 * summary['time_comm']:6.1f} + "
          f"decompress {1e3 * summary['time_decompress']:5.1f}  "
          f"{summary['bytes_per_step'] / 1e3:8.1f} kB/step  density {density}", flush=True)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        config.validate()
        print(f"training {config.model} on {config.data} with {config.method} "
              f"(P={config.workers}, net={config.net or 'loopback'})", flush=True)
        record = train(config, progress=print_progress)
    except (ValueError, DatasetUnavailable) as exc:
        print(f"error: {exc}")
        return 2
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        path = save_record(record, args.runs_dir)
        print(f"network: {record['network']}; final accuracy {record['final_accuracy']:.2f}%; record: {path}")
    return 0
