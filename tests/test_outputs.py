"""Outputs checked before the work, and a result that cannot be written after it saved somewhere named;
advise's inputs checked (no ZeroDivisionError)."""

import os
import time

import pytest

from sparsecomm.cli import main
from sparsecomm.cli.outputs import check_writable, save_or_fallback


@pytest.fixture
def blocked(tmp_path):
    """A path under a regular file: nothing can be written there, root or not."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return str(blocker / "out")


@pytest.mark.parametrize("argv, option", [
    (["calibrate", "--workers", "2", "--size", "1k", "--methods", "topk", "--repeat", "1", "--out"], "--out"),
    (["train", "--model", "mlp", "--data", "digits", "--workers", "2", "--epochs", "1", "--runs-dir"], "--runs-dir"),
    (["train", "--model", "mlp", "--data", "digits", "--workers", "2", "--epochs", "1", "--checkpoint-dir"],
     "--checkpoint-dir"),
    (["demo", "--net", "loopback", "--out"], "--out"),
    (["report", "runs", "--out"], "--out"),
])
def test_an_unwritable_output_is_refused_before_any_work(blocked, capsys, argv, option):
    start = time.monotonic()
    assert main([*argv, blocked]) == 2
    assert time.monotonic() - start < 20  # nothing ran: no worker, no measurement
    err = capsys.readouterr().err
    assert f"error: {option} {blocked!r} cannot be written: " in err and "is a file, not a folder" in err


def test_check_writable_creates_nothing(tmp_path):
    target = tmp_path / "new" / "deeper" / "profile.json"
    check_writable(str(target), "--out")
    assert os.listdir(tmp_path) == []


def test_a_write_that_fails_after_the_work_saves_the_result_elsewhere_and_says_where(tmp_path, capsys):
    def write(path):
        if str(tmp_path) in path:
            raise OSError(28, "No space left on device")
        with open(path, "w") as handle:
            handle.write("the result")

    where = save_or_fallback(write, str(tmp_path / "profile.json"), "profile")
    assert where != str(tmp_path / "profile.json") and os.path.basename(where) == "profile.json"
    with open(where) as handle:
        assert handle.read() == "the result"
    assert f"could not write the profile to {str(tmp_path / 'profile.json')!r} (No space left on device); " \
           f"saved it to {where!r} instead" in capsys.readouterr().err


def test_advise_checks_its_inputs(capsys):
    assert main(["advise", "--params", "0"]) == 2
    assert "error: --params 0 must be > 0" in capsys.readouterr().err
    assert main(["advise", "--params", "25M", "--workers", "1"]) == 0
    assert "P=1: a single worker exchanges no gradients" in capsys.readouterr().out
    assert main(["advise", "--params", "25M", "--workers", "0"]) == 2
