"""The ``sparsecomm`` command line.

Sub-commands are discovered when the parser is built (never by ``import sparsecomm``): every command
module ``sparsecomm/cli/NAME.py`` (the library's commands: simulate, advise, calibrate) is
``sparsecomm NAME``. Packages that extend the command line declare entry points: each module of a
package named in the group ``sparsecomm.commands`` is a command too, and each module of a package named
in ``sparsecomm.benches`` is ``sparsecomm bench NAME``. The lab of the repository (``lab/``: train,
demo, report, the benches) extends it that way, so a clone has every command and an installed wheel has
the library's. Each command module defines ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``, and may define ``check(args)``: it validates every
option before any worker starts, and a ``ValueError`` it raises is printed as one line
``sparsecomm COMMAND: error: MESSAGE`` with exit status 2 (argparse's own errors have status 2 too).
Before that, every output option a command has (``--out``, ``--runs-dir``, ``--checkpoint-dir``, ...:
:data:`.outputs.OUTPUT_OPTIONS`) is checked writable, the same way.
``--help`` shows every option's default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
import traceback
from importlib.metadata import entry_points
from types import ModuleType

from ..launch.launcher import WorkerError
from .outputs import check_outputs

#: the commands the repository's lab adds (named when it is not installed)
LAB_COMMANDS = ("bench", "demo", "report", "train", "campaign", "imports")


def _extensions(group: str) -> dict[str, ModuleType]:
    """The command modules of every package that an installed distribution names in ``group``."""
    found: dict[str, ModuleType] = {}
    for point in entry_points(group=group):
        found.update(_discover(point.value))
    return found


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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already speaks of its default or
    the default is None or False (nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _add(group, name: str, module: ModuleType) -> None:
    # no abbreviated options: a prefix such as --model would silently stand for --model-file
    sub = group.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=DefaultsHelpFormatter,
                           allow_abbrev=False)
    module.add_arguments(sub)
    for action in sub._actions:  # argparse prints no help line for an option without help text
        if action.help is None and action.option_strings and action.default not in (None, False):
            action.help = "(default: %(default)s)"
    sub.set_defaults(_run=module.run, _check=getattr(module, "check", None))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsecomm", formatter_class=DefaultsHelpFormatter,
                                     description="Sparse gradient communication for data-parallel PyTorch "
                                     "training: benchmarks, training, reports.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    benches = _extensions("sparsecomm.benches")
    if benches:
        bench = commands.add_parser("bench", help="run a benchmark and print a markdown table")
        targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
        for name, module in sorted(benches.items()):
            _add(targets, name, module)
    for name, module in sorted({**_discover("sparsecomm.cli"), **_extensions("sparsecomm.commands")}.items()):
        _add(commands, name, module)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Workers are forked: keep this parent single-threaded in torch before any tensor work.
    import torch

    torch.set_num_threads(1)
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    command_word = next((w for w in words if not w.startswith("-")), None)
    if command_word in LAB_COMMANDS and command_word not in _subcommands(parser):
        print(f"sparsecomm {command_word}: error: this command belongs to the lab of the sparsecomm repository, "
              "which is not installed: from a clone, run `make venv` (or `pip install -e lab`)", file=sys.stderr)
        return 2
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as exit_:  # argparse's own errors (printed) and --help: the status, not an exception
        return int(exit_.code or 0)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    command = args.command + (f" {args.target}" if args.command == "bench" else "")
    if unknown:
        print(f"sparsecomm {command}: error: unrecognized arguments: {' '.join(unknown)} "
              f"(see sparsecomm {command} --help)", file=sys.stderr)
        return 2
    try:
        check_outputs(args)  # before any work: a destination that cannot be written would lose it
        if args._check is not None:
            args._check(args)
        return int(args._run(args) or 0)
    except (ValueError, TypeError, WorkerError) as err:
        # a user error, here or in a worker: one line, exit status 2 (the traceback with -v)
        if args.verbose:
            traceback.print_exc()
        print(f"sparsecomm {command}: error: {user_message(err)}", file=sys.stderr)
        return 2


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def user_message(err: BaseException) -> str:
    """The one line the CLI prints for ``err``: its message without a worker's traceback, on one line."""
    text = str(err)
    if isinstance(err, WorkerError) and err.worker_traceback:
        text = text.split("\n--- traceback of rank")[0]
    return " ".join(text.split())


def run(argv: list[str] | None = None) -> None:
    """The ``sparsecomm`` program: :func:`main`, then exit with its status.

    A process that trained under torchrun (``train`` there keeps torch.distributed's process group
    initialized: torch 2.13's DDP holds it to the end) exits the way ``multiprocessing``'s forked
    workers do, without finalizing the interpreter (``os._exit``, after flushing output and logs):
    every gloo collective's work object holds the Python context it was issued in, and the group's
    worker thread that drops the last one as the interpreter finalizes aborts the process
    ("terminate called without an active exception", exit -6)."""
    code = main(argv)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
