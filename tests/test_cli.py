"""The command line: discovery of bench targets and commands, and a real small benchmark run."""

import subprocess
import sys

import pytest

from sparsecomm.cli import build_parser, main
from sparsecomm.experiments.bench.common import parse_count, parse_networks


def test_bench_collectives_prints_a_table(capsys):
    assert main(["bench", "collectives", "--workers", "3", "--size", "2k", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "| loopback | ring | 3 | 2000 |" in out and "| loopback | rabenseifner | 3 | 2000 |" in out


def test_parsers():
    assert parse_count("25M") == 25_000_000 and parse_count("2.5k") == 2500 and parse_count("7") == 7
    with pytest.raises(ValueError, match="size 'lots' must be a number"):
        parse_count("lots")
    assert parse_networks("loopback,1gbit") == [None, "1gbit"]


def test_help_lists_bench_targets():
    help_text = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "collectives" in help_text


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "sparsecomm", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "bench" in proc.stdout
