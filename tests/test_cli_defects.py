"""The command-line defects of issue 13 ("Why"), one test each: every one failed before its fix.

Option errors are checked before any worker starts: these tests replace the launcher with one that
fails the test if it is called.
"""

import io
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from sparsecomm_lab import training
from sparsecomm_lab.progress import Progress, is_terminal, progress_iter
from sparsecomm_lab.reporting import group_records, write_report
from sparsecomm_lab.training import save_record

from sparsecomm.cli import _discover, build_parser, main
from sparsecomm.launch.netemu import parse_rate


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a worker group is started."""

    def refuse(*args, **kwargs):
        raise AssertionError("a worker group was started before the options were checked")

    monkeypatch.setattr(training, "run_workers", refuse)


def _one_line_error(capsys, command: str) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"sparsecomm {command}: error: ")
    return lines[0]


# -- train: option errors are one line, exit 2, before any worker -----------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--method-options", '{"foo": 3}'], r"--method-options: spardl: unknown option 'foo'; valid options: density"),
    (["--method", "topka", "--method-options", '{"teams": 2}'],
     r"--method-options: topka: unknown option 'teams'; valid options: density, selector, cap, nonfinite; and those "
     r"of its selector 'exact_topk'"),
    (["--method-options", "{bad"], r"--method-options '\{bad' is not valid JSON"),
    (["--method-options", "[1, 2]"], r"must be a JSON object"),
    (["--method", "ddp", "--method-options", '{"teams": 2}'], r"ddp is a torch DDP baseline"),
    (["--model", "lstm", "--data", "digits"], r"--model lstm does not fit --data digits; it trains on: fortunes"),
    (["--method", "spardll"], r"unknown method 'spardll'; valid names: ddp, powersgd, .*spardl"),
    (["--net", "1gbps"], r"ambiguous: tc reads 'gbps' as bytes per second \(8gbit\).*1gbit"),
    (["--net", "fast"], r"rate='fast' is not a tc rate"),
])
def test_train_option_error_is_one_line_exit_2_before_workers(argv, expected, no_workers, capsys):
    assert main(["train", *argv]) == 2
    assert re.search(expected, _one_line_error(capsys, "train"))


def test_byte_rates_are_refused_naming_both_readings():
    with pytest.raises(ValueError, match=r"tc reads 'mbps' as bytes per second \(80mbit\).*\(10mbit\)"):
        parse_rate("10mbps")
    assert parse_rate("1gbit") == 1e9


def test_train_help_shows_defaults(capsys):
    assert main(["train", "--help"]) == 0  # --help prints and ends with status 0, not an exception
    out = " ".join(capsys.readouterr().out.split())
    for option, default in (("--workers", "4"), ("--momentum", "0.9"),
                            ("--lr-schedule", "cosine"), ("--runs-dir", "runs")):
        assert re.search(re.escape(option) + r" .*?\(default: " + re.escape(default) + r"\)", out), option
    assert re.search(r"--density .*?default: the recipe's \(training.sparse_recipe: for TopkA-like methods under "
                     r"momentum correction 0.001 on word-lstm, 0.005 on vgg-fc; under AdamW's recipe "
                     r"0.01 on gpt; else 0.01\)", out)


def test_every_command_help_shows_defaults():
    """Every sub-command's options with a default show it (the formatter is on every parser)."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("simulate", "advise", "calibrate", "report"):
        assert "(default: " in commands[name].format_help(), name


# -- train: progress, a short run learns, shell-safe run names ---------------------------------------

def test_short_train_run_prints_progress_learns_and_names_its_file_safely(tmp_path, capfd):
    """A run on digits with every hyperparameter at its default (the model's tuned epochs, batch size
    and learning rate): per-step progress (plain lines off a terminal), an epoch line, accuracy far
    above chance (10%), and a shell-safe record name. Rank 0 prints from its worker process: captured
    at the file descriptors."""
    assert main(["train", "--model", "mlp", "--data", "digits", "--method", "ddp", "-P", "2",
                 "--runs-dir", str(tmp_path)]) == 0
    captured = capfd.readouterr()
    assert re.search(r"^epoch 1/\d+: 1/\d+ loss ", captured.err, re.M)
    assert re.search(r"^epoch   1  loss ", captured.out, re.M)
    (path,) = tmp_path.iterdir()
    record = json.loads(path.read_text())
    assert record["final_accuracy"] > 50.0
    assert re.fullmatch(r"[A-Za-z0-9._-]+", path.name)


def test_run_file_names_are_shell_safe(tmp_path):
    record = {"config": {"model": "cnn", "data": "digits"}, "label": "powersgd(r=2)"}
    name = os.path.basename(save_record(record, str(tmp_path)))
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name) and name.endswith("-cnn-digits-powersgd-r-2.json")


def test_plain_progress_lines_off_a_terminal():
    stream = io.StringIO()
    with Progress(3, "epoch 1/2", stream=stream, interval=3600) as bar:
        for _ in range(3):
            bar.update(1, "loss 0.5")
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["epoch 1/2: 1/3 loss 0.5", "epoch 1/2: 3/3 loss 0.5"]
    stream = io.StringIO()
    assert list(progress_iter(["a", "b"], "bench x", stream=stream)) == ["a", "b"]
    assert stream.getvalue().splitlines()[:2] == ["bench x: 1/2 a", "bench x: 2/2 b"]


def test_progress_bar_on_a_terminal():
    """bar=True (what a terminal gets): a tqdm bar redrawn in place (carriage returns), no plain lines."""
    stream = io.StringIO()
    with Progress(3, "epoch 1/1", stream=stream, bar=True) as bar:
        for _ in range(3):
            bar.update(1, "loss 0.5")
    text = stream.getvalue()
    assert re.search(r"\repoch 1/1: +0%\|", text) and "\n" not in text
    assert not is_terminal(io.StringIO())


def test_bench_announces_each_configuration(capsys):
    assert main(["bench", "collectives", "-P", "2", "--size", "1k", "--repeat", "1", "--methods", "dense,ring"]) == 0
    err = capsys.readouterr().err
    assert "bench collectives: 1/2 dense on loopback" in err and "bench collectives: 2/2 ring on loopback" in err


# -- torchrun: world size from the environment, only rank 0 prints ----------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_size_from_torchrun_environment(monkeypatch):
    from sparsecomm_lab.commands import train as train_command

    args = build_parser().parse_args(["train", "--model", "mlp", "--data", "digits"])
    assert train_command.config_from_args(args).workers == 4 and train_command.is_rank0()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_command.config_from_args(args).workers == 2 and not train_command.is_rank0()


@pytest.mark.slow
def test_torchrun_world_size_and_rank0_output(tmp_path):
    """Two torchrun ranks with the --workers default (4): the record says 2 workers, the banner says
    P=2, and it is printed once."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         "-m", "sparsecomm", "train", "--model", "mlp", "--data", "digits", "--method", "ddp", "--epochs", "1",
         "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("training mlp on digits") == 1, proc.stdout
    assert "(P=2," in proc.stdout
    assert proc.stdout.count("epoch   1  loss") == 1
    (path,) = tmp_path.iterdir()
    record = json.loads(path.read_text())
    assert record["config"]["workers"] == 2 and "2 ranks" in record["network"]


_EXIT_PROBE = """
import atexit, sys
atexit.register(lambda: print("interpreter finalized", flush=True))
from sparsecomm.cli import run
run(sys.argv[1:])
"""


def test_a_torchrun_rank_exits_without_finalizing_the_interpreter(tmp_path):
    """A rank that trained under torchrun leaves through ``os._exit`` after flushing (its gloo worker
    threads may still drop a collective's Python context then, which aborted ~1 run in 10 as the
    interpreter finalized): atexit handlers do not run, the output and the record are complete."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for elastic in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):  # a plain env:// launch
        env.pop(elastic, None)
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE, "train", "--model", "mlp", "--data", "digits",
                           "--method", "topka", "--epochs", "1", "--runs-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interpreter finalized" not in proc.stdout
    assert "final accuracy" in proc.stdout and "record: " in proc.stdout
    (path,) = tmp_path.iterdir()
    assert json.loads(path.read_text())["network"] == "torchrun cluster (1 ranks)"


def test_the_program_exits_normally_without_a_process_group():
    """Without torch.distributed initialized, ``run`` finalizes as usual, with main's exit status."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE, "simulate", "--method", "no-such-method"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "interpreter finalized" in proc.stdout
    assert proc.stderr.startswith("sparsecomm simulate: error:"), proc.stderr


# -- report: grouped by model, data, P and network ------------------------------------------------------

def _record(model: str, label: str, workers: int = 4, network: str = "loopback") -> dict:
    epoch = {"time_per_step": 0.01, "time_compute": 0.005, "time_select": 0.001, "time_comm": 0.003,
             "time_decompress": 0.001, "bytes_per_step": 1000.0, "density": 0.01}
    return {"config": {"model": model, "data": "digits", "workers": workers, "epochs": 1, "batch_size": 16,
                       "lr": 0.1, "seed": 0, "target_accuracy": None},
            "label": label, "network": network, "host": {"hostname": "h", "cpus": 2, "torch": "x"},
            "history": [{"train_time": 1.0, "test_accuracy": 50.0}], "epochs": [epoch],
            "steps": [{"step": 1, "density": 0.01}], "final_accuracy": 50.0, "time_to_target": None}


def test_report_groups_runs_and_titles_each_group(tmp_path, capsys):
    files = []
    for i, (model, label, P) in enumerate([("cnn", "ddp", 4), ("mlp", "ddp", 4), ("cnn", "spardl@0.01", 4),
                                           ("cnn", "ddp", 2)]):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(_record(model, label, P)))
        files.append(str(path))
    out = tmp_path / "report"
    assert main(["report", *files, "--out", str(out), "--title", "T"]) == 0
    folders = sorted(p.name for p in out.iterdir())
    assert folders == ["cnn-digits-P2-loopback", "cnn-digits-P4-loopback", "mlp-digits-P4-loopback"]
    cnn4 = (out / "cnn-digits-P4-loopback" / "report.md").read_text()
    assert cnn4.startswith("# T: cnn on digits, P=4, loopback") and "spardl@0.01" in cnn4
    assert "mlp" not in cnn4.split("\n")[0]
    assert "# T: mlp on digits, P=4" in (out / "mlp-digits-P4-loopback" / "report.md").read_text()


def test_write_report_refuses_a_mix(tmp_path):
    mixed = [_record("cnn", "ddp"), _record("mlp", "ddp")]
    assert len(group_records(mixed)) == 2
    with pytest.raises(ValueError, match="one model, data, P and network.*cnn on digits.*mlp on digits"):
        write_report(mixed, str(tmp_path))


# -- simulate: every method, "unknown method" ----------------------------------------------------------------

@pytest.mark.parametrize("method", ["hitopk", "redsync"])
def test_simulate_runs_hierarchical_and_layered_methods_with_density(method, capsys):
    assert main(["simulate", "--methods", method, "--density", "0.01", "-P", "8,16", "-n", "1M"]) == 0
    assert f"| {method} |" in capsys.readouterr().out


def test_simulate_every_available_method(capsys):
    assert main(["simulate", "--methods", "all", "--density", "0.001", "-P", "4,8", "-n", "100k"]) == 0
    out = capsys.readouterr().out
    from sparsecomm.methods import available_methods

    assert all(f"| {m} |" in out for m in available_methods())


def test_simulate_unknown_method_lists_choices(capsys):
    assert main(["simulate", "--methods", "topk,hitopkk"]) == 2
    line = _one_line_error(capsys, "simulate")
    assert "unknown method 'hitopkk'; valid names: " in line and "hitopk" in line


# -- bench: defaults hold at any P -------------------------------------------------------------------------

def _bench_args(name: str, P: int):
    """The bench's defaults with P workers (-P or --workers, whichever it has) and a small size."""
    parser = build_parser()
    target = parser._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0].choices[name]
    options = {opt for action in target._actions for opt in action.option_strings}
    argv = ["bench", name]
    if "--workers" in options:
        argv += ["--workers", str(P)]
    if "--size" in options:
        argv += ["--size", "20k"]
    return parser.parse_args(argv), "--workers" in options


@pytest.mark.parametrize("P", [2, 3])
def test_every_bench_accepts_its_defaults_at_any_P(P):
    checked = []
    for name, module in _discover("sparsecomm_lab.bench").items():
        args, takes_P = _bench_args(name, P)
        if hasattr(module, "check"):
            module.check(args)  # raises ValueError on a default that does not hold at this P
            checked.append(name)
    assert {"spardl", "methods", "collectives", "redsync", "exdyna", "simvalidate", "launch", "pto"} <= set(checked)


def test_bench_error_is_one_line_exit_2(capsys):
    assert main(["bench", "spardl", "-P", "3", "--teams", "2"]) == 2
    assert "--teams: '2' must be 'auto' or a positive divisor of P=3" in _one_line_error(capsys, "bench spardl")
    assert main(["bench", "methods", "--methods", "topk,nope"]) == 2
    assert "unknown method 'nope'" in _one_line_error(capsys, "bench methods")
    assert main(["bench", "collectives", "--net", "1gbps"]) == 2
    assert "ambiguous" in _one_line_error(capsys, "bench collectives")


@pytest.mark.parametrize("P", [2, 3])
def test_bench_spardl_runs_with_its_defaults_at_small_P(P, capsys):
    assert main(["bench", "spardl", "-P", str(P), "--size", "4k", "--repeat", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    teams = [1, 2] if P == 2 else [1]
    for d in teams:
        assert f"| spardl teams={d} |" in out
    assert "| spardl teams=4 |" not in out and "| spardl teams=auto |" in out


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3])
def test_bench_methods_runs_every_method_at_small_P(P, capsys):
    assert main(["bench", "methods", "-P", str(P), "--size", "6k", "--repeat", "1", "--warmup", "0"]) == 0
    from sparsecomm.methods import available_methods

    out = capsys.readouterr().out
    assert all(f"| loopback | {m} |" in out for m in available_methods())


@pytest.mark.parametrize("argv, expected", [
    (["--method", "spardl", "--method-options", '{"teams": 3}'], "teams=3 must be a positive integer dividing"),
    (["--method", "gtopk", "--sync", "synchronizer", "--momentum-correction"], "momentum_correction needs a method"),
    (["--checkpoint-dir", "{tmp}/none", "--resume"], "cannot resume: no complete checkpoint in"),
])
def test_worker_errors_are_one_line_exit_2(argv, expected, tmp_path, capsys):
    """Issue 23, item 6: user errors raised in workers print one line, no traceback, exit status 2."""
    from sparsecomm.cli import main

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", "--model", "mlp", "--data", "digits", "-P", "2", "--epochs", "1", "--density", "0.1",
                 "--runs-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sparsecomm train: error: rank ") and expected in err[0], err
    assert "Traceback" not in err[0]
