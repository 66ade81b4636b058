"""The rank hosting the store (rank 0 under env://) dies: every survivor raises the same error within
the timeout, saying the store is gone, and names no healthy rank (tests/faultsuite/store_death.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "faultsuite"))

import store_death  # noqa: E402


@pytest.mark.faults
@pytest.mark.slow
def test_the_store_hosts_death_reads_alike_on_every_survivor():
    results = store_death.run(3)
    assert [rank for rank, _, _ in results] == [0, 1, 2]
    survivors = {text for rank, _, text in results if rank > 0}
    assert len(survivors) == 1, survivors
    message = survivors.pop()
    assert message.startswith("RankStalledError: a collective failed and the process group's store is unreachable")
    assert "rank(s) [" not in message  # no rank is blamed
    assert all(seconds < 3 * store_death.TIMEOUT + 10 for rank, seconds, _ in results if rank > 0)
