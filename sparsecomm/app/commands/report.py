"""``sparsecomm report RUN...``: a markdown (and optionally HTML) report with PNG plots comparing runs."""

from __future__ import annotations

import argparse

from ..report_table import markdown_table
from ..reporting import load_records, summary_rows, write_report

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
        print(f"error: {exc}")
        return 2
    paths = write_report(records, args.out, html_too=args.html, title=args.title)
    print(markdown_table(summary_rows(records)))
    print(f"\nreport: {paths['markdown']}" + (f" and {paths['html']}" if "html" in paths else ""))
    return 0
