"""``sparsecomm demo``: the main job on a fresh machine, in a few minutes.

P = 4 local workers on an emulated 1 Gbit/s switch (loopback when the machine cannot emulate it,
said in the output), the VGG-style CNN on scikit-learn's digits, trained with plain DDP, DDP with
torch's PowerSGD hook, the ``dense`` method and every sparse method registered, same seed and
epochs; then the report (plots + table) and a summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import sys
import time

from ...methods import available_methods, method_class
from ..netemu import unavailable_reason
from ..report_table import markdown_table
from ..reporting import summary_rows, write_report
from ..training import TrainConfig, save_record, train

HELP = "train a CNN with every method at P=4 on an emulated 1 Gbit network and write a comparison report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4)
    parser.add_argument("--net", default="1gbit", help="emulated rate (loopback when unavailable); 'none' for loopback")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--data", default="digits", choices=["digits", "fashion-mnist"])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine schedule)")
    parser.add_argument("--target-accuracy", type=float, default=90.0)
    parser.add_argument("--methods", default=None,
                        help="comma-separated list (default: ddp, powersgd, dense and every sparse method)")
    parser.add_argument("--out", default=None, help="output folder (default runs/demo-<time>)")
    parser.add_argument("--copy-to", default=None, help="also copy the report folder here (e.g. docs/demo)")


def demo_methods() -> list:
    sparse = [m for m in available_methods() if method_class(m).sparse]
    return ["ddp", "powersgd", "dense"] + sparse


def run(args: argparse.Namespace) -> int:
    methods = args.methods.split(",") if args.methods else demo_methods()
    net = None if args.net in (None, "none", "loopback") else args.net
    if net is not None and unavailable_reason() is not None:
        print(f"note: cannot emulate {net} here ({unavailable_reason()}); running on loopback")
    out = args.out or os.path.join("runs", "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    command = "sparsecomm demo " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "sparsecomm demo"
    print(f"demo: {args.model} on {args.data}, P={args.workers}, net={net or 'loopback'}, "
          f"{args.epochs} epochs, methods: {', '.join(methods)}", flush=True)
    base = TrainConfig(model=args.model, data=args.data, workers=args.workers, epochs=args.epochs,
                       density=args.density, net=net, target_accuracy=args.target_accuracy,
                       lr=args.lr, lr_schedule="cosine", evals_per_epoch=2)
    records: list[dict] = []
    start = time.perf_counter()
    for name in methods:
        config = dataclasses.replace(base, method=name)
        begin = time.perf_counter()
        record = train(config)
        path = save_record(record, out, name=f"{len(records):02d}-{record['label'].replace('@', '-')}")
        record["_path"] = path
        records.append(record)
        print(f"  {record['label']:22s} acc {record['final_accuracy']:6.2f}%  "
              f"train {record['history'][-1]['train_time']:6.1f} s  (wall {time.perf_counter() - begin:5.1f} s)  "
              f"[{record['network']}]", flush=True)
    report_dir = os.path.join(out, "report")
    paths = write_report(records, report_dir, html_too=True, title="sparsecomm demo", command=command)
    print()
    print(markdown_table(summary_rows(records)))
    print(f"\nreport: {paths['markdown']} (total {time.perf_counter() - start:.0f} s)")
    if args.copy_to:
        if os.path.exists(args.copy_to):
            shutil.rmtree(args.copy_to)
        shutil.copytree(report_dir, args.copy_to)
        print(f"copied to {args.copy_to}")
    return 0
