"""``sparsecomm report RUN...``: a markdown (and optionally HTML) report with PNG plots comparing runs.

Runs are grouped by model, data, worker count P and network (:func:`sparsecomm.experiments.reporting.group_key`):
one group gives one report in ``--out``; several give one report per group in ``--out/GROUP/``, each
titled after its own setting."""

from __future__ import annotations

import argparse
import os
import sys

from sparsecomm.cli.table import markdown_table
from sparsecomm_lab.reporting import group_records, group_slug, load_records, summary_rows, write_report

HELP = "render a markdown/HTML report with plots comparing training run records"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run record JSON files (or folders of them)")
    parser.add_argument("--out", default="runs/report", help="output folder")
    parser.add_argument("--html", action="store_true", help="also write report.html")
    parser.add_argument("--title", default="sparsecomm training report")


def run(args: argparse.Namespace) -> int:
    try:
        records = load_records(args.runs)
    except (ValueError, OSError) as exc:
        print(f"sparsecomm report: error: {exc}", file=sys.stderr)
        return 2
    groups = group_records(records)
    for key, group in groups.items():
        model, data, P, network = key
        outdir = args.out if len(groups) == 1 else os.path.join(args.out, group_slug(key))
        title = args.title if len(groups) == 1 else f"{args.title}: {model} on {data}, P={P}, {network}"
        paths = write_report(group, outdir, html_too=args.html, title=title)
        if len(groups) > 1:
            print(f"## {model} on {data}, P={P}, {network}\n")
        print(markdown_table(summary_rows(group)))
        print(f"\nreport: {paths['markdown']}" + (f" and {paths['html']}" if "html" in paths else "") + "\n")
    return 0
