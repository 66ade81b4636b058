"""``sparsecomm train`` killed with SIGKILL while an epoch's checkpoint is written, then resumed with
``--resume auto``: every rank resumes at the same epoch and the run ends bit-identical to one that was
never killed (tests/faultsuite/torn_checkpoint.py; the table in docs/reliability.md)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "faultsuite"))

import torn_checkpoint  # noqa: E402


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize("point", torn_checkpoint.POINTS)
def test_a_kill_during_an_epochs_checkpoint_resumes_every_rank_at_the_same_epoch(tmp_path, point):
    result = torn_checkpoint.run_case(str(tmp_path), point)
    assert "rank 1" in result["died"]
    assert len(set(result["resumed_from"])) == 1
    assert result["resumed_from"][0] == (2 if point == "after_commit" else 1)
    assert result["resumed_epochs"] == 3 and result["consistent"] and result["equal_to_uninterrupted"]
