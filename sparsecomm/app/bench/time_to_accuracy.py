"""``sparsecomm bench time_to_accuracy``: wall time to a target test accuracy, side by side.

Plain DDP, DDP with torch's PowerSGD hook and sparsecomm methods (default: spardl), each trained
from the same seed at P workers on an emulated network (loopback when unavailable, said in the
table's note) until the target accuracy or the epoch limit. One process tree, one run after the
other, so the ratios are comparable on a noisy machine.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..report_table import markdown_table
from ..training import TrainConfig, train

HELP = "time to a target accuracy: plain DDP vs DDP+PowerSGD vs sparsecomm methods"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4)
    parser.add_argument("--net", default="1gbit")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--methods", default="ddp,powersgd,spardl")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--target-accuracy", type=float, default=90.0)
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--evals-per-epoch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine over --max-epochs)")


def run(args: argparse.Namespace) -> int:
    net = None if args.net in ("none", "loopback") else args.net
    base = TrainConfig(model=args.model, data=args.data, workers=args.workers, epochs=args.max_epochs,
                       density=args.density, net=net, target_accuracy=args.target_accuracy,
                       stop_at_target=True, evals_per_epoch=args.evals_per_epoch, seed=args.seed,
                       lr=args.lr, lr_schedule="cosine")
    rows, network = [], None
    for name in args.methods.split(","):
        record = train(dataclasses.replace(base, method=name))
        network = record["network"]
        epochs = record["epochs"]
        ttt = record["time_to_target"]
        rows.append({"method": record["label"],
                     f"time to {args.target_accuracy:g}% (s)": "not reached" if ttt is None else ttt,
                     "epochs run": len(epochs), "ms/step": 1e3 * sum(e["time_per_step"] for e in epochs) / len(epochs),
                     "final acc %": record["final_accuracy"]})
    print(f"{args.model} on {args.data}, P={args.workers}, network: {network}; training wall time "
          f"(evaluation excluded) until the test accuracy first reaches {args.target_accuracy:g}% "
          f"(evaluated {args.evals_per_epoch}x per epoch)\n")
    print(markdown_table(rows))
    return 0
