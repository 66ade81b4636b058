"""Restart under torchrun (issue 23, item 4): after a kill -9 of one worker mid-epoch, torchrun's
--max-restarts with --resume auto resumes from the last checkpoint and ends bit-identical to an
uninterrupted run, residuals included. Script: tests/faultsuite/torchrun_restart.sh."""

import os
import socket
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "faultsuite", "torchrun_restart.sh")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _run(directory, kill):
    out = subprocess.run(["bash", SCRIPT, str(directory), str(_free_port()), "1" if kill else "0"],
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=500)
    assert "torchrun exit 0" in out.stdout, out.stdout + (directory / "out.log").read_text()[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.faults
def test_torchrun_restart_after_kill_resumes_bit_identically(tmp_path):
    killed = _run(tmp_path / "killed", kill=True)
    assert "killed" in killed
    log = (tmp_path / "killed" / "out.log").read_text()
    assert "exitcode: -9" in log, log
    # the kill came while training: before the first attempt ended (else the restart only resumes a
    # finished run, and the test checks nothing)
    assert log.index("exitcode: -9") < log.index("final accuracy"), log
    assert log.count("training mlp on digits") == 2, log  # it restarted once
    _run(tmp_path / "straight", kill=False)
    for rank in (0, 1):
        final = os.path.join("ck", "step-000000000004", f"rank-{rank:05d}-of-00002.pt")
        a = torch.load(tmp_path / "killed" / final, weights_only=False)["state"]
        b = torch.load(tmp_path / "straight" / final, weights_only=False)["state"]
        assert a["epoch"] == b["epoch"] == 4
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        residuals_a, residuals_b = a["sync"]["plan"]["residuals"], b["sync"]["plan"]["residuals"]
        assert residuals_a.keys() == residuals_b.keys() and residuals_b
        assert all(torch.equal(residuals_a[k], residuals_b[k]) for k in residuals_b)
