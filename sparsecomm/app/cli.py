"""The ``sparsecomm`` command line.

Sub-commands are discovered: every module ``sparsecomm/commands/NAME.py`` is ``sparsecomm NAME`` and
every module ``sparsecomm/bench/NAME.py`` is ``sparsecomm bench NAME``. Each defines ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from types import ModuleType


def _discover(package: str) -> dict[str, ModuleType]:
    pkg = importlib.import_module(package)
    found = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        if hasattr(module, "run") and hasattr(module, "add_arguments"):
            found[info.name] = module
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsecomm", description="Sparse gradient communication for "
                                     "data-parallel PyTorch training: benchmarks, training, reports.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser("bench", help="run a benchmark and print a markdown table")
    targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    for name, module in _discover("sparsecomm.app.bench").items():
        sub = targets.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    for name, module in _discover("sparsecomm.app.commands").items():
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Workers are forked: keep this parent single-threaded in torch before any tensor work.
    import torch

    torch.set_num_threads(1)
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
