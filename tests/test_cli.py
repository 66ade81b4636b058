"""The command line: discovery of bench targets and commands, and a real small benchmark run."""

import subprocess
import sys

import pytest
from sparsecomm_lab.bench.common import parse_count, parse_networks

from sparsecomm.cli import build_parser, main


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


def test_bench_step_times_the_sparse_step_of_every_method(capsys):
    """`bench step` times Ok-Topk's sparse step, not its 512 dense warm-up calls (which select nothing)."""
    from sparsecomm_lab.bench import step

    from sparsecomm.launch.launcher import run_workers

    rows = run_workers(1, step._worker, 200_000, [0.01], ["oktopk", "topka"], 2, 1, timeout=120)[0]
    assert all(call["select"] > 0 and call["total"] > 0 for name in ("oktopk@0.01", "topka@0.01")
               for call in rows[name])
    assert main(["bench", "step", "--n", "100k", "--P", "2", "--methods", "oktopk", "--repeat", "1",
                 "--warmup", "0"]) == 0
    assert "| oktopk | 2 | 0.01 |" in capsys.readouterr().out
