"""``sparsecomm bench faults``: the fault-injection table of docs/reliability.md.

For each worker count P, one launch of P local workers runs every case of
:data:`sparsecomm.experiments.faults.CASES` on every method (rank P-1 gets the bad input); a cell shows the
outcome on every rank: ``error: <cause>, rank r, <ms>`` (the same error raised on every rank, naming
rank r and the cause, within the slowest rank's milliseconds), the documented behaviour (``empty
result`` for n = 0, ``skipped on all ranks`` with ``nonfinite="skip"``), or ``FAIL: ...``. Every cell
also required the method's state to be unchanged after an error and the next call on finite input to
give bit-identical replicas. Exit status 1 when any cell fails.
"""

from __future__ import annotations

import argparse

from sparsecomm.cli.table import markdown_table
from sparsecomm.methods import available_methods
from sparsecomm_lab.faults import CASES, run_faults

HELP = "fault injection: every method x case (NaN, Inf, n, dtype, density, n=0, skip) x P; markdown table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, nargs="+", default=[2, 3, 4], help="worker counts (default 2 3 4)")
    parser.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")
    parser.add_argument("--n", type=int, default=1000, help="gradient elements (default 1000)")
    parser.add_argument("--density", type=float, default=0.1)


def run(args: argparse.Namespace) -> int:
    names = args.methods or available_methods()
    rows, failed = [], 0
    for P in args.workers:
        results = run_faults(P, names, n=args.n, density=args.density)
        for name in names:
            row = {"method": name, "P": P}
            for case in CASES:
                ok, text = results[name][case]
                row[case] = text
                failed += not ok
            rows.append(row)
    rows.sort(key=lambda row: (row["method"], row["P"]))
    print(markdown_table(rows, ["method", "P", *CASES]))
    print(f"\n{failed} failing cell(s) of {len(rows) * len(CASES)}")
    return 1 if failed else 0
